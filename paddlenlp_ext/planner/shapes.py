"""Model shapes for planning: read from a config.json (no weights) or a built-in well-known model.

A decoder of the Llama / Qwen2 kind is described by ``hidden_size``, ``intermediate_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``vocab_size`` and
``tie_word_embeddings``.  Its parameters, for hidden h, intermediate i, L layers, V tokens and
kv width k = num_key_value_heads * h / num_attention_heads:

    per layer  q, o: h*h each;  k, v: h*k each;  gate, up, down: h*i each;  2 RMSNorms: 2*h
               (+ q/k/v biases h + 2*k for Qwen2)
    model      embeddings V*h, final norm h, lm_head V*h (0 when tied)

Llama-2-7B (h 4096, i 11008, L 32, V 32000): 32 * 202,383,360 + 2 * 131,072,000 + 4096
= 6,738,415,616, the published count.

Which families have this layout, and their biases / explicit ``head_dim`` (q width heads * head_dim) /
q-k norms, is the family table's (``models/family_table.py``); another family is a PlanError.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from ..models.family_table import planner_layout_problem, row
from .moe_shape import LayerPlan, MoEFacts, moe_layer_plans


class PlanError(ValueError):
    """A config or model shape the planner cannot plan for; the message names the key and what to do."""


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    #: Qwen2's q/k/v projections carry a bias (Llama's do not)
    qkv_bias: bool = False
    #: where the shape came from (a config.json path or "built-in: NAME")
    source: str = ""
    #: config.json's head_dim when the family states it (gemma, qwen3); 0: hidden_size / num_attention_heads
    explicit_head_dim: int = 0
    #: per-head RMSNorm weights on q and k (qwen3): 2 x head_dim per layer
    qk_norm: bool = False
    #: our decoder's rows (models/decoder/rows.py): hidden-size norms per layer (2 pre-norm, 4 sandwich), biases
    #: beyond q/k/v, q/k norm weights per layer (head: 2 x head_dim, OLMo 2's whole projection: q + kv widths),
    #: and the fused projections' names (Phi-3's qkv_proj, Phi-3 / GLM-4's gate_up_proj)
    layer_norms: int = 2
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm_params: int = 0
    fused_qkv_name: str = ""
    fused_ffn_name: str = ""
    #: the decoder's MoE rows (and MLA): one plan per layer (``moe_shape.py``); empty: every layer is the same
    layer_plans: Tuple[LayerPlan, ...] = ()
    moe: Optional[MoEFacts] = None
    lm_head_bias: bool = False
    #: activation widths of an MLA row (k and v per token): 0 for the others (kv_dim)
    act_kv_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        """Width of q (and of o's input): num_attention_heads x head_dim (hidden_size unless head_dim is explicit)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.act_kv_dim or self.num_key_value_heads * self.head_dim

    def layer_parts(
        self, index: int, fuse_qkv: bool = False, fuse_ffn: bool = False
    ) -> List[Tuple[str, int, int, str]]:
        """``(suffix, in, out, role)`` of the Linears of layer ``index`` (roles: ``moe_shape.ROLES``; a Llama-layout
        layer's are "attn" and "mlp")."""
        if self.layer_plans:
            return list(self.layer_plans[index].linears)
        return [(n, i, o, "attn" if "self_attn" in n else "mlp") for n, i, o in self.layer_linears(fuse_qkv, fuse_ffn)]

    @property
    def expert_params(self) -> int:
        """Parameters of the routed experts over the model (0 for a dense model)."""
        return sum(p.params("expert") for p in self.layer_plans)

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: all but the (E - k) routed experts it skips per MoE layer.

        Dense: total_params.  Worked example in ``moe_shape.py`` (the tiny mixtral: 189,248 total, 115,520 active)."""
        if self.moe is None:
            return self.total_params
        idle = self.expert_params * (self.moe.num_experts - self.moe.top_k) / self.moe.num_experts
        return self.total_params - int(round(idle))

    def layer_linears(self, fuse_qkv: bool = False, fuse_ffn: bool = False) -> List[Tuple[str, int, int]]:
        """``(sublayer suffix, in_features, out_features)`` of the Linear layers of one decoder layer,
        named as PaddleNLP names them (``self_attn.q_proj`` ... or the fused ``qkv_proj`` / ``gate_up_fused_proj``)."""
        h, q, k, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        attn = (
            [(self.fused_qkv_name or "self_attn.qkv_proj", h, q + 2 * k)]
            if fuse_qkv or self.fused_qkv_name
            else [("self_attn.q_proj", h, q), ("self_attn.k_proj", h, k), ("self_attn.v_proj", h, k)]
        )
        mlp = (
            [(self.fused_ffn_name or "mlp.gate_up_fused_proj", h, 2 * i)]
            if fuse_ffn or self.fused_ffn_name
            else [("mlp.gate_proj", h, i), ("mlp.up_proj", h, i)]
        )
        return attn + [("self_attn.o_proj", q, h)] + mlp + [("mlp.down_proj", i, h)]

    def layer_name(self, index: int, suffix: str) -> str:
        """``llama.layers.3.self_attn.q_proj``: the full sublayer name that target_modules regexes match."""
        return f"{self.model_type}.layers.{index}.{suffix}"

    @property
    def layer_linear_params(self) -> int:
        return sum(a * b for _, a, b in self.layer_linears())

    @property
    def layer_norm_params(self) -> int:
        """Per layer, the weights of the norms over hidden_size (two RMSNorms; four in a sandwich layout)."""
        return self.layer_norms * self.hidden_size

    @property
    def layer_other_params(self) -> int:
        """Per layer, besides the linear weights: the norm weights, the biases (Qwen2's q/k/v; a decoder row's o and
        MLP ones), the q/k norms (Qwen3's per head; a decoder row's as it states them)."""
        h, i = self.hidden_size, self.intermediate_size
        qk = self.qk_norm_params or (2 * self.head_dim if self.qk_norm else 0)
        return (
            self.layer_norm_params
            + ((self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0)
            + (h if self.o_bias else 0)
            + ((2 * i + h) if self.mlp_bias else 0)
            + qk
        )

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        head = (
            self.embedding_params
            + self.hidden_size
            + self.lm_head_params
            + (self.vocab_size if self.lm_head_bias else 0)
        )
        if self.layer_plans:
            return sum(p.params() for p in self.layer_plans) + head
        per_layer = self.layer_linear_params + self.layer_other_params
        return self.num_hidden_layers * per_layer + head


def _llama(h, i, layers, heads, kv, vocab=32000, tie=False, model_type="llama", bias=False) -> ModelShape:
    return ModelShape(h, i, layers, heads, kv, vocab, tie, model_type, bias)


#: Well-known shapes (their config.json values), so a plan needs no download.  Keys are matched
#: case-insensitively after dropping an "org/" prefix and a "-hf" / "-chat" / "-instruct" suffix.
BUILTIN_SHAPES: Dict[str, ModelShape] = {
    "llama-2-7b": _llama(4096, 11008, 32, 32, 32),
    "llama-2-13b": _llama(5120, 13824, 40, 40, 40),
    "llama-2-70b": _llama(8192, 28672, 80, 64, 8),
    "qwen2-0.5b": _llama(896, 4864, 24, 14, 2, 151936, True, "qwen2", True),
    "qwen2-1.5b": _llama(1536, 8960, 28, 12, 2, 151936, True, "qwen2", True),
    "qwen2-7b": _llama(3584, 18944, 28, 28, 4, 152064, False, "qwen2", True),
}

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def builtin_key(name: str) -> Optional[str]:
    """``"meta-llama/Llama-2-7b-chat-hf"`` -> ``"llama-2-7b"``; None when not a built-in shape."""
    key = name.strip().rstrip("/").split("/")[-1].lower()
    key = re.sub(r"(-(hf|chat|instruct))+$", "", key)
    return key if key in BUILTIN_SHAPES else None


def decoder_shape(cfg: dict, where: str) -> Optional[ModelShape]:
    """The ModelShape of a dense row of our decoder (its knobs, ``models/decoder/rows.py``), None for another family.

    >>> s = decoder_shape({"model_type": "phi3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    ...                    "num_attention_heads": 4, "vocab_size": 128}, "c.json")
    >>> s.layer_linears()[0], s.layer_linears()[2]
    (('self_attn.qkv_proj', 64, 192), ('mlp.gate_up_proj', 64, 192))
    """
    family = row(str(cfg.get("model_type") or ""))
    if family is not None and not family.decoder and family.hf_row is not None:
        family = family.hf_row  # qwen3_moe: PaddleNLP's layout has the same parameters as transformers'
    if family is None or not family.decoder or family.arch is None:
        return None
    from ..models.decoder.rows import ArchError, resolve

    try:
        k = resolve(family.arch, cfg)
    except (ArchError, KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{where}: {e}") from None
    a = family.arch
    if a.mlp == "moe" or k.mla is not None:
        return _moe_shape(family.model_type, k, cfg, where)
    qk = {"head": 2 * k.head_dim, "proj": (k.heads + k.kv_heads) * k.head_dim}.get(a.qk_norm or "", 0)
    return ModelShape(
        k.hidden,
        k.intermediate,
        k.layers,
        k.heads,
        k.kv_heads,
        k.vocab,
        k.tie,
        family.model_type,
        k.qkv_bias,
        source=where,
        explicit_head_dim=k.head_dim,
        layer_norms=sum(n is not None for n in a.layer_norms),
        o_bias=k.o_bias,
        mlp_bias=k.mlp_bias,
        qk_norm_params=qk,
        fused_qkv_name="self_attn.qkv_proj" if a.fused_qkv else "",
        fused_ffn_name="mlp.gate_up_proj" if a.fused_gate_up else "",
    )


def _moe_shape(model_type: str, k, cfg: dict, where: str) -> ModelShape:
    """The ModelShape of an MoE row of the decoder: per-layer plans (``moe_shape.py``) over resolved knobs ``k``."""
    from ..models.decoder.moe_spec import MoEConfigError

    try:
        plans, facts = moe_layer_plans(k, dict(cfg, model_type=model_type))
    except (MoEConfigError, KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{where}: {e}") from None
    m = k.mla
    return ModelShape(
        k.hidden,
        k.intermediate,
        k.layers,
        k.heads,
        k.kv_heads,
        k.vocab,
        k.tie,
        model_type,
        k.qkv_bias,
        source=where,
        # MLA: q is heads x (nope + rope) wide; k and v per token heads x (nope + rope) and heads x v
        explicit_head_dim=(m.nope + m.rope) if m is not None else k.head_dim,
        layer_norms=sum(n is not None for n in k.arch.layer_norms),
        layer_plans=plans,
        moe=facts,
        lm_head_bias=bool(k.lm_head_bias),
        act_kv_dim=(k.heads * (m.nope + m.rope + m.v) // 2) if m is not None else 0,
    )


def shape_from_config(cfg: dict, where: str) -> ModelShape:
    """A ModelShape from the dict of a HF-style / PaddleNLP config.json; PlanError names a missing or bad key."""
    decoder = decoder_shape(cfg, where)
    if decoder is not None:
        return decoder
    layout = planner_layout_problem(str(cfg.get("model_type") or "llama"))  # the family table's layouts
    if layout:
        raise PlanError(f"{where}: {layout}")
    problems = []
    values = {}
    for key in _REQUIRED + ("num_key_value_heads",):
        v = cfg.get(key, cfg.get("num_attention_heads") if key == "num_key_value_heads" else None)
        if v is None:
            problems.append(f"{where}: {key} is missing")
        elif isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            problems.append(f"{where}: {key} must be a positive integer, got {v!r}")
        else:
            values[key] = v
    if not problems:
        if not cfg.get("head_dim") and values["hidden_size"] % values["num_attention_heads"]:
            problems.append(
                f"{where}: hidden_size {values['hidden_size']} is not a multiple of num_attention_heads "
                f"{values['num_attention_heads']}"
            )
        if values["num_attention_heads"] % values["num_key_value_heads"]:
            problems.append(
                f"{where}: num_attention_heads {values['num_attention_heads']} is not a multiple of "
                f"num_key_value_heads {values['num_key_value_heads']}"
            )
    if problems:
        raise PlanError("; ".join(problems))
    model_type = str(cfg.get("model_type") or "llama")
    family = row(model_type)
    # Qwen2 always has q/k/v biases (the table); HF Llama configs say so with attention_bias
    bias = family.qkv_bias or bool(cfg.get("attention_bias", False))
    head_dim = cfg.get("head_dim") or 0
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 0:
        raise PlanError(f"{where}: head_dim must be a positive integer, got {head_dim!r}")
    return ModelShape(
        values["hidden_size"],
        values["intermediate_size"],
        values["num_hidden_layers"],
        values["num_attention_heads"],
        values["num_key_value_heads"],
        values["vocab_size"],
        bool(cfg.get("tie_word_embeddings", False)),
        model_type,
        bias,
        source=where,
        explicit_head_dim=head_dim,
        qk_norm=family.qk_norm,
    )


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in ``path``; PlanError naming ``path`` and ``what`` it is when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise PlanError(f"{path}: cannot read {what}: {e}") from None
    if not isinstance(d, dict):
        raise PlanError(f"{path}: {what} must be a JSON object")
    return d


def read_model_shape(name_or_path: str) -> ModelShape:
    """The shape of ``name_or_path``: a directory with config.json, a config.json file, or a built-in name."""
    if not name_or_path:
        raise PlanError(
            "model_name_or_path is not set; pass --model_name_or_path DIR (a directory with config.json) "
            f"or one of the built-in shapes: {', '.join(BUILTIN_SHAPES)}"
        )
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if os.path.isfile(path):
        return shape_from_config(read_json_object(path, "the model config"), path)
    key = builtin_key(name_or_path)
    if key is not None:
        return replace(BUILTIN_SHAPES[key], source=f"built-in: {key}")
    raise PlanError(
        f"model_name_or_path {name_or_path!r} is not a directory with config.json (no weights are "
        f"needed, only config.json) and not a built-in shape ({', '.join(BUILTIN_SHAPES)}); pass "
        "--model_name_or_path DIR"
    )
