"""The DPO mode of ``load_config`` (``llm/run_dpo.py``), without importing paddle.

``load_config(path, overrides, mode="dpo")`` accepts the ``dpo`` key group
(``schema.DPOArgument``: PaddleNLP's DPOConfig and DPODataArgument keys) on
top of the model / training keys; this module holds what differs from
fine-tuning: SFT-only keys refused with the DPO key to use instead, PaddleNLP's
own rewrites of DPO settings (logged as derived settings), and the DPO cross
checks (ranges, loss / reference combinations, data files).
"""

from __future__ import annotations

import os
from typing import List, Optional

from ..adapters.config import ADAPTER_METHOD_KEYS

#: SFT-only keys -> what to use in a DPO config (None: no DPO counterpart).
SFT_ONLY_KEYS = {
    "dataset_name_or_path": "train_dataset_path (and dev_dataset_path): preference files or directories",
    "src_length": "max_prompt_len",
    "max_length": "max_seq_len",
    "intokens": "zero_padding",
    "pad_to_multiple_of": None,
    "pad_to_max_length": None,
    "eval_with_do_generation": None,
    "save_generation_output": None,
    "top_k": None,
    "top_p": None,
    "autoregressive": None,
    "use_pose_convert": None,
    "task_name": None,
}

#: as paddlenlp_ext.dpo.losses (kept as text: no paddle import here)
REFERENCE_FREE_CAPABLE = ("sigmoid", "hinge", "ipo", "or", "simpo")
REFERENCE_FREE_ONLY = ("or", "simpo")
LABEL_SMOOTHING_LOSSES = ("sigmoid", "simpo")
#: metric_for_best_model values of a DPO run (the eval metrics DPOTrainer reports, without "eval_")
DPO_BEST_METRICS = (
    "loss",
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
)


def sft_key_problem(key: str, origin: str, title: str = "DPO", doc: str = "docs/dpo.md") -> Optional[str]:
    """The message for an SFT-only key in a DPO (KTO, reward) config, or None if ``key`` is not one."""
    if key not in SFT_ONLY_KEYS:
        return None
    instead = SFT_ONLY_KEYS[key]
    what = f"use {instead} instead" if instead else "it has no meaning for preference training; remove it"
    return f"{origin}: {key!r} is a fine-tuning (llm/run_finetune.py) key; in a {title.upper()} config {what} ({doc})"


def apply_preference_aliases(cfg, name: str) -> None:
    """What run_dpo.py and run_kto.py both rewrite: zero padding on by default, rslora_plus."""
    o, m, d = cfg.alignment, cfg.model, cfg.data
    if "zero_padding" not in cfg.explicit and "intokens" not in cfg.explicit and not d.zero_padding:
        # PaddleNLP's run_dpo / run_kto always build a zero-padding stream (their data keys have no
        # zero_padding; greedy_zero_padding picks the packer); zero_padding: false is our opt-out to one pair per row
        d.zero_padding = True
        cfg.derived["zero_padding"] = (
            f"True ({name} packs pairs into rows of max_seq_len, as PaddleNLP's run_{name.lower()})"
        )
    if o.rslora_plus:  # PaddleNLP's DPO / KTO shortcut for rsLoRA + LoRA+
        for key, value in (("rslora", True), ("lora_plus_scale", 4.0), ("lora_alpha", 4)):
            if key in cfg.explicit and getattr(m, key) != value:
                continue  # the cross checks report the contradiction
            if getattr(m, key) != value:
                setattr(m, key, value)
                cfg.derived[key] = f"{value} (rslora_plus=true)"


def apply_dpo_aliases(cfg) -> None:
    """PaddleNLP's run_dpo.py rewrites, made visible as derived settings (before the cross checks)."""
    o = cfg.alignment
    apply_preference_aliases(cfg, "DPO")
    if o.loss_type == "orpo":  # run_dpo.py: orpo = or + SFT term + no reference
        o.loss_type = "or"
        cfg.derived["loss_type"] = "or (from orpo: ORPO's odds-ratio term plus the SFT term)"
        if o.sft_loss_ratio != 1.0:
            cfg.derived["sft_loss_ratio"] = f"1.0 (loss_type orpo; was {o.sft_loss_ratio})"
            o.sft_loss_ratio = 1.0
        if not o.reference_free:
            o.reference_free = True
            cfg.derived["reference_free"] = "True (loss_type orpo is reference free)"
    if o.loss_type in REFERENCE_FREE_ONLY and not o.reference_free:
        o.reference_free = True
        cfg.derived["reference_free"] = f"True (loss_type {o.loss_type} is reference free, as PaddleNLP sets it)"


def dpo_problems(cfg, where: str) -> List[str]:
    """The DPO cross checks (config/modes.py's row for llm/run_dpo.py)."""
    o = cfg.alignment
    p: List[str] = []
    if not 0.0 <= o.label_smoothing < 0.5:
        p.append(
            f"{where}: label_smoothing must be in [0, 0.5) (the probability that a label is flipped); "
            f"got {o.label_smoothing}"
        )
    elif o.label_smoothing > 0 and o.loss_type not in LABEL_SMOOTHING_LOSSES:
        p.append(
            f"{where}: label_smoothing={o.label_smoothing} has no effect with loss_type {o.loss_type!r}; "
            f"only {' and '.join(LABEL_SMOOTHING_LOSSES)} use it"
        )
    if o.reference_free and o.loss_type not in REFERENCE_FREE_CAPABLE:
        p.append(
            f"{where}: loss_type {o.loss_type!r} needs the reference model; reference_free=true works with "
            f"{', '.join(REFERENCE_FREE_CAPABLE)}"
        )
    if o.pref_loss_ratio == 0 and o.sft_loss_ratio == 0:
        p.append(f"{where}: pref_loss_ratio and sft_loss_ratio are both 0: nothing to train")
    return p + preference_problems(cfg, where, "DPO", DPO_BEST_METRICS, named_datasets=True)


def unread_dataset_dir(cfg, where: str, name: str) -> List[str]:
    """dataset_dir names datasets for fine-tuning, DPO and reward models only: refused elsewhere, not ignored."""
    if cfg.data.dataset_dir is None:
        return []
    return [
        f"{where}: dataset_dir (LLaMA-Factory's dataset_info.json) is read by llm/run_finetune.py, run_dpo.py and "
        f"run_reward.py; {name} reads train_dataset_path as a file or directory: remove dataset_dir"
    ]


def preference_problems(
    cfg, where: str, name: str, best_metrics, score_head: bool = False, named_datasets: bool = False
) -> List[str]:
    """The checks DPO, KTO and reward models share: reference updates, lengths, adapters, parallelism, data
    files.  ``score_head``: a reward model (its score head is not split over ranks); ``named_datasets``: the
    data paths may name an entry of dataset_dir's dataset_info.json (DPO and reward data)."""
    o, m, d, t = cfg.alignment, cfg.model, cfg.data, cfg.training
    p: List[str] = []
    methods = [k for k in ADAPTER_METHOD_KEYS if getattr(m, k)]
    if o.ref_model_update_steps == 0 or o.ref_model_update_steps < -1:
        p.append(
            f"{where}: ref_model_update_steps must be > 0 (sync every N steps) or -1 (never); "
            f"got {o.ref_model_update_steps}"
        )
    elif o.ref_model_update_steps > 0:
        if o.reference_free:
            p.append(
                f"{where}: ref_model_update_steps={o.ref_model_update_steps} with reference_free=true: there "
                "is no reference model to update; remove one of them"
            )
        elif methods:
            p.append(
                f"{where}: ref_model_update_steps={o.ref_model_update_steps} needs full fine-tuning: with "
                f"{methods[0]} adapters the reference is the base model with the adapters switched off "
                "(no copy to update; PaddleNLP fails the same way); set it to -1"
            )
    if o.max_prompt_len >= o.max_seq_len:
        p.append(
            f"{where}: max_prompt_len ({o.max_prompt_len}) must be < max_seq_len ({o.max_seq_len}): the "
            "answers need room in the sequence"
        )
    if o.rslora_plus and not m.lora:
        p.append(f"{where}: rslora_plus=true needs lora=true")
    elif o.rslora_plus:
        for key, value in (("rslora", True), ("lora_plus_scale", 4.0), ("lora_alpha", 4)):
            if key in cfg.explicit and getattr(m, key) != value:
                p.append(
                    f"{where}: rslora_plus=true sets {key}={value}, but the config says {getattr(m, key)}; "
                    "remove one of them"
                )
    if m.pissa and not o.reference_free:
        p.append(
            f"{where}: pissa=true moves the top singular part of the base weights into the adapter, so the "
            "base with the adapters off is not the reference model; use lora without pissa, or "
            "reference_free=true"
        )
    if m.neftune:
        p.append(
            f"{where}: neftune=true is not supported for {name} (it perturbs the policy's embeddings but not "
            "the reference's); remove it"
        )
    if m.prefix_tuning or m.prefix_path:
        p.append(
            f"{where}: prefix tuning is not supported for {name} yet; use lora, vera or lokr (or full fine-tuning)"
        )
    if t.get("tensor_parallel_degree", 1) > 1:
        why = (
            "the score head is not split over ranks"
            if score_head
            else "the per-answer log-probs need the whole vocabulary of logits"
        )
        p.append(f"{where}: tensor_parallel_degree > 1 is not supported for {name} yet ({why})")
    if d.zero_padding and m.use_flash_attention and not m.flash_mask:
        p.append(
            f"{where}: zero_padding with use_flash_attention needs flash_mask=true (the pairs of a packed "
            "row are separated by a start-row mask)"
        )
    best = t.get("metric_for_best_model")
    if best is not None and best.removeprefix("eval_") not in best_metrics:
        p.append(
            f"{where}: metric_for_best_model {best!r} is not a {name} eval metric; use one of {', '.join(best_metrics)}"
        )
    do_train, do_eval = t.get("do_train", False), t.get("do_eval", False)
    from .data_checks import dataset_dir_problems, is_entry, named_dataset_problems

    named = named_datasets
    p += dataset_dir_problems(d.dataset_dir, where) if named else []
    for flag, key, split in ((do_train, "train_dataset_path", "train"), (do_eval, "dev_dataset_path", "dev")):
        path = getattr(o, key)
        if not flag:
            continue
        if not path:
            p.append(f"{where}: {key} is required with do_{'train' if split == 'train' else 'eval'}")
        elif named and is_entry(path, d.dataset_dir):  # a name of dataset_info.json
            p += named_dataset_problems(path, d.dataset_dir, where, ranking=True)
        elif os.path.isdir(path):
            from ..data.reader import find_split_files

            if not find_split_files(path, split):
                p.append(f"{where}: {key} {path!r} is a directory without {split}.json or {split}/*.json")
        elif not os.path.isfile(path):
            p.append(
                f"{where}: {key} {path!r} does not exist (a JSON-lines file or a directory with "
                f"{split}.json"
                + (f", or a dataset of {d.dataset_dir}/dataset_info.json" if d.dataset_dir and named else "")
                + ")"
            )
    return p
