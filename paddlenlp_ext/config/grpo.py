"""The GRPO mode of ``load_config`` (``llm/run_grpo.py``), without importing paddle.

``load_config`` in the GRPO mode (``config.modes.MODES``) accepts the GRPO keys (``schema.GRPOArgument``: TRL's
GRPOConfig names) on top of the model / training keys, held in ``cfg.alignment`` (the alignment key group,
so the model build, the planner and resume read one place as for DPO and KTO).  This module holds the
GRPO rewrites (zero padding on, rslora_plus) and cross checks: the reward functions are imported here,
so a missing module or function is reported before anything is loaded (exit 2, naming the key).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable, List, Tuple

from .dpo import SFT_ONLY_KEYS, apply_preference_aliases
from .environment import world_size

#: fine-tuning keys with a GRPO counterpart
GRPO_INSTEAD = {
    "dataset_name_or_path": "train_dataset_path",
    "src_length": "max_prompt_len",
    "max_length": "max_completion_length (and max_prompt_len)",
    "intokens": "zero_padding",
}
REWARD_SCORER = "paddlenlp_ext.reward.scorer"


def apply_grpo_aliases(cfg) -> None:
    """Zero padding on unless the config says otherwise (rows of prompt + completion sequences), rslora_plus."""
    apply_preference_aliases(cfg, "GRPO")
    o = cfg.alignment
    raw = o.scale_rewards
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):  # --scale_rewards false from the CLI
        raw = raw.strip().lower() == "true"
    if isinstance(raw, bool):  # TRL's older boolean spelling
        o.scale_rewards = "group" if raw else "none"
        cfg.derived["scale_rewards"] = f"{o.scale_rewards} (from {str(raw).lower()}, TRL's older spelling)"
    if "zero_padding" in cfg.derived:
        cfg.derived["zero_padding"] = (
            f"True ({cfg.alignment.mode.upper()} packs the prompt + completion sequences "
            "of a step into rows of "
            "max_prompt_len + max_completion_length, separated by start-row masks)"
        )


def resolve_reward_func(spec: str) -> Tuple[Callable, str]:
    """``"pkg.module:function"`` -> (the function, its display name); ValueError saying what is wrong.

    >>> resolve_reward_func("paddlenlp_ext.grpo.rewards:contains_keyword")[1]
    'contains_keyword'
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f'{spec!r} is not "package.module:function"')
    module_name, func_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{spec!r}: cannot import module {module_name!r} ({e}); is it on PYTHONPATH?") from None
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        raise ValueError(f"{spec!r}: module {module_name!r} has no function {func_name!r}")
    return func, func_name


def reward_scorer_available() -> bool:
    """True when this build has the reward-model scorer (``paddlenlp_ext.reward``, llm/run_reward.py)."""
    try:
        return importlib.util.find_spec(REWARD_SCORER) is not None
    except ImportError:  # the paddlenlp_ext.reward package itself is absent
        return False


def grpo_problems(cfg, where: str) -> List[str]:
    """llm/run_grpo.py's cross checks: the rollout ones PPO shares, then the loss keys and the tools."""
    return _rollout_problems(cfg, where, lambda: loss_problems(cfg, where) + tool_problems(cfg, where))


def ppo_problems(cfg, where: str) -> List[str]:
    """llm/run_ppo.py's cross checks: the rollout ones GRPO shares, then PPO's own."""

    def own() -> List[str]:
        if world_size() > 1:  # the value head is applied outside the data-parallel wrapper's forward
            return [
                f"{where}: PPO runs on one process for now (its value head is not yet part of the data-parallel "
                "forward); launch llm/run_ppo.py without paddle.distributed.launch"
            ]
        if not cfg.alignment.top_p <= 1.0:
            return [f"{where}: top_p must be in (0, 1]; got {cfg.alignment.top_p}"]
        return []

    return _rollout_problems(cfg, where, own)


def _rollout_problems(cfg, where: str, own: Callable[[], List[str]]) -> List[str]:
    o, m, d, t = cfg.alignment, cfg.model, cfg.data, cfg.training
    name = o.mode.upper()  # GRPO or PPO
    p: List[str] = []
    for key in sorted(cfg.explicit & (set(SFT_ONLY_KEYS) - {"top_p"})):
        instead = GRPO_INSTEAD.get(key)
        p.append(
            f"{where}: {key!r} is a fine-tuning (llm/run_finetune.py) key; in a {name} config "
            + (f"use {instead} instead" if instead else "it has no meaning: remove it")
            + " (docs/alignment.md)"
        )
    funcs = list(o.reward_funcs or [])
    for i, spec in enumerate(funcs):
        try:
            resolve_reward_func(spec)
        except ValueError as e:
            p.append(f"{where}: reward_funcs[{i}]: {e}")
    n_rewards = len(funcs) + int(bool(o.reward_model_name_or_path))
    if n_rewards == 0:
        p.append(
            f'{where}: no reward: set reward_funcs (e.g. ["paddlenlp_ext.grpo.rewards:contains_keyword"]) '
            "and/or reward_model_name_or_path"
        )
    if o.reward_model_name_or_path:
        if not reward_scorer_available():
            p.append(
                f"{where}: reward_model_name_or_path needs the reward-model scorer ({REWARD_SCORER}, "
                "llm/run_reward.py), which this build does not have; use reward_funcs"
            )
        elif not os.path.isdir(o.reward_model_name_or_path):
            p.append(f"{where}: reward_model_name_or_path {o.reward_model_name_or_path!r} is not a directory")
    if o.reward_weights is not None and len(o.reward_weights) != n_rewards:
        p.append(
            f"{where}: reward_weights has {len(o.reward_weights)} value(s) for {n_rewards} reward(s) "
            "(reward_funcs in order, then the reward model); give one weight each"
        )
    p += own()
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        if t.get(key, 1) > 1:
            p.append(
                f"{where}: {key} > 1 is not supported for {name} (generation and the per-token log-probs run the "
                "whole model on each process); use data parallel (--nproc_per_node) or sharding"
            )
    if t.get("do_eval") or t.get("load_best_model_at_end") or t.get("metric_for_best_model"):
        p.append(
            f"{where}: {name} has no evaluation set or eval metric; set do_eval false and remove "
            "load_best_model_at_end / metric_for_best_model (the per-step rewards are logged)"
        )
    if not t.get("do_train", False):
        p.append(f"{where}: {name} only trains; set do_train true")
    if d.lazy:
        p.append(f"{where}: lazy=true is not supported for {name} (prompts are read in memory); remove lazy")
    if d.autoregressive:
        p.append(f"{where}: autoregressive=true trains on raw text; {name} needs prompts: remove it")
    if m.neftune or m.prefix_tuning or m.prefix_path:
        p.append(f"{where}: neftune and prefix tuning are not supported for {name}; use lora (or full fine-tuning)")
    if m.pissa and o.beta > 0:
        p.append(
            f"{where}: pissa=true moves the base weights into the adapter, so the base with the adapters off is "
            "not the reference model; use lora without pissa, or beta=0"
        )
    if o.rslora_plus and not m.lora:
        p.append(f"{where}: rslora_plus=true needs lora=true")
    if d.zero_padding and m.use_flash_attention and not m.flash_mask:
        p.append(
            f"{where}: zero_padding with use_flash_attention needs flash_mask=true (the sequences of a packed "
            "row are separated by a start-row mask)"
        )
    path = o.train_dataset_path
    if not path:
        p.append(f"{where}: train_dataset_path is required (the prompts)")
    elif os.path.isdir(path):
        from ..data.reader import find_split_files

        if not find_split_files(path, "train"):
            p.append(f"{where}: train_dataset_path {path!r} is a directory without train.json or train/*.json")
    elif not os.path.isfile(path):
        p.append(f"{where}: train_dataset_path {path!r} does not exist (a data file or a directory with train.json)")
    return p


def loss_problems(cfg, where: str) -> List[str]:
    """The loss keys' cross checks (loss_type, scale_rewards, epsilon_high, RLOO's own keys)."""
    o = cfg.alignment
    p: List[str] = []
    if o.scale_rewards not in ("group", "batch", "none"):
        p.append(f"{where}: scale_rewards must be group, batch or none (or true/false); got {o.scale_rewards!r}")
    if not o.top_p <= 1.0:
        p.append(f"{where}: top_p must be in (0, 1]; got {o.top_p}")
    if o.loss_type == "cispo" and o.epsilon_high is None:
        p.append(
            f"{where}: loss_type cispo clips the importance weight itself at epsilon_high, which defaults to "
            "epsilon (0.2: every weight would be cut to 0.2); set epsilon_high (ScaleRL recommends 5.0)"
        )
    if o.loss_type == "rloo":
        for key in ("scale_rewards", "importance_sampling_level"):
            if key in cfg.explicit:
                p.append(
                    f"{where}: {key} is not used by loss_type rloo (its advantages are leave-one-out, its ratio "
                    "is the completion's); remove it (normalize_advantages scales RLOO's advantages)"
                )
    elif "normalize_advantages" in cfg.explicit:
        p.append(f"{where}: normalize_advantages belongs to loss_type rloo; for {o.loss_type} use scale_rewards")
    return p


def resolve_tools(specs) -> List[Tuple[Callable, dict]]:
    """``tools`` -> [(function, its JSON schema)]; ValueError naming ``tools[k]`` (importable, callable, a docstring
    and type hints for its schema, names unique).

    >>> resolve_tools(["paddlenlp_ext.examples.calculator:add"])[0][1]["function"]["name"]
    'add'
    """
    from .tool_schema import function_schema

    out, names = [], set()
    for i, spec in enumerate(specs or []):
        try:
            func, name = resolve_reward_func(spec)
            schema = function_schema(func, f"tools[{i}] {spec!r}")
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith("tools[") else f"tools[{i}]: {msg}") from None
        if name in names:
            raise ValueError(f"tools[{i}] {spec!r}: a second tool named {name!r}; the model calls tools by name")
        names.add(name)
        out.append((func, schema))
    return out


def tool_problems(cfg, where: str) -> List[str]:
    """The multi-turn keys: tools resolve (module, function, schema), tools <-> max_turns >= 2."""
    o = cfg.alignment
    p: List[str] = []
    try:
        resolve_tools(o.tools)
    except ValueError as e:
        p.append(f"{where}: {e}")
    if o.tools and o.max_turns < 2:
        p.append(
            f"{where}: tools are run between turns, and max_turns is {o.max_turns}; set max_turns >= 2 (e.g. 2: "
            "one call, then the answer)"
        )
    if not o.tools and o.max_turns > 1:
        p.append(
            f"{where}: max_turns {o.max_turns} needs tools (nothing answers between turns without them); set "
            'tools ["package.module:function", ...] or max_turns 1'
        )
    if "tool_timeout" in cfg.explicit and not o.tools:
        p.append(f"{where}: tool_timeout is set but there are no tools; remove it or set tools")
    return p
