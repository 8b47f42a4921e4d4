"""The model-family table: one row per PaddleNLP causal-LM ``model_type`` (and those of our decoder).

Paddle-free, so ``config/`` reads it before anything loads.  Each row (:class:`Family`; ``family_row.py``
says what each field means) states what the code of that family does, as measured on PaddleNLP 3.0.0b4
with tiny random models built by its own ``*Config`` / ``*ForCausalLM`` classes (hidden 64, 2 layers;
``tests/test_families_e2e.py`` runs every supported cell through the CLI).  A feature a row does not list
is refused at config time (:func:`feature_problem`).

    >>> row("qwen").targets
    ('.*\\\\.h\\\\.\\\\d+\\\\..*',)
    >>> feature_problem("chatglm_v2", "flash_mask")[:50]
    'chatglm_v2 models do not take FlashMask start rows'
"""

from typing import Any, Dict, Optional

from .decoder.rows import GEMMA_SANDWICH, GLM_SANDWICH, POST_NORM, Arch

# FEATURES, Family, LAYERS_BLOCKS and H_BLOCKS are read from here too (re-exported)
from .family_row import (  # noqa: F401
    _ALL,
    _DENSE,
    _DENSE_DPO,
    _DENSE_DPO_FA,
    _MLA_TARGETS,
    _MOE_TARGETS,
    _OWN_DROPOUT,
    FEATURES,
    H_BLOCKS,
    LAYERS_BLOCKS,
    Family,
    _decoder_row,
    _moe_row,
    _no_flashmask,
)


_ATTN_BIAS = dict(qkv_bias="attention_bias", o_bias="attention_bias")
#: Qwen3-MoE on the decoder: qwen3's attention (q/k RMSNorm per head, attention_bias) + the MoE block on every
#: decoder_sparse_step-th layer not in mlp_only_layers (norm_topk_prob, no shared expert); transformers'
#: Qwen3MoeConfig keeps sliding_window only with use_sliding_window, and then slides every layer
_QWEN3_MOE = Arch(mlp="moe", qk_norm="head", windows="all", window_switch="use_sliding_window", **_ATTN_BIAS)
_QWEN3_MOE_TARGETS = (
    r".*layers\.\d+\.self_attn\.[qkvo]_proj",
    r".*layers\.\d+\.mlp\.(experts\.\d+\.)?(gate|up|down)_proj",
)
_GEMMA = dict(norm_plus_one=True, embed_scale=True, tie_default=True, **_ATTN_BIAS)

_MOE = (
    "crashes inside PaddleNLP 3.0.0b4's MoE code on Paddle 3.3 ({}); a plain forward + backward fails the same "
    "way. Use a dense model (llama, qwen2, qwen3, mistral, ...)"
)

FAMILIES: Dict[str, Family] = {
    f.model_type: f
    for f in (
        # on our decoder (PaddleNLP's LlamaForCausalLM / Qwen2ForCausalLM checkpoints and ours of qwen3 load by name:
        # the same tensor names and [in, out] Linears, logits equal to PaddleNLP's forward; tests/test_decoder_moved.py).
        # qwen2 and qwen3 keep their attention dropout (attention_probs_dropout_prob -> attention_dropout)
        _decoder_row("llama", Arch(mlp_bias="mlp_bias", **_ATTN_BIAS), planner="llama"),
        _decoder_row(
            "qwen2",
            Arch(qkv_bias=True, windows="layer_types"),
            planner="llama",
            dropout={"attention_probs_dropout_prob": "attention_dropout"},
        ),
        _decoder_row(
            "qwen3",
            Arch(qk_norm="head", windows="layer_types", **_ATTN_BIAS),
            planner="llama",
            dropout={"attention_probs_dropout_prob": "attention_dropout"},
        ),
        # Qwen3-MoE in PaddleNLP's layout (models/qwen3/moe.py, our own Paddle code): attention and every expert's MLP
        # are the targets; the router (mlp.gate, [hidden, num_experts]) is neither adapted nor quantized: its logits
        # pick the experts. A transformers-layout qwen3_moe checkpoint trains on the decoder's MoE row (hf_row)
        Family(
            "qwen3_moe",
            targets=_QWEN3_MOE_TARGETS,
            features=frozenset(
                {"lora", "qlora", "full", "packing", "flash_attention", "flash_mask", "merge", "hf_checkpoint"}
            ),
            qk_norm=True,
            hf_layout=True,
            masks=frozenset({"dense", "startend", "position_ids"}),
            dropout={"attention_probs_dropout_prob": "attention_dropout"},
            refusals={
                **{
                    f: f"qwen3_moe preference training ({FEATURES[f]}) is not verified yet (tests/test_qwen3_moe.py "
                    "covers SFT); use a dense model (qwen3) for it"
                    for f in ("dpo", "kto", "reward", "grpo")
                },
                "tp": "qwen3_moe checkpoints in PaddleNLP's layout (models/qwen3) have no tensor-parallel "
                "experts; set tensor_parallel_degree=1, or export the model with llm/tools/export.py "
                "--format hf and train from that directory (a transformers-layout qwen3_moe trains on "
                "our decoder, which is tensor parallel)",
                "predict": "qwen3_moe generation through the predictor is not verified yet on the PaddleNLP "
                "layout (models/qwen3); export the model with llm/tools/export.py --format hf and "
                "predict from that directory (a transformers-layout qwen3_moe runs on our decoder)",
                "pp": "qwen3_moe checkpoints in PaddleNLP's layout (models/qwen3) have no pipeline model; "
                "set pipeline_parallel_degree=1, or export the model with llm/tools/export.py --format hf "
                "and train from that directory (a transformers-layout qwen3_moe trains on our decoder, "
                "whose MoE rows run as pipeline stages without the aux loss)",
            },
            arch=_QWEN3_MOE,
            hf_row=_moe_row("qwen3_moe", _QWEN3_MOE, _QWEN3_MOE_TARGETS),
            hf_row_keys=("use_sliding_window", "rope_scaling", "output_router_logits"),
        ),
        # on our decoder (PaddleNLP's MistralForCausalLM / GemmaForCausalLM checkpoints load by name: the same tensor
        # names and [in, out] Linears, logits equal to PaddleNLP's forward; tests/test_decoder_moved.py)
        _decoder_row("mistral", Arch(windows="all"), planner="llama"),
        _decoder_row("gemma", Arch(**_GEMMA), planner="llama"),
        # our own decoder (paddlenlp_ext/models/decoder); transformers' modeling_<type>.py is each row's reference
        _decoder_row(
            "gemma2",
            Arch(
                layer_norms=GEMMA_SANDWICH,
                act="hidden_activation",
                windows="layer_types",
                attn_softcap="attn_logit_softcapping",
                final_softcap="final_logit_softcapping",
                query_scalar="query_pre_attn_scalar",
                **_GEMMA,
                defaults=(
                    ("query_pre_attn_scalar", 256),
                    ("attn_logit_softcapping", 50.0),
                    ("final_logit_softcapping", 30.0),
                ),
            ),
        ),
        _decoder_row(
            "gemma3_text",
            Arch(
                layer_norms=GEMMA_SANDWICH,
                act="hidden_activation",
                windows="layer_types",
                qk_norm="head",
                local_rope_theta="rope_local_base_freq",
                # transformers' Gemma 3 keeps attn_logit_softcapping but never applies it
                final_softcap="final_logit_softcapping",
                query_scalar="query_pre_attn_scalar",
                **_GEMMA,
                defaults=(("query_pre_attn_scalar", 256), ("rope_local_base_freq", 10000.0)),
            ),
        ),
        _decoder_row("phi3", Arch(fused_qkv=True, fused_gate_up=True, windows="all")),
        _decoder_row(
            "glm4",
            Arch(
                layer_norms=GLM_SANDWICH,
                fused_gate_up=True,
                rope_interleaved=True,
                qkv_bias="attention_bias",
                defaults=(("partial_rotary_factor", 0.5), ("attention_bias", True)),
            ),
        ),
        _decoder_row(
            "ernie4_5",
            Arch(rope_interleaved=True, qkv_bias="use_bias", o_bias="use_bias", mlp_bias="use_bias", tie_default=True),
        ),
        _decoder_row("olmo2", Arch(layer_norms=POST_NORM, qk_norm="proj", **_ATTN_BIAS)),
        _decoder_row(
            "smollm3",
            Arch(
                rope_layers="no_rope_layers", windows="layer_types", mlp_bias="mlp_bias", tie_default=True, **_ATTN_BIAS
            ),
        ),
        Family(
            "chatglm_v2",
            features=_DENSE_DPO,
            refusals=_no_flashmask("chatglm_v2", "packed vs one-by-one gradients differ by 61% in check_packing"),
        ),
        Family("qwen", features=_DENSE_DPO_FA, targets=H_BLOCKS, refusals=_no_flashmask("qwen")),
        Family(
            "bloom",
            targets=H_BLOCKS,
            refused=(
                "PaddleNLP 3.0.0b4's bloom blocks pass no gradient to their weights on Paddle 3.3 (every q/k/v, dense and "
                "MLP weight gets a zero gradient; only embeddings, norms and biases would train); use another family"
            ),
        ),
        # gpt and opt read PaddleNLP's dropout keys themselves (default 0.1 in their configs)
        Family(
            "gpt",
            sets_ignore_index=True,
            dropout=dict(_OWN_DROPOUT),
            refusals={
                **_no_flashmask("gpt", "packed vs one-by-one gradients differ by 23% in check_packing"),
                **{
                    f: (
                        "gpt models apply dropout in training (hidden_dropout_prob / attention_probs_dropout_prob, 0.1 by "
                        f"default), so the policy ({FEATURES[f]}) and its adapters-off reference disagree before any step; use "
                        "llm/run_finetune.py"
                    )
                    for f in ("dpo", "kto", "grpo")
                },
            },
        ),
        Family(
            "opt",
            masks=frozenset(),
            features=_DENSE - {"packing"},
            dropout=dict(_OWN_DROPOUT),
            refusals={
                **_no_flashmask("opt"),
                "flash_mask": (
                    "opt models swallow FlashMask start rows and position ids through **kwargs (they would "
                    "train on a wrong mask); set flash_mask=false and zero_padding=false"
                ),
                "packing": (
                    "opt models build their own causal mask and take no position ids, so packed examples would see "
                    "each other; set zero_padding=false"
                ),
            },
        ),
        Family(
            "chatglm",
            refused="chatglm (ChatGLM-6B v1) needs a per-example prefix-LM 4-D attention mask, which the "
            "data pipeline does not build (without it PaddleNLP's forward fails); use chatglm_v2 or another family",
        ),
        # codegen shifts labels inside its forward: the run never passes it labels (training.loss.token_mean_loss)
        Family(
            "codegen",
            targets=H_BLOCKS,
            body="transformer",
            shifts_labels=True,
            masks=frozenset(),
            features=_DENSE - {"packing"},
            refusals={
                "packing": (
                    "codegen models take no position_ids (packed examples would continue each "
                    "other's positions); set zero_padding=false"
                )
            },
        ),
        Family(
            "yuan",
            refused=(
                "yuan builds its own attention mask from eod_token and ignores the mask we pass "
                "(packed and one-by-one losses differ); training it is not verified here; use another "
                "family"
            ),
        ),
        # MoE rows on our decoder (transformers' layout; PaddleNLP 3.0.0b4's own MoE classes crash on Paddle 3.3)
        _moe_row("qwen2_moe", Arch(mlp="moe", qkv_bias="qkv_bias", defaults=(("qkv_bias", True),))),
        _moe_row("mixtral", Arch(mlp="moe", mlp_name="block_sparse_moe", windows="all")),
        # the ernie4_5 row's attention (interleaved RoPE, use_bias) + MoE layers from moe_layer_start_index every
        # moe_layer_interval; fp32 router with moe_statics.e_score_correction_bias; an LM head bias with use_bias
        _moe_row(
            "ernie4_5_moe",
            Arch(
                mlp="moe",
                rope_interleaved=True,
                qkv_bias="use_bias",
                o_bias="use_bias",
                mlp_bias="use_bias",
                lm_head_bias="use_bias",
                tie_default=True,
            ),
        ),
        # attention sinks, alternating sliding windows (layer_types), q/k/v/o biases (always: GptOssConfig fixes
        # attention_bias), the MoE block on every layer: router with bias, fused interleaved gate_up_proj with biases,
        # clamped SwiGLU. Its experts are 3-D parameters (no Linear): adapters and quantization reach attention only
        _moe_row(
            "gpt_oss",
            Arch(mlp="moe", windows="layer_types", attn_sinks=True, qkv_bias=True, o_bias=True),
            _MOE_TARGETS[:1],
        ),
        Family("jamba", refused=_MOE.format("its MoE routing")),
        # multi-head latent attention (decoder/mla.py) + the MoE block from first_k_dense_replace: V2 softmax routing
        # (greedy / group_limited_greedy), complex (interleaved) RoPE; V3 sigmoid routing with e_score_correction_bias,
        # rope_interleave, yarn's mscale in the softmax scale
        _moe_row(
            "deepseek_v2",
            Arch(mlp="moe", attn="mla", mla_interleave=True, mlp_bias="mlp_bias", **_ATTN_BIAS),
            _MLA_TARGETS,
        ),
        _moe_row(
            "deepseek_v3",
            Arch(
                mlp="moe",
                attn="mla",
                mla_interleave="rope_interleave",
                mla_mscale=True,
                defaults=(("rope_interleave", True),),
                **_ATTN_BIAS,
            ),
            _MLA_TARGETS,
        ),
        Family(
            "gptj",
            targets=H_BLOCKS,
            refused="PaddleNLP 3.0.0b4 Auto classes cannot build gptj models; use another family",
        ),
        Family(
            "rw",
            targets=H_BLOCKS,
            refused="PaddleNLP 3.0.0b4 Auto classes cannot build rw (Falcon) models; use another family",
        ),
        Family(
            "mamba",
            masks=frozenset(),
            refused=(
                "mamba is a state-space model with no attention mask (packing is "
                "impossible) and its fine-tuning is not verified here; use another "
                "family"
            ),
        ),
    )
}

#: set PADDLENLP_EXT_UNLISTED_MODEL=1 to train a model_type that is not in the table (generic row, at your own risk)
UNLISTED_ENV = "PADDLENLP_EXT_UNLISTED_MODEL"
#: the row an unlisted model_type gets with the opt-in: decoder blocks named layers.N, dense mask, no FlashMask/TP/PP
GENERIC = Family("unlisted", features=_DENSE - {"qlora"})


def row(model_type: Optional[str]) -> Optional[Family]:
    """The table's row of ``model_type`` (None when it is not in the table)."""
    return FAMILIES.get(model_type or "")


def layout_row(model_type: Optional[str], hf_layout: bool = False, config: Any = None) -> Optional[Family]:
    """The row a checkpoint of ``model_type`` trains on: :attr:`Family.hf_row` where the table has one (qwen3_moe)
    for a transformers-layout checkpoint, or for one whose ``config`` (config.json dict or config object) sets a
    key of :attr:`Family.hf_row_keys`; else the table's row (None when it is not in the table).

    >>> layout_row("qwen3_moe").decoder, layout_row("qwen3_moe", hf_layout=True).decoder
    (False, True)
    >>> layout_row("qwen3_moe", config={"use_sliding_window": True, "sliding_window": 8}).decoder
    True
    >>> layout_row("mixtral", hf_layout=True) is row("mixtral")
    True
    """
    f = row(model_type)
    if f is None or f.hf_row is None:
        return f

    def get(key):
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    if hf_layout or (config is not None and any(get(k) for k in f.hf_row_keys)):
        return f.hf_row
    return f


def family_problem(model_type: Optional[str], allow_unlisted: bool = False) -> Optional[str]:
    """Why ``model_type`` cannot be fine-tuned at all here, or None.

    >>> family_problem("llama") is None
    True
    >>> family_problem("gptj")[:38]
    'gptj: PaddleNLP 3.0.0b4 Auto classes c'
    >>> family_problem("falcon")[:40]
    "model_type 'falcon' is not in the model-"
    """
    f = row(model_type)
    if f is None:
        if allow_unlisted:
            return None
        return (
            f"model_type {model_type!r} is not in the model-family table (docs/models.md lists "
            f"{', '.join(sorted(k for k, v in FAMILIES.items() if v.refused is None))}); set the environment "
            f"variable {UNLISTED_ENV}=1 to train it anyway with the generic decoder row"
        )
    if f.refused is not None:
        return f"{f.model_type}: {f.refused}"
    return None


def feature_problem(model_type: Optional[str], feature: str, hf_layout: bool = False) -> Optional[str]:
    """Why ``feature`` (a key of :data:`FEATURES`) is refused on this family, or None; ``hf_layout``: the
    checkpoint is in transformers' layout (:func:`layout_row`).

    An unlisted model_type (allowed by the opt-in) gets :data:`GENERIC`'s answer.

    >>> feature_problem("qwen2", "flash_mask") is None
    True
    >>> feature_problem("gpt", "tp")
    'gpt models: tensor_parallel_degree > 1 is not verified on this family; set tensor_parallel_degree=1'
    """
    f = layout_row(model_type, hf_layout) or GENERIC
    if f.refused is not None:
        return f"{f.model_type}: {f.refused}"
    if feature in f.features:
        return None
    if feature in f.refusals:
        return f.refusals[feature]
    key = FEATURES[feature]
    name = f"{model_type} models" if f is not GENERIC else f"model_type {model_type!r} (not in the table)"
    if feature == "reward":
        heads = ", ".join(sorted(k for k, v in FAMILIES.items() if v.supports("reward")))
        return (
            f"model_type {model_type!r} cannot take a reward head here: the score head reads the decoder's last "
            f"hidden state, supported for {heads}"
        )
    if feature in ("dpo", "kto", "grpo"):
        return f"{name}: preference training ({key}) is not verified on this family; use llm/run_finetune.py"
    if feature == "hf_checkpoint":
        return hf_layout_problem(model_type)
    if feature == "qlora":
        return f"{name}: {key} (QLoRA) is not verified on this family; remove {key}"
    if feature == "flash_mask":
        return f"{name}: FlashMask start rows are not verified on this family; set flash_mask=false"
    value = {"tp": "tensor_parallel_degree > 1", "pp": "pipeline_parallel_degree > 1"}.get(feature, f"{key}")
    fix = {
        "tp": "set tensor_parallel_degree=1",
        "pp": "set pipeline_parallel_degree=1",
        "flash_attention": "set use_flash_attention=false",
        "packing": "set zero_padding=false",
    }.get(feature, f"change {key}")
    return f"{name}: {value} is not verified on this family; {fix}"


def hf_layout_problem(model_type: Optional[str]) -> Optional[str]:
    """Why a transformers-layout (Hugging Face) checkpoint of ``model_type`` is refused, or None.

    >>> hf_layout_problem("mistral") is None
    True
    >>> hf_layout_problem("gpt")[:58]
    'gpt: Hugging Face (transformers-layout) checkpoints are re'
    """
    f = row(model_type)
    if f is not None and f.hf_layout:
        return None
    readable = ", ".join(sorted(k for k, v in FAMILIES.items() if v.hf_layout))
    return (
        f"{model_type}: Hugging Face (transformers-layout) checkpoints are read for {readable} only; convert the "
        "checkpoint to PaddleNLP's layout (PaddleNLP's from_pretrained(..., convert_from_torch=True) then "
        "save_pretrained) and point model_name_or_path at that directory"
    )


def planner_layout_problem(model_type: Optional[str]) -> Optional[str]:
    """Why the memory planner cannot model ``model_type``'s shapes, or None (a Llama-layout family).

    >>> planner_layout_problem("gemma") is None
    True
    >>> planner_layout_problem("gpt")[:52]
    'the memory planner models the Llama-layout families '
    """
    f = row(model_type)
    if f is not None and f.planner == "llama":
        return None
    known = ", ".join(k for k, v in FAMILIES.items() if v.planner == "llama")
    return (
        f"the memory planner models the Llama-layout families ({known}); {model_type!r} "
        f"{'is not in the model-family table' if f is None else 'has other layer names and shapes'}, "
        "so no plan is made for it"
    )


def pipeline_class(model_type: Optional[str]) -> Optional[str]:
    """PaddleNLP's pipeline class name of the family (None: pipeline parallel is refused)."""
    f = row(model_type)
    return f.pipeline_class if f is not None and f.supports("pp") else None
