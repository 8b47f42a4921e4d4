"""transformers ``config.json`` / ``generation_config.json`` from a PaddleNLP model config.

Pure dict code, no paddle.  PaddleNLP's config keys mostly share transformers'
names; what differs is per family (which keys transformers reads, what our
model computes regardless of a key).  A setting whose meaning would change in
transformers (PaddleNLP's own ``rope_scaling_type``, ALiBi, ...) is refused
with :class:`ExportError` rather than exported wrong.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from ..models.family_table import layout_row
from ..models.hf_config_read import DEFAULT_THETA, canonical_config
from ..models.hf_layout import HF_FAMILIES, config_problems


class ExportError(ValueError):
    """The input cannot be exported as asked; the message says what to change."""


class ExportVerifyFailed(ExportError):
    """The merge before an export failed its verification: nothing was exported (CLIs exit 3)."""


#: model_type -> transformers' causal-LM class name
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

#: keys every family's transformers config reads with the same meaning as PaddleNLP's
_COMMON_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
)

#: safetensors dtype tag -> transformers' torch_dtype string (U16 is how pdparams bf16 is tagged)
TORCH_DTYPE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "U16": "bfloat16"}

#: generation settings transformers' GenerationConfig reads with the same meaning
_GENERATION_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "max_new_tokens",
)


def export_row(model_type):
    """The table row whose transformers layout the export writes: qwen3_moe's is the decoder's MoE row whatever
    the source's layout (``family_table.layout_row``); every other model_type's is its row.

    >>> export_row("qwen3_moe").decoder, export_row("llama").decoder, export_row("gpt").decoder
    (True, True, False)
    """
    return layout_row(model_type, hf_layout=True)


def hf_config_from_paddle(cfg: Mapping[str, Any], torch_dtype: str) -> Dict[str, Any]:
    """transformers config.json for PaddleNLP config ``cfg`` (a dict of its config.json).

    >>> c = hf_config_from_paddle({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    ...     "intermediate_size": 176, "num_hidden_layers": 2, "vocab_size": 32, "rope_scaling_type": "linear",
    ...     "rope_scaling_factor": 2.0, "num_key_value_heads": None, "rope_theta": 10000.0}, "float32")
    >>> c["architectures"], c["rope_scaling"], c["rope_parameters"], "rope_scaling_type" in c
    (['LlamaForCausalLM'], {'rope_type': 'linear', 'factor': 2.0}, {'rope_type': 'linear', 'factor': 2.0, 'rope_theta': 10000.0}, False)
    """
    raw = cfg
    cfg, problems = canonical_config(cfg)  # a source config saved by transformers 5.x reads the same
    if problems:
        raise ExportError("; ".join(problems))
    mt = cfg.get("model_type")
    family = export_row(mt)
    if family is not None and family.decoder and mt in HF_FAMILIES:
        # 4.x spelling kept as saved (transformers' Phi-3 wants rope_scaling["type"]); 5.x spelling -> canonical
        return _decoder_config(cfg if "rope_parameters" in raw else raw, torch_dtype)
    if mt not in HF_FAMILIES or mt not in ARCHITECTURES:
        raise ExportError(
            f"config.json model_type={mt!r}: the transformers-layout export covers {sorted(exportable())}"
        )
    out: Dict[str, Any] = {"architectures": [ARCHITECTURES[mt]], "model_type": mt, "torch_dtype": torch_dtype}
    for k in _COMMON_KEYS:
        if cfg.get(k) is not None:
            out[k] = cfg[k]
    out.setdefault("tie_word_embeddings", False)
    if out.get("num_key_value_heads") is None:  # PaddleNLP: None = multi-head attention
        out["num_key_value_heads"] = cfg.get("num_attention_heads")
    if cfg.get("alibi"):
        raise ExportError("config.json alibi=true: transformers' Llama has no ALiBi; this model cannot be exported")
    rtype = cfg.get("rope_scaling_type")
    if rtype not in (None, "", "none") and float(cfg.get("rope_scaling_factor") or 1.0) != 1.0:
        raise ExportError(
            f"config.json rope_scaling_type={rtype!r} (factor {cfg.get('rope_scaling_factor')}): "
            "PaddleNLP's own RoPE scaling has no exact transformers equivalent; export a model "
            "trained without it"
        )
    rope = cfg.get("rope_scaling")
    out["rope_scaling"] = dict(rope) if isinstance(rope, dict) else None
    # transformers 5.x's spelling of the same RoPE (it reads the 4.x keys too; 4.x ignores this one)
    out["rope_parameters"] = {
        "rope_type": "default",
        **(out["rope_scaling"] or {}),
        "rope_theta": float(out.get("rope_theta", DEFAULT_THETA)),
    }
    out["hidden_act"] = "silu" if mt == "llama" else cfg.get("hidden_act", "silu")
    if mt == "llama":
        out.update(attention_bias=False, mlp_bias=False)  # PaddleNLP's llama has no projection biases
    if mt in ("qwen2", "qwen3"):
        # our model attends over the whole sequence: the window stays off
        out.update(
            use_sliding_window=False,
            sliding_window=cfg.get("sliding_window"),
            max_window_layers=cfg.get("max_window_layers", out["num_hidden_layers"]),
        )
    if mt == "mistral":
        out["sliding_window"] = None  # PaddleNLP's mistral never applies a window (hf_layout.config_problems)
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if mt == "qwen3":
        out["head_dim"] = cfg.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
        out["attention_bias"] = bool(cfg.get("attention_bias", False))
    problems = config_problems(out, max_seq_len=out.get("max_position_embeddings"))
    if problems:  # what our own loader would refuse to read back is refused on the way out too
        raise ExportError("; ".join(problems))
    return out


def exportable():
    """The model_types the transformers-layout export writes: the table's decoder rows and :data:`ARCHITECTURES`."""
    return {k for k in HF_FAMILIES if k in ARCHITECTURES or export_row(k).decoder}


#: keys PaddleNLP's save_pretrained / our runs add that are no transformers config setting
_PADDLE_ONLY_KEYS = (
    "paddlenlp_version",
    "dtype",
    "use_flash_attention",
    "flash_mask",
    "tensor_parallel_degree",
    "tensor_parallel_rank",
    "tensor_parallel_output",
    "sequence_parallel",
    "fuse_attention_qkv",
    "fuse_attention_ffn",
    "use_fused_rms_norm",
    "use_fused_rope",
    "recompute",
    "recompute_granularity",
    "pp_recompute_interval",
    "no_recompute_layers",
    "convert_from_torch",
    "quantization_config",
)


#: PaddleNLP's own position keys, read (``rows.paddlenlp_rope_scaling``) and not written for transformers
_PADDLE_ROPE_KEYS = ("rope_scaling_type", "rope_scaling_factor", "alibi", "use_long_sequence_strategies")


def _decoder_config(cfg: Mapping[str, Any], torch_dtype: str) -> Dict[str, Any]:
    """config.json of a row our decoder builds: the decoder keeps transformers' config.json as it is
    (``models/decoder/configuration.py``) and reads it through the row, so the export is the same keys
    minus PaddleNLP's own, with transformers' class name (``class_prefix`` + ``ForCausalLM``).  A key
    config.json leaves out means transformers' class default on both sides (the row's ``tie_default`` /
    ``defaults`` are those defaults).

    >>> c = _decoder_config({"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 32,
    ...     "intermediate_size": 96, "num_hidden_layers": 2, "paddlenlp_version": "3.0.0b4"}, "float32")
    >>> c["architectures"], c["torch_dtype"], "paddlenlp_version" in c
    (['Phi3ForCausalLM'], 'float32', False)
    """
    from ..models.decoder.rows import class_prefix, config_problems as decoder_problems

    from ..models.decoder.rows import ArchError, paddlenlp_rope_scaling

    mt = cfg["model_type"]
    out = {k: v for k, v in cfg.items() if k not in _PADDLE_ONLY_KEYS and k != "architectures"}
    try:  # PaddleNLP's own RoPE keys (its Llama / Qwen2 configs): linear becomes transformers' rope_scaling
        legacy = paddlenlp_rope_scaling(cfg)
    except ArchError as e:
        raise ExportError(str(e)) from None
    if legacy is not None and not cfg.get("rope_scaling"):
        out["rope_scaling"] = legacy
    for key in _PADDLE_ROPE_KEYS:
        out.pop(key, None)
    out["architectures"] = [class_prefix(mt) + "ForCausalLM"]
    out["torch_dtype"] = torch_dtype
    problems = decoder_problems(export_row(mt).arch, out)
    if problems:
        raise ExportError("; ".join(problems))
    both = _rope_parameters(out)
    if both is not None:  # transformers 5.x's spelling of the same RoPE too (4.x ignores it), as for llama
        out["rope_parameters"] = both
    return out


#: RoPE types whose 4.x ``rope_scaling`` dict is 5.x's ``rope_parameters`` plus ``rope_theta`` as it stands
_PLAIN_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def _rope_parameters(cfg: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """5.x's ``rope_parameters`` for one RoPE over every layer with a plain scaling; None where 5.x nests or
    moves more than that (per-attention-type RoPE, partial rotary, longrope), whose 4.x spelling alone is kept.

    >>> _rope_parameters({"rope_theta": 1e6, "rope_scaling": None})
    {'rope_type': 'default', 'rope_theta': 1000000.0}
    """
    if "rope_parameters" in cfg or cfg.get("rope_local_base_freq") is not None:
        return None
    if float(cfg.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return None
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else None
    if kind not in _PLAIN_ROPE_TYPES:
        return None
    rest = {k: v for k, v in scaling.items() if k != "type"}
    return {"rope_type": kind, **rest, "rope_theta": float(cfg.get("rope_theta", DEFAULT_THETA))}


def hf_generation_config(gen: Mapping[str, Any], hf_cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """generation_config.json: the token ids of the model config, then the sampling settings of
    PaddleNLP's generation_config.json that transformers reads the same way.

    >>> hf_generation_config({"max_length": 20, "top_p": 0.8, "use_cache": False}, {"eos_token_id": 2})
    {'eos_token_id': 2, 'top_p': 0.8}
    """
    out = {k: hf_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_cfg.get(k) is not None}
    for k in _GENERATION_KEYS:
        if gen.get(k) is not None:
            out[k] = gen[k]
    return out
