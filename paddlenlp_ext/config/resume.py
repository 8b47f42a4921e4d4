"""Where a run writes and what it resumes from, checked before anything loads (no paddle).

* ``output_dir`` must be a directory that can be created and written: an existing
  file, a file on the way, or a read-only directory is a config error (exit 2),
  not a FileExistsError after the model load.
* ``resume_from_checkpoint: true`` means the newest *complete* ``checkpoint-N`` of
  ``output_dir`` (newer half-written ones are skipped, with a note); a path must be
  a complete checkpoint.
* A checkpoint remembers the settings that decide the data order and the model
  (``resume_settings``, part of ``resolved_config.json``, copied into each
  checkpoint).  Resuming under different ones would silently train a different
  run, so it is refused with every differing key listed.
"""

import errno
import os
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from .checkpoints import RESOLVED_CONFIG_NAME, is_complete, latest_complete_checkpoint, read_json_file

# Settings a resumed run must share with its checkpoint: they change which rows each step sees
# (lengths, packing, data, seed, batch sizes) or what the model is (base, dtype, adapters, prefix).
# The learning rate, max_steps, logging and saving may change on a resume.
RESUME_KEYS = {
    "model": (
        "model_name_or_path",
        "tokenizer_name_or_path",
        "weight_quantize_algo",
        "weight_blocksize",
        "weight_double_quant",
        "weight_double_quant_block_size",
        "lora",
        "lora_path",
        "lora_rank",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
        "rslora",
        "lora_plus_scale",
        "pissa",
        "pissa_niter",
        "vera",
        "vera_rank",
        "vera_seed",
        "vera_d_init",
        "neftune",
        "neftune_noise_alpha",
        "lokr",
        "lokr_dim",
        "lokr_alpha",
        "lokr_factor",
        "lokr_decompose_both",
        "prefix_tuning",
        "prefix_path",
        "num_prefix_tokens",
        "prefix_projection",
        "prefix_projection_hidden_size",
        "prefix_dropout",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "fuse_attention_qkv",
        "fuse_attention_ffn",
        "freeze_router",
    ),
    "data": (
        "dataset_name_or_path",
        "src_length",
        "max_length",
        "zero_padding",
        "greedy_zero_padding",
        "greedy_group_size",
        "lazy",
        "chat_template",
    ),
    "alignment": (
        "train_dataset_path",
        "max_seq_len",
        "max_prompt_len",  # then GRPO's (a group has only its own)
        "num_generations",
        "max_completion_length",
        "temperature",
        "top_p",
        "epsilon",
        "scale_rewards",
        "reward_funcs",
        "reward_model_name_or_path",
        "reward_weights",
        "loss_type",
        "epsilon_high",
        "importance_sampling_level",
        "mask_truncated_completions",
        "num_iterations",
        "normalize_advantages",
    ),
    "training": (
        "seed",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "fp16",
        "bf16",
        "fp16_opt_level",
        "tensor_parallel_degree",
    ),
}
# compared as absolute paths: the same directory typed differently is the same setting
PATH_KEYS = {
    "model_name_or_path",
    "tokenizer_name_or_path",
    "lora_path",
    "prefix_path",
    "dataset_name_or_path",
    "chat_template",
    "train_dataset_path",
}


def coerce_resume(value: Any, from_cli: bool) -> Tuple[Any, Optional[str]]:
    """``resume_from_checkpoint``: a checkpoint path, or true (the newest complete checkpoint).

    >>> coerce_resume(True, False), coerce_resume("true", True), coerce_resume(None, True)
    ((True, None), (True, None), (True, None))
    >>> coerce_resume("false", True), coerce_resume("out/checkpoint-10", False)
    ((None, None), ('out/checkpoint-10', None))
    """
    if value is None:
        return (True, None) if from_cli else (None, None)  # a bare --resume_from_checkpoint means true
    if isinstance(value, bool):
        return (True if value else None), None
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "yes", "1"):
            return True, None
        if low in ("false", "no", "0", "none", "null", ""):
            return None, None
        return value, None
    return None, f"expected a checkpoint directory or true, got {value!r}"


def output_dir_problems(path: Optional[str], where: str) -> List[str]:
    """``output_dir`` must be (or become) a writable directory.

    ``output_dir: "notes.txt"`` where notes.txt is a file ->
    ``["cfg.json: output_dir 'notes.txt' is an existing file, not a directory; ..."]``.
    """
    if not path:
        return []  # reported as a missing required key
    if os.path.exists(path) and not os.path.isdir(path):
        return [
            f"{where}: output_dir {path!r} is an existing file, not a directory; choose another output_dir "
            "(or move the file away)"
        ]
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return [f"{where}: output_dir {path!r} cannot be created: {probe!r} is a file, not a directory"]
    error = write_probe_error(probe)
    if error is not None:
        what = f"is not writable ({probe})" if probe == os.path.abspath(path) else f"cannot be created in {probe!r}"
        return [f"{where}: output_dir {path!r} {what}: {error}; choose a directory you can write to"]
    return []


def write_probe_error(directory: str) -> Optional[str]:
    """None when a file can really be created in ``directory`` (and is removed again), else why not:
    ``"read-only file system (EROFS)"``, ``"permission denied (EACCES)"``, ...  A real write, since
    ``os.access`` says yes to root everywhere and knows nothing of /proc or read-only mounts."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
    except OSError as e:
        name = errno.errorcode.get(e.errno, "?")
        reason = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied"}.get(
            e.errno, e.strerror or str(e)
        )
        return f"{reason} ({name})"
    os.close(fd)
    os.remove(tmp)
    return None


def resume_settings(cfg, training_defaults: Dict[str, Any]) -> Dict[str, Any]:
    """The RESUME_KEYS values of a config (paths absolute, training keys with their defaults)."""
    groups = {"model": cfg.model, "data": cfg.data, "alignment": cfg.alignment}
    out = {}
    for group, keys in RESUME_KEYS.items():
        for key in keys:
            if group == "training":
                value = cfg.training.get(key, training_defaults.get(key))
            elif groups[group] is None or not hasattr(groups[group], key):
                continue
            else:
                value = getattr(groups[group], key)
            if key in PATH_KEYS and isinstance(value, str):
                value = os.path.abspath(value)
            out[key] = value
    return out


def changed_settings(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """``"key: checkpoint X, now Y"`` for every key both know that differs.

    >>> changed_settings({"max_length": 64, "seed": 1}, {"max_length": 128, "seed": 1, "lazy": False})
    ['max_length: checkpoint 64, now 128']
    """
    return [f"{k}: checkpoint {saved[k]!r}, now {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]


def resume_problems(cfg, where: str, training_defaults: Dict[str, Any]) -> List[str]:
    """Resolve ``resume_from_checkpoint: true`` and check the checkpoint; returns the problems.

    Runs after the derived settings are filled in (``lora_alpha`` etc.), so the comparison
    sees what both runs really use.
    """
    t = cfg.training
    ckpt = t.get("resume_from_checkpoint")
    if ckpt is None:
        return []
    if ckpt is True:
        if not t.get("do_train", False):
            t.pop("resume_from_checkpoint")  # nothing to resume without training
            return []
        out = t.get("output_dir")
        latest, skipped = latest_complete_checkpoint(out)
        cut_short = f" (skipped, cut short while being written: {', '.join(skipped)})" if skipped else ""
        if latest is None:
            return [
                f"{where}: resume_from_checkpoint=true but output_dir {out!r} holds no complete checkpoint-N "
                f"directory{cut_short}; drop resume_from_checkpoint to train from the start"
            ]
        t["resume_from_checkpoint"] = ckpt = latest
        cfg.derived["resume_from_checkpoint"] = f"{latest} (the newest complete checkpoint in output_dir{cut_short})"
    if not os.path.isdir(ckpt):
        return [f"{where}: resume_from_checkpoint {ckpt!r} is not a directory"]
    if not t.get("do_train", False):
        return []
    if not is_complete(ckpt):
        return [
            f"{where}: resume_from_checkpoint {ckpt!r} is incomplete (no CHECKPOINT_COMPLETE: the run stopped "
            "while saving it, or it was not written by paddlenlp_ext); resume from an earlier checkpoint-* "
            "directory, or use resume_from_checkpoint=true for the newest complete one"
        ]
    try:
        saved = read_json_file(os.path.join(ckpt, RESOLVED_CONFIG_NAME))
    except ValueError as e:
        return [f"{where}: resume_from_checkpoint: {e}"]
    if saved is None or not isinstance(saved.get("resume_settings"), dict):
        cfg.derived["resume_settings"] = (
            f"not compared: {ckpt} records no settings (written by an older "
            "paddlenlp_ext); make sure the data and model settings are unchanged"
        )
        return []
    settings = dict(saved["resume_settings"])
    if isinstance(settings.get("scale_rewards"), bool):  # GRPO checkpoints before scale_rewards took group/batch/none
        settings["scale_rewards"] = "group" if settings["scale_rewards"] else "none"
    diffs = changed_settings(settings, resume_settings(cfg, training_defaults))
    if not diffs:
        return []
    return [
        f"{where}: resume_from_checkpoint {ckpt!r} was trained with other settings that change the data order "
        f"or the model ({'; '.join(diffs)}); set them back to the checkpoint's values, or train from the start "
        "in a new output_dir (without resume_from_checkpoint)"
    ]
