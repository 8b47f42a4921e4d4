"""Architecture rows of our one causal decoder, and their resolution against a ``config.json`` (paddle-free).

An :class:`Arch` states, for one transformers ``model_type``, how that architecture
differs from a plain pre-norm Llama block.  Each field is a *knob* the decoder
implements once (``models/decoder/``); the rows themselves live in the family table
(``models/family_table.py``, ``Family.arch``), the one place for per-architecture facts.

A field that names a config key (``qkv_bias="attention_bias"``) is read from the
model's config.json, with transformers' class default when the key is absent
(``save_pretrained`` leaves out keys equal to the base class's default).
:func:`resolve` turns a row plus a config dict into :class:`Knobs`: plain values per
model and per layer, which is all the Paddle code reads.

    >>> k = resolve(Arch(windows="layer_types"), {"hidden_size": 64, "num_attention_heads": 4,
    ...     "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 10, "sliding_window": 8,
    ...     "layer_types": ["sliding_attention", "full_attention"]})
    >>> k.windows, k.head_dim, k.kv_heads
    ((8, None), 16, 4)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple, Union

#: where the four per-layer norms sit: (before attention, after attention, before the MLP, after the MLP);
#: each entry is the norm's parameter name in transformers' layout, None when absent
PRE_NORM = ("input_layernorm", None, "post_attention_layernorm", None)
GEMMA_SANDWICH = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
GLM_SANDWICH = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")
POST_NORM = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")

#: rope_scaling types the decoder computes (``models/decoder/rope.py``)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
#: the keys of a llama3 rope_scaling, all read by transformers
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
#: activations the MLP computes (transformers' ACT2FN names)
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "relu")

Flag = Union[bool, str]  # a fixed value, or the config key that holds it


@dataclass(frozen=True)
class Arch:
    """How one architecture's block differs from Llama's; every field is one knob of the decoder."""

    #: "rms" (RMSNorm) or "layer" (LayerNorm with bias); ``norm_plus_one``: Gemma's ``x * (1 + w)`` (weights init 0)
    norm: str = "rms"
    norm_plus_one: bool = False
    norm_eps: str = "rms_norm_eps"
    #: the four norm slots (see PRE_NORM ... POST_NORM) and the final norm's name under the body
    layer_norms: Tuple[Optional[str], ...] = PRE_NORM
    #: q/k normalisation: None, "head" (one RMSNorm over head_dim, shared by heads: Qwen3, Gemma 3) or
    #: "proj" (one RMSNorm over the whole q / k projection, before the head split: OLMo 2)
    qk_norm: Optional[str] = None
    qkv_bias: Flag = False
    o_bias: Flag = False
    mlp_bias: Flag = False
    #: the config key naming the activation (Gemma 2/3: hidden_activation), falling back to hidden_act
    act: str = "hidden_act"
    #: Phi-3's one qkv_proj ([q; k; v] rows) and Phi-3 / GLM-4's gate_up_proj ([gate; up] rows)
    fused_qkv: bool = False
    fused_gate_up: bool = False
    #: rotate interleaved pairs (x0, x1), (x2, x3) ... (GLM-4, ERNIE 4.5) instead of the two halves
    rope_interleaved: bool = False
    #: config key of the RoPE theta of sliding-window layers (Gemma 3: rope_local_base_freq; no scaling there)
    local_rope_theta: Optional[str] = None
    #: config key of the per-layer list saying whether a layer uses RoPE (SmolLM3's no_rope_layers: 0 = NoPE)
    rope_layers: Optional[str] = None
    #: "none", "all" (config sliding_window on every layer: Mistral, Phi-3) or "layer_types" (per layer)
    windows: str = "none"
    #: the config key that switches the window on (Qwen3-MoE's use_sliding_window, default false: transformers keeps
    #: sliding_window only with it); None: ``sliding_window`` alone decides
    window_switch: Optional[str] = None
    #: config keys: attention / final logit soft-caps, query_pre_attn_scalar (scale = scalar ** -0.5)
    attn_softcap: Optional[str] = None
    final_softcap: Optional[str] = None
    query_scalar: Optional[str] = None
    #: multiply the embeddings by sqrt(hidden_size) (Gemma)
    embed_scale: bool = False
    #: the MLP block a layer builds (``layers.build_mlp``): "dense", or "moe" (the mixture-of-experts block of
    #: ``decoder/moe.py`` on the layers ``moe_spec.is_moe_layer`` picks, the dense MLP on the others)
    mlp: str = "dense"
    #: the MLP sublayer's name in a layer (mixtral: ``block_sparse_moe``)
    mlp_name: str = "mlp"
    #: a bias on the LM head (ERNIE-4.5-MoE: ``use_bias``)
    lm_head_bias: Flag = False
    #: transformers' class default of tie_word_embeddings (used when config.json leaves it out)
    tie_default: bool = False
    #: transformers' class defaults of other keys this row reads, when config.json leaves them out
    defaults: Tuple[Tuple[str, Any], ...] = ()
    #: a learned sink logit per head in every attention softmax (gpt-oss' ``self_attn.sinks``)
    attn_sinks: bool = False
    #: the attention a layer builds: "default" (q/k/v/o projections) or "mla" (DeepSeek's multi-head latent
    #: attention, ``decoder/mla.py``: q/kv low-rank projections, RoPE on a decoupled slice of the head)
    attn: str = "default"
    #: MLA: RoPE rotates interleaved pairs of the rope slice (a fixed bool, or the config key: V3's rope_interleave)
    mla_interleave: Flag = False
    #: MLA: the softmax scale times yarn's mscale(factor, mscale_all_dim) ** 2 (transformers' DeepSeek-V3; not V2)
    mla_mscale: bool = False


@dataclass(frozen=True)
class Knobs:
    """An :class:`Arch` resolved against one config: what the Paddle modules build and compute."""

    arch: Arch
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    eps: float
    act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie: bool
    scale: float  # attention score scale
    attn_softcap: Optional[float]
    final_softcap: Optional[float]
    #: per layer: the sliding window (None: full causal), whether RoPE applies, and its (theta, rope_scaling)
    windows: Tuple[Optional[int], ...]
    rope_on: Tuple[bool, ...]
    rope: Tuple[Tuple[float, Optional[dict]], ...]
    rotary_dim: int
    max_positions: int
    original_max_positions: Optional[int]
    #: the config.json dict itself (what an MoE block reads: experts, top-k, sparse layers ...)
    cfg: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    lm_head_bias: bool = False
    #: MLA rows (``Arch.attn == "mla"``): the latent attention's shape; None on every other row
    mla: Optional["MLAShape"] = None


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek's multi-head latent attention, resolved: ranks and per-head widths (``decoder/mla.py``)."""

    q_lora_rank: Optional[int]  # None: one q_proj (DeepSeek-V2-Lite), else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    nope: int  # qk_nope_head_dim: the per-head q/k channels without RoPE
    rope: int  # qk_rope_head_dim: the RoPE channels (the key's are shared by all heads)
    v: int  # v_head_dim
    interleave: bool  # rotate pairs (x0, x1), ... of the rope slice (transformers' complex / interleaved form)


class ArchError(ValueError):
    """A config.json this row cannot compute exactly; the message names the key."""


def _get(cfg: Mapping[str, Any], arch: Arch, key: str, default=None):
    if key in cfg:  # an explicit null stays null (e.g. attn_logit_softcapping: null switches soft-capping off)
        return cfg[key]
    return dict(arch.defaults).get(key, default)


def _flag(cfg: Mapping[str, Any], arch: Arch, flag: Flag) -> bool:
    return bool(_get(cfg, arch, flag, False)) if isinstance(flag, str) else bool(flag)


def _windows(arch: Arch, cfg: Mapping[str, Any], layers: int) -> Tuple[Optional[int], ...]:
    """Per-layer sliding windows as transformers 4.55 applies them.

    >>> _windows(Arch(windows="all"), {"sliding_window": 4}, 2)
    (4, 4)
    >>> _windows(Arch(), {"sliding_window": 4}, 2)
    (None, None)
    >>> _windows(Arch(windows="all", window_switch="use_sliding_window"), {"sliding_window": 4}, 2)
    (None, None)
    """
    window = cfg.get("sliding_window")
    if arch.window_switch and not _flag(cfg, arch, arch.window_switch):
        return (None,) * layers
    if arch.windows == "none" or not window:
        return (None,) * layers
    if arch.windows == "all":
        return (int(window),) * layers
    types = cfg.get("layer_types")
    if not types:
        return (None,) * layers
    if len(types) != layers:
        raise ArchError(f"config.json layer_types has {len(types)} entries for num_hidden_layers={layers}")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def paddlenlp_rope_scaling(cfg: Mapping[str, Any]) -> Optional[dict]:
    """transformers' ``rope_scaling`` for PaddleNLP's own position keys in a PaddleNLP-layout config.json (its
    Llama / Qwen2 configs): ``rope_scaling_type="linear"`` is transformers' linear scaling (positions / factor);
    ``ntk`` / ``dynamic_ntk``, ALiBi and the long-sequence strategies have no exact equivalent and are refused.

    >>> paddlenlp_rope_scaling({"rope_scaling_type": "linear", "rope_scaling_factor": 2.0})
    {'rope_type': 'linear', 'factor': 2.0}
    >>> paddlenlp_rope_scaling({"rope_scaling_type": "ntk", "rope_scaling_factor": 1.0}) is None
    True
    """
    if cfg.get("alibi"):
        raise ArchError(
            "config.json alibi=true: the decoder computes RoPE, not PaddleNLP's ALiBi; use a checkpoint without it"
        )
    if cfg.get("use_long_sequence_strategies"):
        raise ArchError(
            "config.json use_long_sequence_strategies=true: PaddleNLP's long-sequence strategies are not computed "
            "by the decoder; set rope_scaling (transformers' linear, llama3, yarn or longrope) instead"
        )
    rtype, factor = cfg.get("rope_scaling_type"), float(cfg.get("rope_scaling_factor") or 1.0)
    if rtype in (None, "", "none") or factor == 1.0:
        return None
    if rtype == "linear":
        return {"rope_type": "linear", "factor": factor}
    raise ArchError(
        f"config.json rope_scaling_type={rtype!r} (factor {factor}): PaddleNLP's own RoPE scaling has no exact "
        "equivalent in the decoder, which computes transformers' rope_scaling (linear, llama3, yarn, longrope); "
        "use a checkpoint without it"
    )


def _rope_scaling(cfg: Mapping[str, Any]) -> Optional[dict]:
    legacy = paddlenlp_rope_scaling(cfg)
    rope = cfg.get("rope_scaling")
    if not rope:
        return legacy
    if legacy is not None:
        raise ArchError("config.json sets both rope_scaling and PaddleNLP's rope_scaling_type; keep one")
    if not isinstance(rope, dict):
        raise ArchError(f"config.json rope_scaling must be an object, got {rope!r}")
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise ArchError(
            f"config.json rope_scaling.rope_type={rtype!r} is not implemented by the decoder "
            f"(it implements {', '.join(ROPE_TYPES)}); remove rope_scaling or use another checkpoint"
        )
    if rtype == "llama3":  # transformers reads all four (original_max_position_embeddings: 5.x fills it in)
        absent = [k for k in LLAMA3_ROPE_KEYS if k not in rope]
        if absent:
            raise ArchError(f"config.json rope_scaling (rope_type 'llama3') lacks {absent}")
    return None if rtype == "default" else {**rope, "rope_type": rtype}


def resolve(arch: Arch, cfg: Mapping[str, Any]) -> Knobs:
    """The knobs of ``arch`` for the model described by ``cfg`` (a config.json dict, 4.55 spelling)."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    kv_heads = int(_get(cfg, arch, "num_key_value_heads") or heads)
    head_dim = int(_get(cfg, arch, "head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ArchError(f"config.json num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    act = _get(cfg, arch, arch.act) or _get(cfg, arch, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ArchError(f"config.json {arch.act}={act!r}: the decoder computes {', '.join(ACTIVATIONS)}")
    scalar = _get(cfg, arch, arch.query_scalar) if arch.query_scalar else None
    scale = float(scalar) ** -0.5 if scalar else head_dim**-0.5
    windows = _windows(arch, cfg, layers)
    if arch.rope_layers and _get(cfg, arch, arch.rope_layers) is not None:
        rope_on = tuple(bool(x) for x in _get(cfg, arch, arch.rope_layers))
        if len(rope_on) != layers:
            raise ArchError(f"config.json {arch.rope_layers} has {len(rope_on)} entries for num_hidden_layers={layers}")
    else:
        rope_on = (True,) * layers
    theta = float(_get(cfg, arch, "rope_theta") or 10000.0)
    scaling = _rope_scaling(cfg)
    local = float(_get(cfg, arch, arch.local_rope_theta)) if arch.local_rope_theta else None
    # Gemma 3: sliding layers use the local theta without scaling; global layers theta + rope_scaling
    rope = tuple((local, None) if (local is not None and w is not None) else (theta, scaling) for w in windows)
    partial = float(_get(cfg, arch, "partial_rotary_factor") or 1.0)
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2:
        raise ArchError(f"config.json partial_rotary_factor={partial} gives an odd rotary width {rotary_dim}")

    def cap(key):
        return float(_get(cfg, arch, key)) if key and _get(cfg, arch, key) else None

    if arch.mlp == "moe":
        from .moe_spec import MoEConfigError, is_moe_layer, moe_spec

        try:  # the block's required keys (num_experts ...) are checked here, before anything is built
            moe_spec(cfg)
            [is_moe_layer(cfg, i) for i in range(layers)]
        except MoEConfigError as e:
            raise ArchError(str(e)) from None
        if cfg.get("model_type") == "qwen2_moe" and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            raise ArchError(
                "config.json use_sliding_window=true: the decoder's qwen2_moe row computes full "
                "attention only; set use_sliding_window to false"
            )
    mla = None
    if arch.attn == "mla":
        mla, head_dim, kv_heads, scale = _mla(arch, cfg, heads, kv_heads)
        rotary_dim = head_dim
    original = cfg.get("original_max_position_embeddings")
    return Knobs(
        arch=arch, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=int(cfg["intermediate_size"]), layers=layers, vocab=int(cfg["vocab_size"]),
        eps=float(_get(cfg, arch, arch.norm_eps) or 1e-6), act=act,
        qkv_bias=_flag(cfg, arch, arch.qkv_bias), o_bias=_flag(cfg, arch, arch.o_bias),
        mlp_bias=_flag(cfg, arch, arch.mlp_bias),
        tie=bool(cfg.get("tie_word_embeddings", arch.tie_default)), scale=scale,
        attn_softcap=cap(arch.attn_softcap), final_softcap=cap(arch.final_softcap),
        windows=windows, rope_on=rope_on, rope=rope, rotary_dim=rotary_dim,
        max_positions=int(_get(cfg, arch, "max_position_embeddings") or 2048),
        original_max_positions=int(original) if original else None, cfg=dict(cfg),
        lm_head_bias=_flag(cfg, arch, arch.lm_head_bias), mla=mla,
    )  # fmt: skip


def _mla(arch: Arch, cfg: Mapping[str, Any], heads: int, kv_heads: int):
    """(MLAShape, head_dim = the rope width (what the RoPE tables span), kv heads, softmax scale) of an MLA row.

    The scale is ``(nope + rope) ** -0.5``; with ``mla_mscale`` and a ``rope_scaling`` holding
    ``mscale_all_dim``, times ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2`` (factor > 1), as transformers'
    DeepseekV3Attention computes it from ``rope_scaling["factor"]``.

    >>> a = Arch(attn="mla", mla_mscale=True)
    >>> shape, d, kv, s = _mla(a, {"kv_lora_rank": 8, "q_lora_rank": None, "qk_nope_head_dim": 12,
    ...     "qk_rope_head_dim": 4, "v_head_dim": 8, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
    ...     "mscale_all_dim": 1.0}}, 2, 2)
    >>> shape.q_lora_rank, d, kv, round(s, 6), round(0.25 * (0.1 * math.log(4.0) + 1) ** 2, 6)
    (None, 4, 2, 0.324119, 0.324119)
    """

    def need(key):
        value = _get(cfg, arch, key)
        if value is None:
            raise ArchError(f"config.json {key} is missing; multi-head latent attention needs it")
        return int(value)

    if kv_heads != heads:  # transformers' MLA builds one key per query head (kv_b_proj) and repeats nothing
        raise ArchError(
            f"config.json num_key_value_heads={kv_heads}: multi-head latent attention has one key per "
            f"head; set num_key_value_heads to num_attention_heads ({heads}) or remove it"
        )
    partial = _get(cfg, arch, "partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ArchError(
            f"config.json partial_rotary_factor={partial}: multi-head latent attention rotates the "
            "whole qk_rope_head_dim slice; remove partial_rotary_factor"
        )
    q_rank = _get(cfg, arch, "q_lora_rank")
    shape = MLAShape(
        q_lora_rank=int(q_rank) if q_rank else None,
        kv_lora_rank=need("kv_lora_rank"),
        nope=need("qk_nope_head_dim"),
        rope=need("qk_rope_head_dim"),
        v=need("v_head_dim"),
        interleave=_flag(cfg, arch, arch.mla_interleave),
    )
    if shape.rope % 2:
        raise ArchError(f"config.json qk_rope_head_dim={shape.rope} must be even (RoPE rotates pairs)")
    scale = (shape.nope + shape.rope) ** -0.5
    rope = cfg.get("rope_scaling")
    if arch.mla_mscale and isinstance(rope, dict) and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        if factor > 1:
            scale *= (0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0) ** 2
    return shape, shape.rope, heads, scale


def config_problems(arch: Arch, cfg: Mapping[str, Any]) -> list:
    """What in ``cfg`` the decoder cannot compute exactly (empty when everything is honoured).

    >>> config_problems(Arch(), {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
    ...     "intermediate_size": 96, "vocab_size": 10, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})[0][:46]
    "config.json rope_scaling.rope_type='dynamic' i"
    """
    try:
        resolve(arch, cfg)
    except (ArchError, KeyError, TypeError, ValueError) as e:
        return [str(e) if isinstance(e, ArchError) else f"config.json: {type(e).__name__}: {e}"]
    return []


def tensor_parallel_problems(k: Knobs, degree: int) -> list:
    """What keeps a model with knobs ``k`` from being cut over ``degree`` tensor-parallel ranks ([] when nothing):
    heads and key/value heads are split into ``degree`` groups, the MLP's intermediate size and the vocabulary
    (embeddings, lm_head) into ``degree`` parts.

    >>> k = resolve(Arch(), {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
    ...     "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 10})
    >>> [p[:45] for p in tensor_parallel_problems(k, 2)]
    ['num_key_value_heads=1 is not a multiple of te']
    """
    sizes = [("num_attention_heads", k.heads), ("num_key_value_heads", k.kv_heads), ("vocab_size", k.vocab)]
    if k.arch.mlp == "moe":  # each routed / shared expert is split like the dense MLP (decoder/moe_experts.py)
        from .moe_spec import is_moe_layer, moe_spec

        spec = moe_spec(k.cfg)
        sizes.append(
            (
                "intermediate_size" if spec.model_type in ("mixtral", "gpt_oss") else "moe_intermediate_size",
                spec.intermediate_size,
            )
        )
        if spec.shared_intermediate_size:
            key = "shared_expert_intermediate_size" if spec.shared_gate else "moe_intermediate_size x shared experts"
            sizes.append((key, spec.shared_intermediate_size))
        if not all(is_moe_layer(k.cfg, i) for i in range(k.layers)):
            sizes.append(("intermediate_size", k.intermediate))  # the dense layers' MLP
    else:
        sizes.append(("intermediate_size", k.intermediate))
    out = []
    for key, value in sizes:
        if value % degree:
            out.append(
                f"{key}={value} is not a multiple of tensor_parallel_degree={degree} (each rank takes "
                f"1/{degree} of them); choose a tensor_parallel_degree that divides it"
            )
    return out


def class_prefix(model_type: str) -> str:
    """The transformers class-name prefix of a model_type (its architectures[0] minus ``ForCausalLM``).

    >>> class_prefix("gemma3_text"), class_prefix("smollm3"), class_prefix("ernie4_5")
    ('Gemma3', 'SmolLM3', 'Ernie4_5')
    """
    special = {
        "gemma3_text": "Gemma3",
        "smollm3": "SmolLM3",
        "qwen3_moe": "Qwen3Moe",
        "glm4": "Glm4",
        "olmo2": "Olmo2",
        "ernie4_5": "Ernie4_5",
        "phi3": "Phi3",
        "qwen2_moe": "Qwen2Moe",
        "ernie4_5_moe": "Ernie4_5_Moe",
        "deepseek_v2": "DeepseekV2",
        "deepseek_v3": "DeepseekV3",
        "gpt_oss": "GptOss",
    }
    return special.get(model_type) or model_type[:1].upper() + model_type[1:]
