"""Build the model of a run: load (streamed, quantized as configured), then adapters or the prefix.

``build_model`` is shared by every mode through the run recipe (``training.recipe``);
``load_model`` also by ``llm/tools/check_packing.py``.  What it built, with the
method and parameter counts the console and run_summary.json report, is a
:class:`BuiltModel`.
"""

import dataclasses
import json
from typing import Any, Dict, Optional

from ..config.parse import ConfigError, RunConfig
from ..models.dropout import DROPOUT_KEYS, dropout_config_updates
from ..models.family_table import FAMILIES, layout_row, row


def model_dtype(args) -> str:
    # As PaddleNLP's run_finetune: low-precision weights only with O2; O1 keeps fp32 weights + autocast.
    if args.fp16_opt_level == "O2":
        if args.fp16:
            return "float16"
        if args.bf16:
            return "bfloat16"
    return "float32"


def load_model(cfg: RunConfig, args, quantization: Optional[Dict[str, Any]] = None):
    """(model, quantization stats or None).

    A pretrained model is streamed tensor by tensor (``models.loading``): the
    targeted Linear weights are quantized as they arrive and every other
    tensor is materialized once, in the run's dtype, so neither the fp32
    model (QLoRA) nor two copies (bf16/fp16 O2) ever exist whole.  A shape,
    file or block-size problem is a ConfigError naming the tensor/file (exit 2).
    """
    from paddlenlp.transformers import AutoModelForCausalLM
    from paddlenlp.utils.log import logger

    from ..models.registration import register_decoder, register_qwen3
    from ..models.checkpoint import CheckpointError
    from ..models.model_config import load_model_config

    register_qwen3()  # our model families (Qwen3) known to PaddleNLP's Auto classes
    register_decoder()  # ... and our decoder's rows (models/family_table.py, Family.decoder)
    m, d = cfg.model, cfg.data
    dtype = model_dtype(args)
    config = load_model_config(  # config.json of either transformers spelling (models/hf_config_read.py)
        m.model_name_or_path,
        dtype=dtype,
        tensor_parallel_degree=args.tensor_parallel_degree,
        tensor_parallel_rank=args.tensor_parallel_rank,
        tensor_parallel_output=bool(args.tensor_parallel_output),
    )
    config.use_flash_attention = m.use_flash_attention
    config.recompute = args.recompute
    from .llm_meta import apply_llm_meta, llm_meta_notices, on_gpu
    from .console import current

    gpu = on_gpu()
    apply_llm_meta(cfg, config, on_gpu=gpu)
    for notice in llm_meta_notices(cfg, on_gpu=gpu):  # a key set but not applied is said on the console
        current().line(notice)
    config.seq_length = cfg.alignment.max_seq_len if cfg.alignment is not None else d.max_length
    # only dropout the family really reads (config.parse refused the others)
    dropout = {k: getattr(m, k) for k in DROPOUT_KEYS}
    for attr, value in dropout_config_updates(getattr(config, "model_type", None), dropout).items():
        setattr(config, attr, value)
    # the row this checkpoint trains on: a transformers-layout qwen3_moe on the decoder's MoE row, PaddleNLP's on
    # models/qwen3 (family_table.layout_row)
    from ..config.family_checks import is_hf_layout

    hf = bool(m.continue_training) and is_hf_layout(m.model_name_or_path)
    family = layout_row(getattr(config, "model_type", None), hf, config)
    hf = family is not row(getattr(config, "model_type", None))  # on the family's hf_row (the decoder's)
    if args.tensor_parallel_degree > 1:
        # the model reads sequence_parallel from its config (our decoder: parallel/layers.py; PaddleNLP's llama /
        # qwen2 and our qwen3 likewise), so the run's key goes there, as PaddleNLP's run_finetune does
        # (LlmMetaConfig.set_llm_config); left at the config's default, sequence_parallel=true ran plain TP
        config.sequence_parallel = bool(getattr(args, "sequence_parallel", False))
    from .moe_aux import configure as configure_moe, moe_row

    if moe_row(getattr(config, "model_type", None), hf):  # router_aux_loss_coef -> output_router_logits (docs/moe.md)
        configure_moe(config, m)
    if family is not None and family.sets_ignore_index:
        from .loss import IGNORE_INDEX

        # as PaddleNLP's run_finetune: the criterion must skip the -100 label padding we write (GPT's default is 0)
        config.ignore_index = IGNORE_INDEX
    for key in ("fuse_attention_qkv", "fuse_attention_ffn"):
        if getattr(m, key) is not None:
            setattr(config, key, getattr(m, key))
    where = f"{cfg.source or 'config'}: model_name_or_path {m.model_name_or_path!r}"
    if getattr(config, "model_type", None) in ("qwen3", "qwen3_moe") and not family.decoder:  # before any weight
        from ..models.qwen3.support import unsupported_settings

        refused = unsupported_settings(config)
        if refused:
            raise ConfigError([f"{where}: model_type {config.model_type} does not support {p}" for p in refused])
    fused = any(getattr(m, k) for k in ("fuse_attention_qkv", "fuse_attention_ffn"))
    on_decoder = family is not None and family.decoder  # our decoder: the streaming loader cuts TP shards itself
    tp_paddlenlp = args.tensor_parallel_degree > 1 and not on_decoder
    if m.continue_training and (((args.pipeline_parallel_degree > 1 or tp_paddlenlp) and not on_decoder) or fused):
        refuse_hf_layout(m.model_name_or_path, where)  # PaddleNLP's own loaders below read only its layout
    if args.pipeline_parallel_degree > 1:  # this rank's stage of the pipeline model
        return load_pipeline_stage(m, config, dtype, args, where), None
    # PaddleNLP's own loader stays for what streaming does not take: PaddleNLP models' tensor-parallel shards
    # and fusing q/k/v or gate/up of an unfused checkpoint at load time.
    if m.continue_training and (tp_paddlenlp or fused):
        model = AutoModelForCausalLM.from_pretrained(m.model_name_or_path, config=config, dtype=dtype)
    elif m.continue_training and args.tensor_parallel_degree > 1:  # our decoder: each rank streams its shards
        from ..models.loading import load_model_streaming

        try:
            model, _ = load_model_streaming(
                m.model_name_or_path, config, dtype, logger=logger, max_seq_len=config.seq_length
            )
        except (CheckpointError, ValueError) as e:
            raise ConfigError([f"{where}: {e}"], before_load=False) from e
    elif m.continue_training:
        from ..models.loading import load_model_streaming

        try:
            return load_model_streaming(
                m.model_name_or_path,
                config,
                dtype,
                quantization=quantization,
                logger=logger,
                max_seq_len=config.seq_length,
            )
        except (CheckpointError, ValueError) as e:  # names the tensor / file / layer and what to do
            raise ConfigError([f"{where}: {e}"], before_load=False) from e
    else:  # random init (continue_training=false); decoder rows PaddleNLP also names (mixtral) get our class
        from ..models.loading import decoder_class_for

        model_class, config = decoder_class_for(config)
        model = (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype)
    if not quantization:
        return model, None
    from ..models.quantize import quantize_model

    try:
        stats = quantize_model(
            model,
            quantization["weight_quantize_algo"],
            block_size=quantization["weight_blocksize"],
            double_quant=quantization["weight_double_quant"],
            double_quant_block_size=quantization["weight_double_quant_block_size"],
        )
    except ValueError as e:  # a layer shape the format cannot take: the message says what to do
        raise ConfigError(
            [f"{where}: weight_quantize_algo={quantization['weight_quantize_algo']}: {e}"], before_load=False
        ) from e
    return model, stats


def refuse_hf_layout(model_dir: str, where: str) -> None:
    """ConfigError (exit 2) when ``model_dir`` holds a transformers-layout checkpoint: tensor/pipeline
    parallel and load-time q/k/v fusion load through PaddleNLP's from_pretrained, which reads only its own
    layout (it would leave every weight at its random init)."""
    from ..models.checkpoint import CheckpointError, find_checkpoint

    try:
        hf = find_checkpoint(model_dir).hf_model_type
    except CheckpointError as e:
        raise ConfigError([f"{where}: {e}"]) from e
    if hf is not None:
        raise ConfigError(
            [
                f"{where} is a Hugging Face transformers-layout checkpoint, which only the streaming "
                "loader converts; tensor_parallel_degree / pipeline_parallel_degree > 1 and "
                "fuse_attention_qkv / fuse_attention_ffn load with PaddleNLP's own loader. Run "
                "single-device without fuse_* keys, or save the model once in PaddleNLP's layout"
            ]
        )


#: model_type -> PaddleNLP pipeline class name (paddlenlp.transformers), for the families whose pipeline
#: path the table marks verified (models/family_table.py)
PIPELINE_CLASSES = {k: f.pipeline_class for k, f in FAMILIES.items() if f.supports("pp") and f.pipeline_class}


def decoder_pipeline_row(model_type: Optional[str]) -> bool:
    """A row our decoder builds as pipeline stages (``models/decoder/pipe.py``)."""
    f = row(model_type)
    f = (f.hf_row or f) if f is not None else None  # qwen3_moe: the decoder's row (config time refuses models/qwen3)
    return f is not None and f.decoder and f.supports("pp")


def pipeline_layout_problem(model_type: Optional[str], num_layers: int, pp: int, vpp: int) -> Optional[str]:
    """Why a model cannot be cut into ``pp`` x ``vpp`` pipeline chunks, or None.

    >>> pipeline_layout_problem("llama", 32, 4, 2) is None
    True
    >>> pipeline_layout_problem("llama", 30, 4, 2)
    'num_hidden_layers=30 is not a multiple of pipeline_parallel_degree x virtual_pp_degree = 8 (Paddle cuts the interleaved chunks by whole decoder layers)'
    """
    if model_type not in PIPELINE_CLASSES and not decoder_pipeline_row(model_type):
        known = sorted(set(PIPELINE_CLASSES) | {k for k in FAMILIES if decoder_pipeline_row(k)})
        return f"model_type {model_type!r} has no pipeline model here; pipeline_parallel_degree > 1 supports {known}"
    if num_layers < pp * vpp:
        return f"num_hidden_layers={num_layers} is fewer than pipeline_parallel_degree x virtual_pp_degree = {pp * vpp}"
    if vpp > 1 and num_layers % (pp * vpp):
        return (
            f"num_hidden_layers={num_layers} is not a multiple of pipeline_parallel_degree x virtual_pp_degree = "
            f"{pp * vpp} (Paddle cuts the interleaved chunks by whole decoder layers)"
        )
    return None


def load_pipeline_stage(m, config, dtype: str, args, where: str):
    """This rank's stage of PaddleNLP's pipeline model (its own layers' weights only)."""
    import paddlenlp.transformers as transformers

    vpp = int(getattr(config, "virtual_pp_degree", 1) or 1)
    problem = pipeline_layout_problem(
        getattr(config, "model_type", None), int(config.num_hidden_layers), args.pipeline_parallel_degree, vpp
    )
    if problem:
        raise ConfigError([f"{where}: {problem}"], before_load=False)
    if decoder_pipeline_row(config.model_type):  # our decoder's stages: streamed, either checkpoint layout
        from ..models.checkpoint import CheckpointError
        from ..models.decoder.pipe import pipe_class_for
        from ..models.loading import decoder_class_for, load_model_streaming

        cls = pipe_class_for(config.model_type)
        config = decoder_class_for(config)[1]  # as the row's config class
        if not m.continue_training:
            return cls.from_config(config, dtype=dtype)
        try:
            return load_model_streaming(
                m.model_name_or_path, config, dtype, max_seq_len=config.seq_length, model_class=cls
            )[0]
        except (CheckpointError, ValueError) as e:
            raise ConfigError([f"{where}: {e}"], before_load=False) from e
    cls = getattr(transformers, PIPELINE_CLASSES[config.model_type])
    if m.continue_training:
        return cls.from_pretrained(m.model_name_or_path, config=config, dtype=dtype)
    return cls.from_config(config, dtype=dtype)


def prepare_pipeline_stage(model, args) -> Optional[Dict[str, str]]:
    """For a pipeline stage: install the pipeline inputs and loss, attach the pipeline group, and return
    the plain names of its layers (for the adapters); None for any other model."""
    from ..integrations.paddlenlp_pipe import is_pipeline_model

    if not is_pipeline_model(model):
        return None
    from ..adapters.pp_stage import attach_pipeline_group, prepare_stage_for_adapters
    from ..parallel.pipeline_group import FleetPipelineGroup
    from .pp_step import install_pipeline_training

    install_pipeline_training(model, args.dataset_world_size, args.gradient_accumulation_steps)
    attach_pipeline_group(model, FleetPipelineGroup())
    return prepare_stage_for_adapters(model)


def resolve_quantization(cfg: RunConfig) -> Optional[Dict[str, Any]]:
    """The config's quantization, or (with lora_path) the one the adapter was trained on."""
    quant = quantization_dict(cfg)
    if quant is None and cfg.model.lora_path:
        from ..adapters import AdapterConfig
        from .console import current

        # An adapter trained on a quantized base is evaluated/continued on the same quantized base.
        quant = AdapterConfig.load(cfg.model.lora_path).quantization
        if quant:
            current().line(f"derived setting: base quantized as in {cfg.model.lora_path}: {json.dumps(quant)}")
    return quant


@dataclasses.dataclass
class BuiltModel:
    """What :func:`build_model` made: the model ready for the trainer and its facts for the summary."""

    model: Any
    adapter_config: Any
    quantization: Optional[Dict[str, Any]]
    load_stats: Optional[Dict[str, Any]]
    prefix_io: Any
    prefix_info: Optional[Dict[str, Any]]
    method: str
    trainable: int
    total: int
    rss_before_model: int
    rss_after_load: int

    def summary(self) -> Dict[str, Any]:
        out = {
            "rss_before_model_bytes": self.rss_before_model,
            "rss_after_load_bytes": self.rss_after_load,
            "method": self.method,
            "trainable_params": self.trainable,
            "total_params": self.total,
        }
        if self.load_stats is not None:
            out["quantization" if self.quantization else "load"] = self.load_stats
        if self.prefix_info is not None:
            out["prefix"] = self.prefix_info
        return out


def build_model(cfg: RunConfig, args) -> BuiltModel:
    """Load (streamed; quantized as configured), then apply adapters (new, or lora_path) or the
    prefix; logs the method and trainable parameters.  Shared by run_finetune and run_dpo."""
    from paddlenlp.trainer import set_seed
    from paddlenlp.utils.log import logger

    from .callbacks import current_rss_bytes

    rss_before_model = current_rss_bytes()
    quantization = resolve_quantization(cfg)
    model, load_stats = load_model(cfg, args, quantization)
    if load_stats is not None and load_stats.get("params_quantized"):
        load_stats["bytes_per_param"] = load_stats["bytes_quantized"] / load_stats["params_quantized"]
    if load_stats is not None:
        logger.info(f"{'quantized base weights' if quantization else 'loaded'}: {json.dumps(load_stats, default=str)}")

    adapter_config = None
    layer_names = prepare_pipeline_stage(model, args)  # None unless pipeline parallel
    if cfg.model.lora_path or cfg.adapter_method or cfg.model.neftune:
        from .. import adapters as adapter_api
    if cfg.model.lora_path:
        # continue training (or evaluate) a saved adapter; its own config wins
        adapter_config = adapter_api.load_adapter(model, cfg.model.lora_path, layer_names=layer_names)
    elif cfg.adapter_method:
        adapter_config = adapter_config_from_run(cfg, getattr(model.config, "model_type", None))
        # adapter init depends on the seed only, not on how many random numbers the load path drew
        # (the streaming loader draws none; from_pretrained's random init did)
        set_seed(args.seed)
        adapter_api.apply_adapters(model, adapter_config, layer_names=layer_names)
    if getattr(cfg.model, "freeze_router", False):  # MoE rows: the routers keep their weights (docs/moe.md)
        from .moe_aux import freeze_routers

        logger.info(f"freeze_router: {freeze_routers(model)} router parameters frozen")
    prefix_io = prefix_info = None
    if cfg.model.prefix_tuning:  # the frozen model behind trained key/value prefixes (paddlenlp_ext.prefix)
        from ..prefix.io import attach_prefix

        set_seed(args.seed)
        model, prefix_io, prefix_info = attach_prefix(model, cfg.model, model_dtype(args))
    from ..adapters import count_parameters

    trainable, total = count_parameters(model)
    method = describe_method(cfg, adapter_config)
    logger.info(f"method: {method}; trainable parameters {trainable:,} of {total:,} ({100.0 * trainable / total:.4f}%)")
    return BuiltModel(
        model,
        adapter_config,
        quantization,
        load_stats,
        prefix_io,
        prefix_info,
        method,
        trainable,
        total,
        rss_before_model,
        current_rss_bytes(),
    )


def adapter_config_from_run(cfg: RunConfig, model_type: Optional[str] = None):
    from ..adapters.config import adapter_config_from_args

    return adapter_config_from_args(
        {**dataclasses.asdict(cfg.model), "quantization": quantization_dict(cfg), "model_type": model_type}
    )


def quantization_dict(cfg: RunConfig) -> Optional[Dict[str, Any]]:
    m = cfg.model
    if not m.weight_quantize_algo:
        return None
    return {
        "weight_quantize_algo": m.weight_quantize_algo,
        "weight_blocksize": m.weight_blocksize,
        "weight_double_quant": m.weight_double_quant,
        "weight_double_quant_block_size": m.weight_double_quant_block_size,
    }


def describe_method(cfg: RunConfig, adapter_config=None) -> str:
    """'full', 'lora', 'lora+rslora+pissa', 'vera', with '+neftune' / '+nf4' suffixes.

    Describes what runs: the adapter's own config when one was built or loaded
    (``lora_path``), else full fine-tuning."""
    m = cfg.model
    a = adapter_config
    parts = [a.method if a is not None else ("prefix_tuning" if m.prefix_tuning else "full")]
    if m.prefix_tuning and m.prefix_projection:
        parts.append("prefix_projection")
    if a is not None and a.method == "lora":
        parts += [k for k in ("rslora", "pissa") if getattr(a, k)]
        if a.lora_plus_scale != 1.0:
            parts.append(f"lora_plus_scale={a.lora_plus_scale:g}")
    if m.neftune:
        parts.append("neftune")
    quant = (a.quantization if a is not None else None) or quantization_dict(cfg)
    if quant:
        parts.append(quant["weight_quantize_algo"])
    return "+".join(parts)
