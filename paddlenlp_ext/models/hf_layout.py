"""Hugging Face (transformers) checkpoint layout: detection, tensor-name rules, config refusals.

Owns the one table of how a transformers checkpoint of a decoder family maps
onto PaddleNLP's model of the same ``model_type`` (:data:`HF_FAMILIES`), the
rule that decides a checkpoint is in transformers layout (:func:`detect_layout`:
its tensor names, read from the safetensors headers), the per-tensor rename and
transpose (:func:`paddle_name`, and its inverse :func:`hf_name` for the export), and
the ``config.json`` settings that would make PaddleNLP's model compute something
else than transformers' (:func:`config_problems`).

No paddle here: the streaming loader (:mod:`.checkpoint`), the merge reader and
the config-time checks all read it.  The conversion itself happens while
streaming: each tensor is renamed when the headers are read and transposed
right after its bytes are read, so no second copy of the model ever exists.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from .family_table import FAMILIES, hf_layout_problem
from .hf_config_read import canonical_config, rope_problems, sliding_layers, spelled_rope_key

#: transformers' base-model prefix (``LlamaForCausalLM.model``)
HF_PREFIX = "model."

#: model_type -> PaddleNLP's ``base_model_prefix`` (what ``model.`` becomes). Every other
#: name (``lm_head.weight``) keeps its name.  Qwen3's ``self_attn.{q,k}_norm.weight`` map like
#: any other: ``model.layers.N.self_attn.q_norm.weight`` -> ``qwen3.layers.N.self_attn.q_norm.weight``.
# model_type -> PaddleNLP's body prefix, for the families the table marks ``hf_layout`` (one place says which)
HF_FAMILIES: Dict[str, str] = {k: f.body_prefix for k, f in FAMILIES.items() if f.hf_layout}
#: ... and the rows our decoder computes (``Family.arch``): their transformers layout is read (names
#: converted while streaming) even where the CLI still trains PaddleNLP's class and refuses it (gemma)
READ_FAMILIES: Dict[str, str] = {k: f.body_prefix for k, f in FAMILIES.items() if f.hf_layout or f.arch}

#: nn.Linear weights: transformers stores them [out, in], Paddle [in, out]; with the MoE block's Linears
#: (decoder/moe.py): the router ``mlp.gate`` (mixtral ``block_sparse_moe.gate``), mixtral's experts ``w1/w2/w3``, qwen2_moe's ``shared_expert_gate``;
#: gpt-oss' router ``mlp.router`` (its fused experts are [E, in, out] already: kept);
#: DeepSeek's latent attention (decoder/mla.py): ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``
_LINEAR_WEIGHT = re.compile(
    r"(^|\.)((q|k|v|o|gate|up|down|qkv|gate_up|q_a|q_b|kv_b)_proj|kv_a_proj_with_mqa|lm_head|(mlp|block_sparse_moe)\.gate|mlp\.router"
    r"|w[123]|shared_expert_gate)\.weight$"
)


class HFLayoutError(ValueError):
    """A transformers-layout checkpoint this loader cannot read as it is; the message says what to change."""


def read_json_dict(path: str, error=None) -> Dict[str, Any]:
    """The JSON object in ``path`` ({} when the file does not exist); ``error`` (default
    :class:`HFLayoutError`) names the file when it is not a readable JSON object."""
    error = error or HFLayoutError
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, "r", encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_config_json(model_dir: str) -> Dict[str, Any]:
    """The ``config.json`` of ``model_dir`` as a dict ({} when there is none)."""
    return read_json_dict(os.path.join(model_dir, "config.json"))


def looks_hf(names: Iterable[str]) -> bool:
    """Whether tensor names are transformers' (``model.layers.N...``, ``model.embed_tokens.weight``).

    >>> looks_hf(["model.embed_tokens.weight", "lm_head.weight"])
    True
    >>> looks_hf(["llama.embed_tokens.weight", "lm_head.weight"])
    False
    """
    return any(n.startswith(HF_PREFIX + "layers.") or n == HF_PREFIX + "embed_tokens.weight" for n in names)


def detect_layout(names: Iterable[str], config: Mapping[str, Any], where: str = "checkpoint") -> Optional[str]:
    """The ``model_type`` whose transformers layout ``names`` are in, or None for PaddleNLP's layout.

    ``config`` is the directory's config.json; its ``convert_from_torch: true``
    (PaddleNLP's from_pretrained flag) asserts the transformers layout, so
    PaddleNLP-layout names under it are refused rather than guessed.
    """
    names = list(names)
    model_type = config.get("model_type")
    hf = looks_hf(names)
    if config.get("convert_from_torch") and not hf:
        raise HFLayoutError(
            f"{where}: config.json sets convert_from_torch=true, but the tensor names are not in "
            f"transformers layout (e.g. {sorted(names)[:2]}); remove convert_from_torch"
        )
    if not hf:
        return None
    if model_type not in READ_FAMILIES:
        raise HFLayoutError(
            f"{where}: the tensor names are in Hugging Face transformers layout ('model.layers.N...'), which is "
            f"read for model_type {sorted(READ_FAMILIES)}; config.json says model_type={model_type!r}. Convert the "
            "checkpoint to PaddleNLP's layout (PaddleNLP from_pretrained(..., convert_from_torch=True) + "
            "save_pretrained) or use a supported family"
        )
    return model_type


def paddle_name(hf_name: str, model_type: str) -> Tuple[str, bool]:
    """(PaddleNLP name, whether the tensor is transposed) of a transformers tensor name.

    >>> paddle_name("model.layers.0.self_attn.q_proj.weight", "qwen2")
    ('qwen2.layers.0.self_attn.q_proj.weight', True)
    >>> paddle_name("model.layers.0.self_attn.q_proj.bias", "qwen2")
    ('qwen2.layers.0.self_attn.q_proj.bias', False)
    >>> paddle_name("lm_head.weight", "llama"), paddle_name("model.embed_tokens.weight", "llama")
    (('lm_head.weight', True), ('llama.embed_tokens.weight', False))
    """
    name = READ_FAMILIES[model_type] + "." + hf_name[len(HF_PREFIX) :] if hf_name.startswith(HF_PREFIX) else hf_name
    return name, bool(_LINEAR_WEIGHT.search(hf_name))


def hf_name(paddle_tensor_name: str, model_type: str) -> Tuple[str, bool]:
    """(transformers name, whether the tensor is transposed) of a PaddleNLP tensor name: the inverse
    of :func:`paddle_name`, from the same table, so an export writes what the loader reads.

    >>> hf_name("qwen2.layers.0.self_attn.q_proj.weight", "qwen2")
    ('model.layers.0.self_attn.q_proj.weight', True)
    >>> hf_name("llama.norm.weight", "llama"), hf_name("lm_head.weight", "llama")
    (('model.norm.weight', False), ('lm_head.weight', True))
    """
    body = HF_FAMILIES[model_type] + "."
    name = HF_PREFIX + paddle_tensor_name[len(body) :] if paddle_tensor_name.startswith(body) else paddle_tensor_name
    return name, bool(_LINEAR_WEIGHT.search(name))


def converted_shape(shape: Tuple[int, ...], transpose: bool) -> Tuple[int, ...]:
    """The shape after the conversion: ``(out, in)`` -> ``(in, out)`` for a transposed Linear weight."""
    return tuple(reversed(shape)) if transpose else tuple(shape)


def config_problems(config: Mapping[str, Any], max_seq_len: Optional[int] = None, decoder: bool = False) -> List[str]:
    """What in a transformers ``config.json`` PaddleNLP's model of the family would ignore or compute otherwise.

    A family the table builds with our decoder (``Family.decoder``; or any row with ``decoder=True``
    asked) gets the decoder's own answer (``models/decoder/rows.config_problems``): windows, soft-caps,
    biases and the RoPE scalings it implements are computed, not refused.

    Each entry names the key and what to do.  ``config`` may be in transformers 4.x's or 5.x's
    spelling (:func:`.hf_config_read.canonical_config`).  ``max_seq_len``: the longest
    sequence the run feeds (a sliding window shorter than it changes attention).

    >>> config_problems({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
    ...     "intermediate_size": 96, "vocab_size": 10, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})[0][:48]
    "config.json rope_scaling.rope_type='dynamic' is "
    """
    spelled = spelled_rope_key(config)
    config, out = canonical_config(config)
    if out:
        return out
    mt = config.get("model_type")
    family = FAMILIES.get(mt or "")
    if family is not None and family.arch is not None and (decoder or family.decoder):
        from .decoder.rows import config_problems as decoder_problems

        return decoder_problems(family.arch, config)
    if family is None or not family.hf_layout:  # the names are read (READ_FAMILIES), PaddleNLP's class is not checked
        return [hf_layout_problem(mt)]
    out = rope_problems(config, spelled)
    window = _active_sliding_window(config)
    if window is not None and (max_seq_len is None or max_seq_len > window):
        seq = "an unbounded length" if max_seq_len is None else f"max length {max_seq_len}"
        out.append(
            f"config.json sliding_window={window}: PaddleNLP's {mt} attends over the whole sequence, but "
            f"transformers limits attention to the last {window} tokens; with {seq} the two differ. Keep "
            f"max_length (or the prediction length) <= {window}"
        )
    return out


def _active_sliding_window(config: Mapping[str, Any]) -> Optional[int]:
    """The sliding window transformers applies to some layer for this (canonical) config, or None."""
    layers = sliding_layers(config)
    return int(config["sliding_window"]) if layers and any(layers) else None
