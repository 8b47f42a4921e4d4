"""Typed argument groups of ``run_finetune.py`` (no paddle import here).

Keys keep the names, meanings and defaults of PaddleNLP's fine-tuning docs
(``paddlenlp/trl/model_config.py``, ``sftdata_config.py``), so existing
configs work.  Field metadata drives validation and docs (``keys.py`` says
what each entry means).  The key groups of the alignment CLIs (DPO, KTO,
reward, GRPO, PPO) are in ``alignment_schema.py``; this module re-exports them,
so ``from paddlenlp_ext.config.schema import DPOArgument`` keeps working.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

from .alignment_schema import (  # noqa: F401  (re-exported: the alignment key groups)
    DPO_LOSS_TYPES,
    GRPO_LOSS_TYPES,
    ROLLOUT_ENGINE_DEFAULT,
    ROLLOUT_ENGINE_HELP,
    ROLLOUT_ENGINES,
    DPOArgument,
    GRPOArgument,
    KTOArgument,
    PPOArgument,
    RewardArgument,
)
from .keys import key as _f
from .keys import unsupported_key as _unsupported

QUANT_ALGOS = ("weight_only_int8", "weight_only_int4", "nf4", "fp4")


@dataclass
class ModelArgument:
    model_name_or_path: Optional[str] = _f(
        None, "Local model directory (config.json + weights + tokenizer files).", required=True
    )
    tokenizer_name_or_path: Optional[str] = _f(None, "Tokenizer directory if different from model_name_or_path.")
    continue_training: bool = _f(
        True, "Load the pretrained weights (true) or train from a random init of the model config (false)."
    )
    use_flash_attention: bool = _f(
        False, "Use flash attention (Paddle's kernel on GPU; our block-sparse kernel on CPU)."
    )
    flash_mask: bool = _f(
        False, "Describe attention masks with FlashMask start-row indices (needs use_flash_attention)."
    )
    fuse_attention_qkv: Optional[bool] = _f(None, "Override the model config's fuse_attention_qkv.")
    fuse_attention_ffn: Optional[bool] = _f(None, "Override the model config's fuse_attention_ffn.")
    hidden_dropout_prob: Optional[float] = _f(
        None,
        "Hidden-state dropout; unset = the model's own. A value the model family does not read "
        "(Llama and Qwen2 have no hidden dropout) is a config error, not a silent no-op.",
        min=0.0,
    )
    attention_probs_dropout_prob: Optional[float] = _f(
        None,
        "Attention dropout; unset = the model's own. Qwen2: sets attention_dropout (not with "
        "use_flash_attention, whose kernel path ignores it); Llama has none (config error).",
        min=0.0,
    )
    # quantized base weights (QLoRA)
    weight_quantize_algo: Optional[str] = _f(
        None,
        "Quantize the frozen base linear weights: weight_only_int8, weight_only_int4, nf4 or fp4.",
        choices=QUANT_ALGOS,
    )
    weight_blocksize: int = _f(64, "Block size of nf4/fp4 absmax quantization.", gt=0)
    weight_double_quant: bool = _f(False, "Quantize the nf4/fp4 block scales again (double quantization).")
    weight_double_quant_block_size: int = _f(256, "Block size of the double quantization of the scales.", gt=0)
    # LoRA family
    lora: bool = _f(False, "Train LoRA adapters instead of all weights.")
    lora_path: Optional[str] = _f(
        None,
        "Directory of a saved adapter to start from (or to evaluate): ours (adapter_config.json) or "
        "PaddleNLP's LoRA format (lora_config.json + lora_model_state.pdparams / peft_model*.safetensors).",
    )
    lora_rank: int = _f(8, "LoRA rank r.", gt=0)
    lora_alpha: int = _f(-1, "LoRA alpha; -1 means 2 x lora_rank.")
    lora_dropout: float = _f(0.0, "Dropout on the LoRA branch input.", min=0.0)
    lora_target_modules: Optional[List[str]] = _f(
        None, "Regexes (full match) of the Linear layers to adapt; default every Linear of the decoder layers."
    )
    target_modules: Optional[List[str]] = _f(None, "Alias of lora_target_modules (used by LoRA and VeRA).")
    rslora: bool = _f(False, "rsLoRA: scale by alpha/sqrt(r) instead of alpha/r.")
    lora_plus_scale: float = _f(1.0, "LoRA+: B matrices learn at learning_rate x lora_plus_scale.", gt=0.0)
    pissa: bool = _f(False, "PiSSA: initialise A,B from the top-r singular triplets of W; W keeps the residual.")
    pissa_niter: int = _f(0, "PiSSA SVD: 0 = exact; >0 = randomized SVD with this many power iterations.", min=0)
    vera: bool = _f(False, "VeRA: shared frozen random projections, trained per-layer scaling vectors.")
    vera_rank: int = _f(8, "VeRA rank r of the shared projections.", gt=0)
    vera_seed: int = _f(0, "Seed that generates VeRA's shared projections.", min=0)
    vera_d_init: float = _f(0.1, "Initial value of VeRA's per-layer d vector (b starts at 0).", gt=0.0)
    neftune: bool = _f(False, "NEFTune: add uniform noise to input embeddings during training.")
    neftune_noise_alpha: float = _f(5.0, "NEFTune alpha: noise scale alpha/sqrt(L*d).", min=0.0)
    # mixture-of-experts rows (docs/moe.md)
    router_aux_loss_coef: Optional[float] = _f(
        None,
        "MoE rows: weight of the router's load-balancing loss added to the training loss (transformers' "
        "load_balancing_loss_func; in DPO/KTO/reward/GRPO/PPO the policy forward's, never the reference's); unset = the checkpoint's router_aux_loss_coef when its output_router_logits "
        "is true, else 0 (no aux loss).",
        min=0.0,
    )
    moe_aux_loss_coef: Optional[float] = _f(None, "Alias of router_aux_loss_coef (LLaMA-Factory's name).", min=0.0)
    moe_router_bias_update_rate: Optional[float] = _f(
        None,
        "MoE rows whose router has an e_score_correction_bias (ernie4_5_moe, deepseek_v3): DeepSeek-V3's "
        "auxiliary-loss-free balancing, bias += rate * sign(mean load - load) after each optimizer step "
        "(DeepSeek-V3 used 0.001); full fine-tuning only (an adapter does not save the bias).",
        min=0.0,
    )
    freeze_router: bool = _f(
        False,
        "MoE rows: the router (gate) weights get no gradient in full fine-tuning "
        "(the experts still train); with LoRA the router is never a default target.",
    )
    # accepted for compatibility with PaddleNLP configs, not built
    use_fast_layer_norm: bool = _unsupported(False, "GPT-3 fast layer norm.")
    use_quick_lora: bool = _unsupported(False, "PaddleNLP quick LoRA kernel.")
    lora_use_mixer: bool = _unsupported(False, "MosLoRA.")
    use_mora: bool = _unsupported(False, "MoRA.")
    lokr: bool = _f(False, "LoKr: the weight update is a Kronecker product W1 (x) (B @ A) (Edalati et al. / LyCORIS).")
    lokr_path: Optional[str] = _f(None, "Directory of a saved LoKr adapter to start from (or to evaluate).")
    lokr_dim: int = _f(8, "LoKr rank of the low-rank factor B @ A of the Kronecker product.", gt=0)
    lokr_alpha: float = _f(0.0, "LoKr scaling alpha / lokr_dim; 0 means scaling 1.0 (PaddleNLP's LoKrConfig).", min=0.0)
    lokr_factor: int = _f(-1, "LoKr factor of the in/out dimensions for W1; -1 picks the most balanced factors.")
    lokr_decompose_both: bool = _f(False, "LoKr: also write the small Kronecker factor W1 as a low-rank product.")
    prefix_tuning: bool = _f(False, "Prefix tuning: trained key/value prefixes at every layer; the model is frozen.")
    prefix_path: Optional[str] = _f(
        None, "Directory of a saved prefix (PaddleNLP format) to start from (or to evaluate)."
    )
    num_prefix_tokens: int = _f(128, "Prefix tuning: number of virtual prefix tokens.", gt=0)
    prefix_projection: bool = _f(False, "Prefix tuning: produce the prefixes with a 2-layer MLP (reparameterisation).")
    prefix_projection_hidden_size: Optional[int] = _f(
        None, "Prefix tuning: hidden size of the projection MLP; unset = the model's hidden_size.", gt=0
    )
    prefix_dropout: float = _f(0.0, "Prefix tuning: dropout on the prefix key/values.", min=0.0)
    reft: bool = _unsupported(False, "ReFT.")
    from_aistudio: bool = _unsupported(
        False, "Load from AI Studio.", "not supported: models are loaded from local directories"
    )
    save_to_aistudio: bool = _unsupported(False, "Upload to AI Studio.", "not supported: results are saved locally")
    aistudio_repo_id: Optional[str] = _unsupported(None, "AI Studio repo id.", "not supported")
    aistudio_repo_private: bool = _unsupported(True, "AI Studio repo privacy.", "not supported")
    aistudio_repo_license: str = _unsupported("Apache License 2.0", "AI Studio repo license.", "not supported")
    aistudio_token: Optional[str] = _unsupported(None, "AI Studio token.", "not supported")
    use_long_sequence_strategies: bool = _unsupported(False, "Long-sequence RoPE strategies.")
    rope_scaling_factor: float = _unsupported(1.0, "RoPE scaling factor.")
    strategy_type: Optional[str] = _unsupported(None, "Long-sequence strategy type.")
    strategy_name: Optional[str] = _unsupported(None, "Long-sequence strategy name.")


@dataclass
class DataArgument:
    dataset_name_or_path: Optional[str] = _f(
        None,
        "Directory with train.json/dev.json (or .jsonl/.parquet/.txt) or train/*, dev/*; or one data file "
        "(the train split); several sources separated by commas mix (mix_strategy). Formats: docs/data.md.",
    )
    dataset_dir: Optional[str] = _f(
        None,
        "Directory of a LLaMA-Factory dataset_info.json: dataset_name_or_path (and DPO / reward models' "
        "train_dataset_path, dev_dataset_path) may then name its entries (local files; docs/data.md).",
    )
    dataset_weights: Optional[List[float]] = _f(
        None,
        "Proportions of the sources when dataset_name_or_path lists several (comma-separated), e.g. [0.7, 0.3]; "
        "needs mix_strategy interleave_under or interleave_over.",
    )
    mix_strategy: str = _f(
        "concat",
        "How several sources are combined: concat, interleave_under (draw by dataset_weights until the "
        "first source runs out) or interleave_over (until every source is used whole, oversampling).",
        choices=("concat", "interleave_under", "interleave_over"),
    )
    dataset_format: str = _f(
        "auto",
        "Record format of the data files: auto (detected per file from its records), paddlenlp (src/tgt), "
        "alpaca, sharegpt, messages (OpenAI) or text.",
        choices=("auto", "paddlenlp", "alpaca", "sharegpt", "messages", "text"),
    )
    dataset_columns: Optional[Dict[str, str]] = _f(
        None,
        'Renamed fields, as LLaMA-Factory\'s dataset_info.json columns/tags: e.g. {"prompt": "question", '
        '"response": "answer", "user_tag": "user"} (docs/data.md lists the names).',
    )
    train_on_prompt: bool = _f(
        False, "Supervise the prompt tokens too (everything but tool results); default: assistant turns only."
    )
    src_length: int = _f(1024, "Maximum source (prompt) tokens; longer prompts are truncated.", gt=0)
    max_length: int = _f(2048, "Maximum tokens of an example (prompt + target); also the packed row length.", gt=1)
    zero_padding: bool = _f(False, "Pack examples into rows of max_length instead of padding each batch.")
    greedy_zero_padding: bool = _f(False, "Pack with grouped best-fit-decreasing (needs zero_padding).")
    greedy_group_size: int = _f(
        2048, "Examples per best-fit-decreasing group (greedy_zero_padding); with lazy, also the streaming group.", gt=0
    )
    pad_to_multiple_of: Optional[int] = _f(None, "Pad batch length to a multiple of this.", gt=0)
    pad_to_max_length: bool = _f(False, "Pad every batch to max_length.")
    lazy: bool = _f(False, "Stream the train set (bounded memory; resumable without replay); needs max_steps > 0.")
    chat_template: Optional[str] = _f(
        None, "Chat template file (jinja or PaddleNLP chat_template.json); default: the tokenizer's own."
    )
    eval_with_do_generation: bool = _f(
        False, "After eval loss, generate each dev answer and report exact match, BLEU-4 and ROUGE-L."
    )
    save_generation_output: bool = _f(
        False, "Write the generated dev answers to output_dir/generated_predictions.json."
    )
    intokens: Optional[bool] = _f(
        None, "Deprecated PaddleNLP name of zero_padding (older configs); sets zero_padding, with a notice."
    )
    task_name: Optional[str] = _unsupported(
        None, "Sub-task of a hub dataset.", "not supported: datasets are local directories"
    )
    autoregressive: bool = _f(
        False,
        'Continued pretraining on raw text (.txt lines or {"text"} records): every token supervised, long '
        "documents split into max_length rows.",
    )
    use_pose_convert: bool = _unsupported(False, "PoSE data conversion.")


@dataclass
class GenerateArgument:
    top_k: int = _f(
        1, "Top-k for eval_with_do_generation; 1 (with top_p 1.0) is greedy decoding, 0 = no top-k filter.", min=0
    )
    top_p: float = _f(1.0, "Top-p (nucleus) for eval_with_do_generation; < 1.0 samples.", gt=0.0)


# Training keys of ours, added to PaddleNLP's TrainingArguments by
# paddlenlp_ext.training.training_args.TrainingArguments.
@dataclass
class ExtraTrainingArgument:
    eval_before_train: bool = _f(False, "Evaluate the untrained model first (reported as eval_loss_before_train).")
    benchmark: bool = _f(
        False,
        "PaddleNLP benchmark mode: train only (do_eval, saving and load_best_model_at_end off); "
        "each change is logged as a derived setting.",
    )
    autotuner_benchmark: bool = _f(False, "PaddleNLP auto-tuner benchmark: benchmark mode plus max_steps 5.")
    decay_steps: Optional[int] = _f(None, "Steps of the LR decay (polynomial schedule); default max_steps.", gt=0)
    tensor_parallel_output: Optional[bool] = _f(False, "Keep lm_head logits split under tensor parallel.")
    log_level: str = _f(
        "warning",
        "Console verbosity (PaddleNLP's level names): warning = warnings, progress and "
        "summary; info adds PaddleNLP's INFO messages; debug adds the argument dump. train.log always "
        "has everything (docs/logging.md).",
        choices=("debug", "info", "warning", "error", "critical"),
    )
    # PaddleNLP's "llm meta" keys (LlmMetaConfig), copied into the model config as PaddleNLP's run_finetune does.
    recompute_granularity: str = _f(
        "full",
        "With recompute: what is recomputed in backward (full layer, full_attn or core_attn).",
        choices=("full", "full_attn", "core_attn"),
        llm_meta="model_config",
    )
    recompute_use_reentrant: bool = _f(
        False, "With recompute: Paddle's reentrant recompute (true) or the non-reentrant one.", llm_meta="model_config"
    )
    no_recompute_layers: Optional[List[int]] = _f(
        None,
        "With recompute: indices of decoder layers that are not recomputed (JSON list of ints).",
        llm_meta="model_config",
    )
    use_fused_rms_norm: bool = _f(
        False,
        "Fused RMSNorm kernel (GPU): same results, faster; on CPU a notice says it is not used.",
        llm_meta="gpu_fusion",
    )
    use_fused_rope: bool = _f(
        False,
        "Fused rotary-embedding kernel (GPU): same results, faster; on CPU a notice says it is not used.",
        llm_meta="gpu_fusion",
    )
    use_fused_linear_cross_entropy: bool = _f(
        False,
        "Fused lm_head + cross-entropy kernel (GPU): same loss, less memory; on CPU a notice says it is not used.",
        llm_meta="gpu_fusion",
    )
    use_fused_linear: bool = _f(
        False,
        "GPT-3 fused linear (PaddleNLP's GPT only): Llama and Qwen2 do not read it; a notice says so.",
        llm_meta="gpt_only",
    )
    use_fused_dropout_add: bool = _f(
        False,
        "GPT-3 fused dropout + add (PaddleNLP's GPT only): Llama and Qwen2 do not read it; a notice says so.",
        llm_meta="gpt_only",
    )
    virtual_pp_degree: int = _f(
        1,
        "Virtual pipeline stages (model chunks) per pipeline rank: Paddle's interleaved schedule (needs "
        "pipeline_parallel_degree > 2 and gradient_accumulation_steps >= 2 x pipeline_parallel_degree).",
        min=1,
        llm_meta="model_config",
    )
    pp_recompute_interval: int = _unsupported(
        1,
        "Recompute interval of pipeline stages.",
        "not read by PaddleNLP's Llama/Qwen2 pipeline models (they recompute per decoder layer: set recompute=true)",
    )
    offload_recompute_inputs: bool = _unsupported(
        False, "Offload recompute inputs to host memory.", "not read by PaddleNLP's Llama/Qwen2 models"
    )
    tensor_parallel_rank: int = _unsupported(
        0, "This process's tensor-parallel rank.", "set by paddle.distributed.launch, not by the config"
    )


GROUPS = {"model": ModelArgument, "data": DataArgument, "generate": GenerateArgument}
