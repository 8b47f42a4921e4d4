"""The checks of the streaming loader (``loading.py``) that read no tensor data: the quantization settings,
checkpoint names and shapes against the model, a transformers config.json against the model built from it.

Each raises ``ValueError`` or :class:`.checkpoint.CheckpointError` naming the setting, tensor or file.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Sequence

from .checkpoint import Checkpoint, CheckpointError

#: the keys of ``quantization`` (the config keys of the same names)
QUANT_KEYS = ("weight_quantize_algo", "weight_blocksize", "weight_double_quant", "weight_double_quant_block_size")
_SHOW = 5  # names listed in an error message


def few_names(names: Sequence[str]) -> str:
    """The first names (sorted) of a list for an error message, and how many more.

    >>> few_names(["f", "e", "d", "c", "b", "a"])
    "'a', 'b', 'c', 'd', 'e' and 1 more"
    """
    names = sorted(names)
    more = f" and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
    return ", ".join(repr(n) for n in names[:_SHOW]) + more


def check_quantization(quantization: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The ``quantization`` settings with their defaults filled in (None: no quantization); ValueError naming
    the setting that cannot work.

    >>> check_quantization({"weight_quantize_algo": "nf4"})["weight_blocksize"]
    64
    """
    if not quantization:
        return None
    from ..quant import formats as F

    unknown = sorted(set(quantization) - set(QUANT_KEYS))
    if unknown or "weight_quantize_algo" not in quantization:
        raise ValueError(f"quantization must be a dict with the keys {QUANT_KEYS}; got {sorted(quantization)}")
    q = {
        "weight_quantize_algo": quantization["weight_quantize_algo"],
        "weight_blocksize": quantization.get("weight_blocksize", F.DEFAULT_BLOCK_SIZE),
        "weight_double_quant": bool(quantization.get("weight_double_quant", False)),
        "weight_double_quant_block_size": quantization.get(
            "weight_double_quant_block_size", F.DEFAULT_DOUBLE_QUANT_BLOCK_SIZE
        ),
    }
    fmt = F.get_format(q["weight_quantize_algo"])  # ValueError naming the supported algos
    if q["weight_double_quant"] and not fmt.blockwise:
        raise ValueError(
            f"weight_double_quant is only defined for nf4/fp4, got weight_quantize_algo="
            f"{q['weight_quantize_algo']!r}. Set weight_double_quant=False."
        )
    if q["weight_double_quant"] and int(q["weight_double_quant_block_size"]) <= 0:
        raise ValueError(
            f"weight_double_quant_block_size must be positive, got {q['weight_double_quant_block_size']!r}"
        )
    return q


class KeyMap:
    """Checkpoint key -> model ``state_dict`` key, with PaddleNLP's base-model prefix rule
    (a checkpoint of ``LlamaModel`` loads into ``LlamaForCausalLM`` and the reverse).

    >>> keymap = KeyMap({"llama.norm.weight": 0, "lm_head.weight": 1}, "llama")
    >>> keymap("norm.weight"), keymap("llama.lm_head.weight"), keymap("other")
    ('llama.norm.weight', 'lm_head.weight', None)
    """

    def __init__(self, expected: Dict[str, Any], prefix: str):
        self.expected, self.prefix = expected, (prefix + ".") if prefix else ""

    def __call__(self, key: str) -> Optional[str]:
        if key in self.expected:
            return key
        if self.prefix:
            if self.prefix + key in self.expected:
                return self.prefix + key
            if key.startswith(self.prefix) and key[len(self.prefix) :] in self.expected:
                return key[len(self.prefix) :]
        return None


def _where(ckpt: Checkpoint, key: str) -> str:
    t = ckpt.tensors.get(key)
    return os.path.basename(t.file) if t is not None else os.path.basename(ckpt.files[0])


def missing_message(missing: List[str], ckpt: Checkpoint) -> str:
    hint = ""
    if any(("qkv_proj" in k or "gate_up_fused_proj" in k) for k in missing):
        hint = (
            " The model fuses attention/FFN projections (fuse_attention_qkv / fuse_attention_ffn) but the "
            "checkpoint stores them separately: the streaming loader does not convert; leave the fuse_* keys "
            "unset."
        )
    return (
        f"{len(missing)} model tensor(s) are missing from the checkpoint in {ckpt.directory}: "
        f"{few_names(missing)}. Is config.json the checkpoint's own config?{hint}"
    )


def precheck(ckpt, keymap, expected, groups, ignore_missing, ignore_unexpected, skip) -> None:
    """Names (and shapes, for safetensors) against the model, before reading any tensor data."""
    if not any(f in k for k in expected for f in PADDLENLP_FUSED):  # a model without them (our decoder's rows)
        fused = fused_paddlenlp_problem(list(ckpt.tensors), ckpt.directory)
        if fused:
            raise CheckpointError(fused)
    problems, unexpected, provided = [], [], set()
    for key, info in ckpt.tensors.items():
        mk = keymap(key)
        if mk is None:
            if any(re.search(p, key) for p in ignore_unexpected):
                skip.add(key)
            else:
                unexpected.append(key)
            continue
        provided.add(id(expected[mk]))
        want = getattr(expected[mk], "tp_full_shape", None) or tuple(expected[mk].shape)  # full, for a TP shard
        if info.shape is not None and tuple(info.shape) != tuple(want):
            problems.append(
                f"tensor {key!r} in {os.path.basename(info.file)} has shape {list(info.shape)}, but the model built "
                f"from config.json expects {list(want)}"
            )
    if unexpected:
        files = sorted({_where(ckpt, k) for k in unexpected})
        problems.append(
            f"{len(unexpected)} checkpoint tensor(s) in {files} are not in the model: {few_names(unexpected)}"
        )
    missing = [
        keys[0]
        for pid, keys in groups.items()
        if pid not in provided and not any(re.search(p, k) for k in keys for p in ignore_missing)
    ]
    if missing:
        problems.append(missing_message(missing, ckpt))
    if problems:
        raise CheckpointError("checkpoint does not match the model:\n  " + "\n  ".join(problems))


def check_hf_config(model_dir: str, config: Any, max_seq_len: Optional[int], decoder: bool = False) -> None:
    """Refuse a transformers config.json that the model built (PaddleNLP's, or our decoder's) would silently
    compute otherwise."""
    from . import hf_layout

    raw = hf_layout.read_config_json(model_dir)
    if raw.get("model_type") != getattr(config, "model_type", None):
        raise CheckpointError(
            f"{model_dir}: the checkpoint is a transformers {raw.get('model_type')!r} model, but the "
            f"config given builds {getattr(config, 'model_type', None)!r}"
        )
    problems = hf_layout.config_problems(raw, max_seq_len, decoder=decoder)
    if problems:
        raise CheckpointError(f"{model_dir} (transformers layout): " + "; ".join(problems))


#: the names PaddleNLP's Llama / Qwen2 classes give their fused projections (``fuse_attention_qkv`` /
#: ``fuse_attention_ffn``): q/k/v interleaved per key/value group, [gate | up] halves
PADDLENLP_FUSED = (".self_attn.qkv_proj.", ".mlp.gate_up_fused_proj.")


def fused_paddlenlp_problem(names: Sequence[str], model_dir: str) -> Optional[str]:
    """Why a PaddleNLP-layout checkpoint holding PaddleNLP's fused projections cannot load into our decoder, or
    None.  PaddleNLP 3.0.0b4's ``save_pretrained`` writes q/k/v and gate/up separately even for a fused model,
    but a checkpoint written by an older PaddleNLP (or a raw state_dict) may hold ``qkv_proj`` /
    ``gate_up_fused_proj``; PaddleNLP's own ``from_pretrained`` splits them, so loading and saving once with it
    gives the separate tensors the decoder reads (equal logits).  The caller asks only for a model without these
    names (phi3 / glm4 rows fuse ``self_attn.qkv_proj`` themselves, in transformers' [q; k; v] order).

    >>> fused_paddlenlp_problem(["llama.layers.0.self_attn.qkv_proj.weight"], "m")[:62]
    "m holds PaddleNLP's fused projections ('llama.layers.0.self_att"
    >>> fused_paddlenlp_problem(["llama.layers.0.self_attn.q_proj.weight"], "m") is None
    True
    """
    fused = [n for n in names if any(f in n for f in PADDLENLP_FUSED)]
    if not fused:
        return None
    return (
        f"{model_dir} holds PaddleNLP's fused projections ({few_names(fused)}), which our decoder does not read "
        "(it takes q/k/v and gate/up separately). Save the model once with PaddleNLP, which splits them: "
        f"python -c \"import paddlenlp.transformers as T; T.AutoModelForCausalLM.from_pretrained('{model_dir}')"
        ".save_pretrained('OUT_DIR')\" and set model_name_or_path to OUT_DIR"
    )
