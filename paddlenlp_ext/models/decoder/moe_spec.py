"""What a mixture-of-experts layer computes, per ``model_type``, read from a transformers config (no paddle).

:func:`moe_spec` turns a config (an object with attributes, or a ``config.json`` dict) into a
:class:`MoESpec`: the routing form, the expert form and the parameter names, so one block
(:class:`~paddlenlp_ext.models.decoder.moe.MoEBlock`) covers every MoE family.  :func:`is_moe_layer`
says which decoder layers hold the sparse block, as each ``modeling_<type>.py`` decides.

The routing forms (``scoring``), for router logits ``z = x @ gate`` [T, E]:

- ``softmax`` (mixtral, qwen2_moe, qwen3_moe, ernie4_5_moe): ``p = softmax(z)``; the top-k of ``p``
  (of ``p + e_score_correction_bias`` for ernie, whose weights stay ``p``), renormalised when
  ``norm_topk_prob``;
- ``softmax`` for deepseek_v2 too: no renormalisation (transformers ignores its ``norm_topk_prob``), times
  ``routed_scaling_factor``; ``topk_method: group_limited_greedy`` keeps the ``topk_group`` groups with the
  best single expert;
- ``sigmoid`` (deepseek_v3): ``s = sigmoid(z)``; choice on ``s + e_score_correction_bias``, limited to the
  ``topk_group`` best of ``n_group`` groups; weights ``s`` renormalised, times ``routed_scaling_factor``;
- ``topk_softmax`` (gpt_oss): ``z`` has a bias; the top-k of ``z``, softmax over those k only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

#: model types the block covers
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "ernie4_5_moe", "deepseek_v2", "deepseek_v3", "gpt_oss")

#: per-expert Linear names (gate, up, down) where transformers has per-expert Linears
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
_DEFAULT_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


class MoEConfigError(ValueError):
    """A config the MoE block cannot build; the message names the key and what to change."""


@dataclass(frozen=True)
class MoESpec:
    """Everything :class:`MoEBlock` needs; built by :func:`moe_spec` (or by hand in tests)."""

    model_type: str
    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    hidden_act: str = "silu"
    scoring: str = "softmax"  # softmax | sigmoid | topk_softmax
    norm_topk_prob: bool = True
    norm_min: float = 0.0  # the renormalising sum is clamped to at least this (ernie's moe_norm_min)
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"  # how a group is scored: the sum of its 2 best experts (v3) or its best (v2)
    correction_bias: Optional[str] = None  # None | "gate" (deepseek: gate.e_score_correction_bias [E])
    #                                        | "moe_statics" (ernie: moe_statics.e_score_correction_bias [1, E])
    router_name: str = "gate"
    router_bias: bool = False
    router_fp32: bool = False  # the router runs in float32 whatever the model's dtype (ernie, deepseek)
    expert_names: Tuple[str, str, str] = _DEFAULT_EXPERT_NAMES
    expert_bias: bool = False  # the routed experts' Linears carry a bias
    shared_bias: Optional[bool] = None  # the shared experts' (None: as expert_bias)
    fused_experts: bool = False  # gpt_oss: experts.{gate_up_proj, down_proj}[_bias] as 3-D parameters
    swiglu_alpha: float = 1.702  # gpt_oss' clamped SwiGLU
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_name: str = "shared_experts"
    shared_gate: bool = False  # qwen2_moe: sigmoid(shared_expert_gate(x)) * shared_expert(x)
    jitter_noise: float = 0.0  # mixtral's router_jitter_noise (training only)

    @property
    def shared_expert_bias(self) -> bool:
        return self.expert_bias if self.shared_bias is None else self.shared_bias

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise MoEConfigError(
                f"{self.model_type}: top-k ({self.top_k}) must be in 1..num_experts ({self.num_experts})"
            )
        if self.scoring not in ("softmax", "sigmoid", "topk_softmax"):
            raise MoEConfigError(f"unknown scoring {self.scoring!r}")
        if self.group_score not in ("top2_sum", "max"):
            raise MoEConfigError(f"unknown group_score {self.group_score!r}")
        if self.n_group > 1:
            if self.num_experts % self.n_group:
                raise MoEConfigError(
                    f"{self.model_type}: n_group={self.n_group} must divide the {self.num_experts} experts"
                )
            if not 0 < self.topk_group <= self.n_group:
                raise MoEConfigError(f"{self.model_type}: topk_group={self.topk_group} must be in 1..n_group")
            if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
                raise MoEConfigError(
                    f"{self.model_type}: topk_group={self.topk_group} groups of "
                    f"{self.num_experts // self.n_group} experts hold fewer than top-k="
                    f"{self.top_k}; raise topk_group"
                )
            if self.group_score == "top2_sum" and self.num_experts // self.n_group < 2:
                raise MoEConfigError(
                    f"{self.model_type}: groups score by their 2 best experts; n_group="
                    f"{self.n_group} leaves fewer than 2 experts per group"
                )


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _need(config: Any, key: str, model_type: str) -> Any:
    value = _get(config, key)
    if value is None:
        raise MoEConfigError(f"{model_type}: config key {key!r} is missing; the MoE block needs it")
    return value


def moe_spec(config: Any, model_type: Optional[str] = None) -> MoESpec:
    """The :class:`MoESpec` of a transformers config of ``model_type`` (default ``config.model_type``).

    >>> s = moe_spec({"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64,
    ...               "num_local_experts": 4, "num_experts_per_tok": 2})
    >>> (s.num_experts, s.top_k, s.intermediate_size, s.expert_names, s.norm_topk_prob)
    (4, 2, 64, ('w1', 'w3', 'w2'), True)
    """
    mt = model_type or _get(config, "model_type")
    if mt not in MOE_TYPES:
        raise MoEConfigError(f"model_type {mt!r} has no MoE block here; the block covers {list(MOE_TYPES)}")
    h = int(_need(config, "hidden_size", mt))
    act = _get(config, "hidden_act", "silu") or "silu"
    k = int(_get(config, "num_experts_per_tok", 2))
    if mt == "mixtral":
        return MoESpec(
            mt,
            h,
            int(_need(config, "num_local_experts", mt)),
            k,
            int(_need(config, "intermediate_size", mt)),
            act,
            expert_names=_EXPERT_NAMES[mt],
            jitter_noise=float(_get(config, "router_jitter_noise", 0.0) or 0.0),
        )
    if mt in ("qwen2_moe", "qwen3_moe"):
        shared = int(_get(config, "shared_expert_intermediate_size", 0) or 0) if mt == "qwen2_moe" else 0
        return MoESpec(
            mt,
            h,
            int(_need(config, "num_experts", mt)),
            k,
            int(_need(config, "moe_intermediate_size", mt)),
            act,
            norm_topk_prob=bool(_get(config, "norm_topk_prob", False)),
            shared_intermediate_size=shared,
            shared_name="shared_expert",
            shared_gate=True,
        )
    if mt == "ernie4_5_moe":
        inter = int(_need(config, "moe_intermediate_size", mt))
        return MoESpec(
            mt,
            h,
            int(_need(config, "moe_num_experts", mt)),
            int(_get(config, "moe_k", 6)),
            inter,
            act,
            norm_min=float(_get(config, "moe_norm_min", 1e-12)),
            correction_bias="moe_statics",
            router_fp32=True,
            **_biases(config, "use_bias"),
            shared_intermediate_size=inter * int(_get(config, "moe_num_shared_experts", 0) or 0),
        )
    if mt in ("deepseek_v2", "deepseek_v3"):
        _deepseek_keys(config, mt)
    if mt == "deepseek_v2":
        inter = int(_need(config, "moe_intermediate_size", mt))
        method = _get(config, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise MoEConfigError(
                f"deepseek_v2: topk_method={method!r} is not one transformers' DeepseekV2MoEGate "
                "computes; use 'greedy' or 'group_limited_greedy'"
            )
        grouped = method == "group_limited_greedy"
        return MoESpec(
            mt,
            h,
            int(_need(config, "n_routed_experts", mt)),
            int(_need(config, "num_experts_per_tok", mt)),
            inter,
            act,
            norm_topk_prob=False,
            router_fp32=True,
            routed_scaling_factor=float(_get(config, "routed_scaling_factor", 1.0)),
            n_group=int(_need(config, "n_group", mt)) if grouped else 1,
            topk_group=int(_need(config, "topk_group", mt)) if grouped else 1,
            group_score="max",
            **_biases(config, "mlp_bias"),
            shared_intermediate_size=inter * int(_get(config, "n_shared_experts", 0) or 0),
        )
    if mt == "deepseek_v3":
        inter = int(_need(config, "moe_intermediate_size", mt))
        return MoESpec(
            mt,
            h,
            int(_need(config, "n_routed_experts", mt)),
            k,
            inter,
            act,
            scoring="sigmoid",
            norm_topk_prob=bool(_get(config, "norm_topk_prob", True)),
            norm_min=1e-20,
            routed_scaling_factor=float(_get(config, "routed_scaling_factor", 1.0)),
            n_group=int(_get(config, "n_group", 1) or 1),
            topk_group=int(_get(config, "topk_group", 1) or 1),
            correction_bias="gate",
            router_fp32=True,
            shared_intermediate_size=inter * int(_get(config, "n_shared_experts", 0) or 0),
        )
    # gpt_oss: alpha and limit are constants of transformers 4.55's GptOssExperts; later configs name the limit
    return MoESpec(
        mt,
        h,
        int(_need(config, "num_local_experts", mt)),
        k,
        int(_need(config, "intermediate_size", mt)),
        act,
        scoring="topk_softmax",
        router_name="router",
        router_bias=True,
        fused_experts=True,
        swiglu_limit=float(_get(config, "swiglu_limit", 7.0) or 7.0),
    )


def _biases(config: Any, key: str) -> dict:
    """The expert_bias / shared_bias of ernie4_5_moe (``use_bias``) or deepseek_v2 (``mlp_bias``).

    transformers 4.55 gives the routed experts a bias with ``key`` true, 5.x (fused experts) never does, and both
    give the shared experts one; the loader reads which one saved the checkpoint from its tensor names and sets
    ``routed_expert_bias: false`` on the config for 5.x's layout (models/loading.py).

    >>> _biases({"use_bias": True}, "use_bias"), _biases({"use_bias": True, "routed_expert_bias": False}, "use_bias")
    ({'expert_bias': True, 'shared_bias': True}, {'expert_bias': False, 'shared_bias': True})
    """
    bias = bool(_get(config, key, False))
    return {"expert_bias": bias and _get(config, "routed_expert_bias", True) is not False, "shared_bias": bias}


#: the routing of transformers' DeepSeek classes, whatever config.json says: the original DeepSeek code's (and
#: PaddleNLP's) scoring_func / topk_method keys are read only to refuse another routing than this one
_DEEPSEEK_ROUTING = {
    "deepseek_v2": ("softmax", ("greedy", "group_limited_greedy")),
    "deepseek_v3": ("sigmoid", ("noaux_tc",)),
}


def _deepseek_keys(config: Any, mt: str) -> None:
    """Refuse config.json routing keys transformers' DeepSeek classes ignore but would mean another routing.

    >>> try:
    ...     _deepseek_keys({"scoring_func": "softmax", "topk_method": "gready"}, "deepseek_v3")
    ... except MoEConfigError as e:
    ...     print(str(e)[:75])
    deepseek_v3: config.json scoring_func='softmax': transformers' DeepseekV3 r
    >>> _deepseek_keys({"scoring_func": "sigmoid", "topk_method": "noaux_tc"}, "deepseek_v3")  # real V3: nothing
    """
    scoring, methods = _DEEPSEEK_ROUTING[mt]
    cls = "DeepseekV3" if mt == "deepseek_v3" else "DeepseekV2"
    got = _get(config, "scoring_func")
    if got is not None and got != scoring:
        raise MoEConfigError(
            f"{mt}: config.json scoring_func={got!r}: transformers' {cls} routes with {scoring} scores "
            f"only; set scoring_func to {scoring!r} (or remove it) if the checkpoint was trained so, "
            "else transformers computes this checkpoint otherwise than it was trained"
        )
    got = _get(config, "topk_method")
    if mt == "deepseek_v3" and got is not None and got not in methods:
        raise MoEConfigError(
            f"{mt}: config.json topk_method={got!r}: transformers' DeepseekV3 chooses experts by "
            "'noaux_tc' (group-limited top-k on sigmoid scores + e_score_correction_bias) only; "
            "set topk_method to 'noaux_tc' (or remove it) if the checkpoint was trained so"
        )


def is_moe_layer(config: Any, layer_idx: int, model_type: Optional[str] = None) -> bool:
    """Whether decoder layer ``layer_idx`` holds the sparse block (else the dense MLP), as transformers decides.

    >>> cfg = {"model_type": "deepseek_v3", "first_k_dense_replace": 1}
    >>> [is_moe_layer(cfg, i) for i in range(3)]
    [False, True, True]
    >>> cfg = {"model_type": "ernie4_5_moe", "num_hidden_layers": 4, "moe_layer_start_index": 1,
    ...        "moe_layer_end_index": -1, "moe_layer_interval": 2}
    >>> [is_moe_layer(cfg, i) for i in range(4)]
    [False, True, False, True]
    """
    mt = model_type or _get(config, "model_type")
    if mt in ("mixtral", "gpt_oss"):
        return True
    if mt in ("qwen2_moe", "qwen3_moe"):
        step = int(_get(config, "decoder_sparse_step", 1) or 1)
        return (
            layer_idx not in (_get(config, "mlp_only_layers") or [])
            and int(_get(config, "num_experts", 0)) > 0
            and (layer_idx + 1) % step == 0
        )
    if mt == "ernie4_5_moe":
        end = int(_get(config, "moe_layer_end_index", -1))
        end = int(_need(config, "num_hidden_layers", mt)) - 1 if end == -1 else end
        return (layer_idx + 1) % int(_get(config, "moe_layer_interval", 1)) == 0 and int(
            _get(config, "moe_layer_start_index", 1)
        ) <= layer_idx <= end
    if mt in ("deepseek_v2", "deepseek_v3"):
        return layer_idx >= int(_get(config, "first_k_dense_replace", 0))
    raise MoEConfigError(f"model_type {mt!r} has no MoE block here; the block covers {list(MOE_TYPES)}")


#: the types whose routed experts are fused 3-D parameters (no per-expert Linear for an adapter to wrap)
FUSED_EXPERT_TYPES = ("gpt_oss",)


def fused_expert_target_problems(patterns, model_type: Optional[str]) -> list:
    """The ``lora_target_modules`` patterns that would reach fused expert parameters, which no adapter here wraps
    (PEFT's ``target_parameters`` form is not implemented): one message per pattern, naming the key.

    >>> fused_expert_target_problems([".*self_attn.q_proj", ".*mlp.experts.*"], "gpt_oss")[0][:58]
    "lora_target_modules: '.*mlp.experts.*' reaches gpt_oss' fu"
    >>> fused_expert_target_problems([".*mlp.experts.*"], "mixtral")
    []
    """
    import re

    if model_type not in FUSED_EXPERT_TYPES or not patterns:
        return []
    names = [f"{model_type}.layers.0.mlp.experts" + s for s in ("", ".gate_up_proj", ".down_proj")]
    out = []
    for p in patterns:
        try:
            hit = any(re.fullmatch(str(p), n) for n in names)
        except re.error:
            continue  # an invalid pattern is reported where the patterns are checked
        if hit:
            out.append(
                f"lora_target_modules: {p!r} reaches {model_type}' fused experts (mlp.experts.gate_up_proj / "
                "down_proj are 3-D parameters, not Linear layers; adapters on them are not implemented "
                "here); remove it from lora_target_modules (the default adapts attention q/k/v/o_proj)"
            )
    return out


#: the run keys of MoE training (docs/moe.md); LLaMA-Factory's name is an alias of PaddleFormers'
AUX_LOSS_KEY, AUX_LOSS_ALIAS = "router_aux_loss_coef", "moe_aux_loss_coef"
BIAS_RATE_KEY = "moe_router_bias_update_rate"
#: the types whose router has an ``e_score_correction_bias`` the bias update can move
CORRECTION_BIAS_TYPES = ("ernie4_5_moe", "deepseek_v3")


def router_aux_loss_coef(run_keys: Mapping[str, Any], model_config: Any) -> float:
    """The auxiliary-loss coefficient a run uses: ``router_aux_loss_coef`` (or its alias
    ``moe_aux_loss_coef``) from the run's keys; else, as transformers does, the checkpoint's
    ``router_aux_loss_coef`` when its ``output_router_logits`` is true, and 0.0 (no aux loss) otherwise.

    >>> ckpt = {"router_aux_loss_coef": 0.001, "output_router_logits": False}
    >>> router_aux_loss_coef({}, ckpt), router_aux_loss_coef({"moe_aux_loss_coef": 0.02}, ckpt)
    (0.0, 0.02)
    >>> router_aux_loss_coef({}, {**ckpt, "output_router_logits": True})
    0.001
    """
    given = {k: run_keys[k] for k in (AUX_LOSS_KEY, AUX_LOSS_ALIAS) if run_keys.get(k) is not None}
    if len(given) == 2 and float(given[AUX_LOSS_KEY]) != float(given[AUX_LOSS_ALIAS]):
        raise MoEConfigError(
            f"{AUX_LOSS_KEY}={given[AUX_LOSS_KEY]} and its alias {AUX_LOSS_ALIAS}="
            f"{given[AUX_LOSS_ALIAS]} disagree; set only {AUX_LOSS_KEY}"
        )
    for key, value in given.items():
        try:
            coef = float(value)
        except (TypeError, ValueError):
            raise MoEConfigError(f"{key}={value!r} must be a number >= 0") from None
        if coef < 0:
            raise MoEConfigError(f"{key}={value!r} must be a number >= 0")
        return coef
    if _get(model_config, "output_router_logits", False):
        return float(_get(model_config, AUX_LOSS_KEY, 0.0) or 0.0)
    return 0.0


def moe_key_problems(run_keys: Mapping[str, Any], model_type: Optional[str]) -> list:
    """What is wrong with the MoE keys of a run for a model of ``model_type`` (one message per problem,
    naming the key and what to change; [] when nothing is).

    >>> moe_key_problems({"moe_router_bias_update_rate": 0.001}, "deepseek_v3")
    []
    >>> moe_key_problems({"moe_router_bias_update_rate": 0.001}, "mixtral")[0][:60]
    'moe_router_bias_update_rate: mixtral routers have no e_score'
    """
    problems = []
    moe = model_type in MOE_TYPES
    for key in (AUX_LOSS_KEY, AUX_LOSS_ALIAS, BIAS_RATE_KEY, "freeze_router"):
        if run_keys.get(key) not in (None, False, 0, 0.0) and not moe:
            problems.append(f"{key}: model_type {model_type!r} has no mixture-of-experts router; remove {key}")
    rate = run_keys.get(BIAS_RATE_KEY)
    if moe and rate not in (None, 0, 0.0):
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate < 0:
            problems.append(f"{BIAS_RATE_KEY}={rate!r} must be a number >= 0 (DeepSeek-V3 used 0.001)")
        elif model_type not in CORRECTION_BIAS_TYPES:
            problems.append(
                f"{BIAS_RATE_KEY}: {model_type} routers have no e_score_correction_bias to update "
                f"(only {list(CORRECTION_BIAS_TYPES)} do); remove {BIAS_RATE_KEY} or use "
                f"{AUX_LOSS_KEY} to balance the experts"
            )
    return problems
