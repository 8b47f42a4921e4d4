"""The row type of the model-family table (``family_table.py``) and the helpers that build its rows; no paddle.

A row (:class:`Family`) states what the code of one ``model_type`` does:

* ``targets``: the decoder Linear patterns (``re.fullmatch`` on sublayer names;
  every Linear inside the numbered decoder blocks).  Read by ``models.targets``,
  hence by adapters and quantization.
* ``shifts_labels``: the forward shifts ``labels`` itself (codegen); our data is
  already shifted, so such a family would learn token t+2.
* ``sets_ignore_index``: the config carries ``ignore_index`` (GPT: 0) that the
  model's criterion uses; the run sets it to -100, the label padding we write.
* ``masks``: the mask forms the forward honours: ``dense`` (a [B, 1, L, L]
  attention_mask), ``startend`` (FlashMask start rows), ``position_ids``.
  Packing needs ``dense`` (or ``startend`` with flash_mask) and ``position_ids``.
* ``features``: what the toolkit runs on the family (:data:`FEATURES`); a feature
  not listed is refused at config time with ``refusals[feature]`` or a default
  message naming the key to change.
* ``pipeline_class``: PaddleNLP's ``*ForCausalLMPipe`` the pipeline path builds.
* ``planner``: ``"llama"`` when the memory planner's Llama-layout shape holds
  (q/k/v/o + gate/up/down under ``<model_type>.layers.N``; ``head_dim`` from
  config.json when given, as gemma and qwen3 do), else None; ``qkv_bias`` and
  ``qk_norm`` (per-head q/k RMSNorm weights) complete the per-layer count.
* ``hf_layout``: a transformers-layout checkpoint of this family is read
  (``models/hf_layout.py``; ``family_table.hf_layout_problem`` is the refusal otherwise).
* ``refused``: the whole family is refused, with this reason.
* ``arch``: the architecture row of our own decoder (``models/decoder/rows.py``: the knobs that make
  this ``model_type`` differ from a pre-norm Llama block); ``decoder``: the toolkit builds the family
  with our decoder (``paddlenlp_ext.models.decoder``, registered with PaddleNLP's Auto classes) instead
  of PaddleNLP's classes.  A row with ``arch`` but without ``decoder`` (qwen3_moe in PaddleNLP's layout)
  trains on its own classes (``models/qwen3``); its ``hf_row`` is the decoder's.

The feature sets, refusal builders and ``_decoder_row`` / ``_moe_row`` below are what the table's rows are
written with.

    >>> _decoder_row("phi3", Arch(fused_qkv=True)).supports("tp"), Family("opt", features=_DENSE).supports("tp")
    (True, False)
    >>> FEATURES["qlora"]
    'weight_quantize_algo'
"""

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Tuple

from .decoder.rows import Arch


#: every Linear inside blocks named ``layers.N`` (llama, qwen2, mistral, ..., encoder/decoder.layers.N)
LAYERS_BLOCKS = (r".*layers\.\d+\..*",)
#: GPT-2 style blocks named ``h.N`` (qwen, bloom)
H_BLOCKS = (r".*\.h\.\d+\..*",)

#: the features a config can ask for, and the key that asks (in refusal messages)
FEATURES = {
    "lora": "lora/vera/lokr",
    "qlora": "weight_quantize_algo",
    "full": "lora",  # full fine-tuning = no adapter method
    "packing": "zero_padding",
    "flash_attention": "use_flash_attention",
    "flash_mask": "flash_mask",
    "dpo": "llm/run_dpo.py",
    "kto": "llm/run_kto.py",
    "reward": "llm/run_reward.py",
    "grpo": "llm/run_grpo.py",
    "tp": "tensor_parallel_degree",
    "pp": "pipeline_parallel_degree",
    "merge": "llm/merge_lora_params.py",
    "predict": "llm/predict/predictor.py",
    "hf_checkpoint": "model_name_or_path",
}

#: what llama and qwen2 have run for a long time (tests/test_e2e.py, test_dpo_e2e.py, test_parallel_e2e.py, ...)
_ALL = frozenset(FEATURES)
#: a dense-mask decoder whose forward takes no FlashMask start rows: everything but FlashMask, TP and PP
_DENSE = frozenset({"lora", "qlora", "full", "packing", "merge", "predict"})
#: the alignment CLIs that run on DPO's path (the policy's log-probs of packed rows, the reference by
#: adapters-off or a frozen copy): KTO and GRPO run wherever DPO does
_LOGP_ALIGN = frozenset({"dpo", "kto", "grpo"})
#: ... and preference training, whose pair rows need the packed mask
_DENSE_DPO = _DENSE | _LOGP_ALIGN


@dataclass(frozen=True)
class Family:
    model_type: str
    targets: Tuple[str, ...] = LAYERS_BLOCKS
    shifts_labels: bool = False
    sets_ignore_index: bool = False
    masks: FrozenSet[str] = frozenset({"dense", "position_ids"})
    features: FrozenSet[str] = _DENSE
    pipeline_class: Optional[str] = None
    planner: Optional[str] = None
    qkv_bias: bool = False
    qk_norm: bool = False
    hf_layout: bool = False
    #: PaddleNLP's base_model_prefix: every body tensor is named ``<body>.`` (the model_type unless given)
    body: str = ""
    #: our config key -> the model config attribute that the model really reads (config.parse refuses the others)
    dropout: Dict[str, str] = field(default_factory=dict)
    #: feature -> why it is refused on this family and what to change (else a default message)
    refusals: Dict[str, str] = field(default_factory=dict)
    refused: Optional[str] = None
    arch: Optional[Arch] = None
    decoder: bool = False
    #: the row a transformers-layout checkpoint of this model_type trains on, when it is not this one (qwen3_moe:
    #: PaddleNLP's layout on models/qwen3, transformers' on the decoder's MoE row); :func:`layout_row` picks
    hf_row: Optional["Family"] = None
    #: config.json keys that send a PaddleNLP-layout checkpoint to ``hf_row`` too when set (true / non-empty): what
    #: this row's classes refuse and ``hf_row`` computes (qwen3_moe: a window, RoPE scaling, the aux loss -- what a
    #: merge or a full fine-tune of a transformers checkpoint saves in PaddleNLP's layout)
    hf_row_keys: Tuple[str, ...] = ()

    @property
    def body_prefix(self) -> str:
        return self.body or self.model_type

    def supports(self, feature: str) -> bool:
        return self.refused is None and feature in self.features


def _no_flashmask(name: str, ignores_mask_under_flash: str = "") -> Dict[str, str]:
    """Refusals of a family whose forward takes no FlashMask start rows; ``ignores_mask_under_flash``: the
    measured packing error when its use_flash_attention path drops the dense mask (else that path is run)."""
    out = {
        "flash_mask": (
            f"{name} models do not take FlashMask start rows (PaddleNLP's {name} forward has no "
            "attn_mask_startend_row_indices input); set flash_mask=false (zero padding then passes a "
            "dense 4-D mask)"
        )
    }
    if ignores_mask_under_flash:
        out["flash_attention"] = (
            f"with use_flash_attention=true {name} models ignore the attention mask "
            f"({ignores_mask_under_flash}); set use_flash_attention=false"
        )
    return out


#: the dense families whose use_flash_attention path honours the dense mask (check_packing exact)
_DENSE_DPO_FA = _DENSE | _LOGP_ALIGN | {"flash_attention"}

_OWN_DROPOUT = {
    "hidden_dropout_prob": "hidden_dropout_prob",
    "attention_probs_dropout_prob": "attention_probs_dropout_prob",
}

#: what our decoder runs on a row today (tests/test_decoder_parity.py, tests/test_decoder_cli.py,
#: tests/test_decoder_export.py, tests/test_decoder_align.py)
#: (use_flash_attention: FlashMask start rows run through Paddle's kernel on GPU, ours on CPU; a dense mask
#: takes the dense path, which computes the same attention)
_DECODER = frozenset(
    {
        "lora",
        "qlora",
        "full",
        "packing",
        "flash_attention",
        "flash_mask",
        "hf_checkpoint",
        "predict",
        "merge",
        "dpo",
        "kto",
        "reward",
        "grpo",
    }
)
_DECODER_MASKS = frozenset({"dense", "startend", "position_ids"})


#: a dense decoder row also runs tensor (and sequence) parallel and as pipeline stages (models/decoder/pipe.py;
#: tests/test_decoder_tp.py, tests/test_decoder_pp.py)
_DECODER_DENSE = _DECODER | {"tp", "pp"}


def _decoder_row(
    name: str, arch: Arch, planner: Optional[str] = None, dropout: Optional[Dict[str, str]] = None
) -> "Family":
    """A dense row on our decoder; ``dropout``: the run's dropout keys the decoder honours (``Family.dropout``)."""
    return Family(
        name,
        features=_DECODER_DENSE,
        masks=_DECODER_MASKS,
        hf_layout=True,
        arch=arch,
        decoder=True,
        planner=planner,
        dropout=dict(dropout or {}),
    )


#: MoE rows on the decoder: what their adapters / quantization target by default: attention, every routed
#: expert's Linears (gate/up/down_proj, mixtral's w1/w3/w2), the shared expert and the dense layers' MLP; never
#: the router (``mlp.gate``, mixtral's ``block_sparse_moe.gate``) nor qwen2_moe's ``shared_expert_gate``: their logits pick and weigh the experts
#: (name them in lora_target_modules to adapt them anyway)
_MOE_TARGETS = (
    r".*layers\.\d+\.self_attn\.[qkvo]_proj",
    r".*layers\.\d+\.mlp\.(experts\.\d+\.|shared_expert\.|shared_experts\.)?(gate|up|down)_proj",
    r".*layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]",
)
#: MoE decoder rows run every decoder feature: tests/test_decoder_cli.py, tests/test_moe_cli.py; merge and the
#: transformers / PEFT exports: tests/test_decoder_export.py; DPO, KTO, reward models and GRPO with the policy
#: forward's router aux loss: tests/test_moe_align.py; tensor (and sequence) parallel: tests/test_moe_parallel.py
#: (the router replicated, every expert split like the dense MLP, MLA's heads split); pipeline stages with the
#: aux loss off (the aux loss across stages is refused by config.family_checks.moe_pipeline_problems)
_MOE_DECODER = _DECODER | {"tp", "pp"}


#: DeepSeek's latent attention (decoder/mla.py): every projection of it (q_proj when q_lora_rank is null), the
#: routed and shared experts and the first dense layers' MLP; never the router (mlp.gate)
_MLA_TARGETS = (
    r".*layers\.\d+\.self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)",
    _MOE_TARGETS[1],
)


def _moe_row(name: str, arch: Arch, targets: Tuple[str, ...] = _MOE_TARGETS) -> "Family":
    """An MoE row on our decoder (``Arch.mlp == "moe"``: ``decoder/moe.py`` on the sparse layers)."""
    return Family(
        name, targets=targets, features=_MOE_DECODER, masks=_DECODER_MASKS, hf_layout=True, arch=arch, decoder=True
    )
