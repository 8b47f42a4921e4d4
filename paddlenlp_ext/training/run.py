"""Build everything from a validated RunConfig, then train / evaluate.

Order: training args -> tokenizer -> data (validated, tokenized, packed)
-> model -> quantization -> adapters -> trainer.  Data is read before the
model so that a malformed line fails in seconds, not after a model load.
"""

import contextlib
import dataclasses
import json
import math
import os
import resource
import sys
import time
from typing import Any, Dict, Optional

from ..config.parse import ConfigError, RunConfig
from ..models.families import DROPOUT_KEYS, dropout_config_updates

RESOLVED_CONFIG_NAME = "resolved_config.json"
RUN_SUMMARY_NAME = "run_summary.json"


def build_training_args(cfg: RunConfig):
    import paddle

    from ..integrations.training_args import make_training_arguments

    where = cfg.source or "config"
    on_gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if cfg.training.get("fp16") and not on_gpu:
        raise ConfigError([f"{where}: fp16=true needs a GPU (Paddle's CPU build has no fp16 kernels); "
                           "use bf16 (O1) or fp32 on CPU"])
    try:
        return make_training_arguments(cfg.training)
    except (ValueError, TypeError, AssertionError) as e:  # PaddleNLP's own checks
        raise ConfigError([f"{where}: training arguments: {e}"])


def write_resolved_config(cfg: RunConfig, output_dir: str) -> str:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, RESOLVED_CONFIG_NAME)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(), f, indent=2, default=str)
    return path


def model_dtype(args) -> str:
    # As PaddleNLP's run_finetune: low-precision weights only with O2; O1 keeps fp32 weights + autocast.
    if args.fp16_opt_level == "O2":
        if args.fp16:
            return "float16"
        if args.bf16:
            return "bfloat16"
    return "float32"


def load_tokenizer(cfg: RunConfig):
    from paddlenlp.transformers import AutoTokenizer

    path = cfg.model.tokenizer_name_or_path or cfg.model.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        # Padding positions never carry loss or attention from real tokens; any id works.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def load_model(cfg: RunConfig, args, quantization: Optional[Dict[str, Any]] = None):
    """(model, quantization stats or None).

    A pretrained model is streamed tensor by tensor (``models.loading``): the
    targeted Linear weights are quantized as they arrive and every other
    tensor is materialized once, in the run's dtype, so neither the fp32
    model (QLoRA) nor two copies (bf16/fp16 O2) ever exist whole.  A shape,
    file or block-size problem is a ConfigError naming the tensor/file (exit 2).
    """
    from paddlenlp.transformers import AutoConfig, AutoModelForCausalLM
    from paddlenlp.utils.log import logger

    from ..models.checkpoint import CheckpointError

    m, d = cfg.model, cfg.data
    dtype = model_dtype(args)
    config = AutoConfig.from_pretrained(
        m.model_name_or_path,
        dtype=dtype,
        tensor_parallel_degree=args.tensor_parallel_degree,
        tensor_parallel_rank=args.tensor_parallel_rank,
        tensor_parallel_output=bool(args.tensor_parallel_output),
    )
    config.use_flash_attention = m.use_flash_attention
    config.recompute = args.recompute
    from ..models.llm_meta import apply_llm_meta, on_gpu

    apply_llm_meta(cfg, config, on_gpu=on_gpu())
    config.seq_length = cfg.dpo.max_seq_len if cfg.dpo is not None else d.max_length
    # only dropout the family really reads (config.parse refused the others)
    dropout = {k: getattr(m, k) for k in DROPOUT_KEYS}
    for attr, value in dropout_config_updates(getattr(config, "model_type", None), dropout).items():
        setattr(config, attr, value)
    for key in ("fuse_attention_qkv", "fuse_attention_ffn"):
        if getattr(m, key) is not None:
            setattr(config, key, getattr(m, key))
    where = f"{cfg.source or 'config'}: model_name_or_path {m.model_name_or_path!r}"
    # PaddleNLP's own loader stays for what streaming does not take: tensor-parallel shards and
    # fusing q/k/v or gate/up of an unfused checkpoint at load time.
    fused = any(getattr(m, k) for k in ("fuse_attention_qkv", "fuse_attention_ffn"))
    if m.continue_training and (args.tensor_parallel_degree > 1 or fused):
        model = AutoModelForCausalLM.from_pretrained(m.model_name_or_path, config=config, dtype=dtype)
    elif m.continue_training:
        from ..models.loading import load_model_streaming

        try:
            return load_model_streaming(m.model_name_or_path, config, dtype, quantization=quantization, logger=logger)
        except (CheckpointError, ValueError) as e:  # names the tensor / file / layer and what to do
            raise ConfigError([f"{where}: {e}"], before_load=False) from e
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # random init (continue_training=false)
    if not quantization:
        return model, None
    from ..quant import quantize_model

    try:
        stats = quantize_model(model, quantization["weight_quantize_algo"], block_size=quantization["weight_blocksize"],
                               double_quant=quantization["weight_double_quant"],
                               double_quant_block_size=quantization["weight_double_quant_block_size"])
    except ValueError as e:  # a layer shape the format cannot take: the message says what to do
        raise ConfigError([f"{where}: weight_quantize_algo={quantization['weight_quantize_algo']}: {e}"],
                          before_load=False) from e
    return model, stats


def resolve_quantization(cfg: RunConfig) -> Optional[Dict[str, Any]]:
    """The config's quantization, or (with lora_path) the one the adapter was trained on."""
    quant = quantization_dict(cfg)
    if quant is None and cfg.model.lora_path:
        from paddlenlp.utils.log import logger

        from ..adapters import AdapterConfig

        # An adapter trained on a quantized base is evaluated/continued on the same quantized base.
        quant = AdapterConfig.load(cfg.model.lora_path).quantization
        if quant:
            logger.info(f"derived setting: base quantized as in {cfg.model.lora_path}: {json.dumps(quant)}")
    return quant


def evaluate_generation(cfg: RunConfig, model, tokenizer, output_dir: str) -> Dict[str, float]:
    from ..data.reader import find_split_files, read_examples
    from ..evaluation.generation import evaluate_by_generation

    d, g = cfg.data, cfg.generate
    examples = read_examples(find_split_files(d.dataset_name_or_path, "dev"))
    use_template = bool(getattr(tokenizer, "chat_template", None))  # build_datasets loaded chat_template
    metrics, _ = evaluate_by_generation(model, tokenizer, examples, d.src_length, d.max_length, use_template,
                                        g.top_k, g.top_p, output_dir if d.save_generation_output else None)
    return metrics


def check_complete_checkpoint(ckpt: str, cfg: RunConfig) -> None:
    from .trainer import CHECKPOINT_COMPLETE_NAME

    if not os.path.isfile(os.path.join(ckpt, CHECKPOINT_COMPLETE_NAME)):
        raise ConfigError([
            f"{cfg.source or 'config'}: resume_from_checkpoint {ckpt!r} is incomplete (no {CHECKPOINT_COMPLETE_NAME}: "
            "the run stopped while saving it, or it was not written by paddlenlp_ext); resume from an earlier "
            "checkpoint-* directory"
        ])


def lazy_resume_point(args):
    """(stream cursor, global step) stored in the checkpoint we resume from.

    The Trainer must not replay the stream to skip consumed batches: the
    cursor already points past them, so ignore_data_skip is turned on (logged)."""
    from paddlenlp.utils.log import logger

    from ..data.streaming import DATA_STATE_NAME, load_cursor

    ckpt = args.resume_from_checkpoint
    cursor = load_cursor(ckpt)
    if cursor is None:
        raise ConfigError([f"resume_from_checkpoint {ckpt!r} has no {DATA_STATE_NAME}: it was not written by a "
                           "lazy=true run, so the stream position is unknown"])
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        step = int(json.load(f)["global_step"])
    if not args.ignore_data_skip:
        args.ignore_data_skip = True
        logger.info("derived setting: ignore_data_skip = True (lazy stream resumes from its stored cursor)")
    logger.info(f"lazy stream resumes at {cursor} (global step {step})")
    return cursor, step


def peak_memory_bytes() -> Dict[str, int]:
    import paddle

    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        out["peak_gpu_bytes"] = int(paddle.device.cuda.max_memory_allocated())
    return out


@contextlib.contextmanager
def library_patches(cfg: RunConfig):
    """The integrations patches the configured model needs, active for the block only."""
    with contextlib.ExitStack() as patches:
        if cfg.model.use_flash_attention:
            from ..integrations.flashmask import cpu_flashmask, native_flashmask_available

            # The patch dispatches per call: GPU tensors go to Paddle's kernels,
            # the rest to paddlenlp_ext.kernels.flashmask_attention; it also
            # accepts our [batch, 1, seq, 1] start-row layout.
            patches.enter_context(cpu_flashmask())
            path = "Paddle's native kernels (fp16/bf16)" if native_flashmask_available() else \
                "paddlenlp_ext.kernels.flashmask_attention (block-sparse, CPU)"
            print(f"[paddlenlp_ext] attention: use_flash_attention via {path}", file=sys.stderr)
        yield


def run(cfg: RunConfig) -> Dict[str, Any]:
    """Train and/or evaluate as configured; returns the run summary."""
    from .heap import limit_heap_retention

    # freed activations go back to the OS instead of piling up in the heap step after step
    limit_heap_retention()
    with library_patches(cfg):
        return _run(cfg)


def start_run(cfg: RunConfig):
    """What every run does first (fine-tuning and DPO): training args, resolved_config.json, the derived
    settings logged, the seed, the resume checkpoint checked, the tokenizer, and (lazy) the stream cursor
    to resume at.  Returns (args, tokenizer, resume_cursor or None, resume_step)."""
    from paddlenlp.trainer import set_seed
    from paddlenlp.utils.log import logger

    args = build_training_args(cfg)
    if args.should_save:
        write_resolved_config(cfg, args.output_dir)
    for key, note in cfg.derived.items():
        logger.info(f"derived setting: {key} = {note}")
    set_seed(args.seed)
    if args.do_train and args.resume_from_checkpoint:
        check_complete_checkpoint(args.resume_from_checkpoint, cfg)
    tokenizer = load_tokenizer(cfg)
    resume_cursor, resume_step = None, 0
    if cfg.data.lazy and args.do_train and args.resume_from_checkpoint:
        resume_cursor, resume_step = lazy_resume_point(args)
    return args, tokenizer, resume_cursor, resume_step


def attach_data_callbacks(trainer, train_dataset, cfg: RunConfig, args, resume_step: int) -> None:
    """Per-epoch reshuffle of packed rows and, for a lazy stream, its cursor in every checkpoint."""
    from .callbacks import EpochCallback, StreamCursorSaver

    if hasattr(train_dataset, "set_epoch"):
        trainer.add_callback(EpochCallback(train_dataset))
    if cfg.data.lazy and args.do_train:
        rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.dataset_world_size
        trainer.checkpoint_extras.append(StreamCursorSaver(train_dataset, rows_per_step, resume_step))


def _run(cfg: RunConfig) -> Dict[str, Any]:
    from paddlenlp.utils.log import logger

    from ..data.pipeline import build_datasets
    from .trainer import FinetuneTrainer

    wall_start = time.time()
    args, tokenizer, resume_cursor, resume_step = start_run(cfg)
    data = build_datasets(cfg, tokenizer, do_train=args.do_train, do_eval=args.do_eval, seed=args.seed,
                          resume_cursor=resume_cursor)
    for split, report in data.reports.items():
        logger.info(f"data[{split}]: {json.dumps(report)}")

    from .callbacks import StepTimer

    built = build_model(cfg, args)
    model, adapter_config, prefix_io = built.model, built.adapter_config, built.prefix_io
    neftune_hook = None
    if cfg.model.neftune:
        from .. import adapters as adapter_api

        neftune_hook = adapter_api.attach_neftune(model, cfg.model.neftune_noise_alpha)

    trainer = FinetuneTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.dev,
        tokenizer=tokenizer,
        data_collator=data.collator,
        adapter_config=adapter_config,
        neftune_hook=neftune_hook,
        weights_io=prefix_io,
    )
    attach_data_callbacks(trainer, data.train, cfg, args, resume_step)

    step_timer = StepTimer()
    trainer.add_callback(step_timer)
    summary: Dict[str, Any] = {**built.summary(), "world_size": args.world_size, "data": data.reports}
    if args.do_eval and args.eval_before_train:
        metrics = trainer.evaluate()
        summary["eval_loss_before_train"] = metrics["eval_loss"]
        logger.info(f"eval before training: loss {metrics['eval_loss']:.4f}")
        print(f"[paddlenlp_ext] eval loss before training: {metrics['eval_loss']:.4f}", flush=True)

    if args.do_train:
        t0 = time.time()
        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        train_time = time.time() - t0
        trainer.save_model()
        metrics = dict(result.metrics)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        if cfg.data.lazy:
            data.reports["train"]["stream"] = data.train.report()
        tokens, supervised = trainer.global_token_counts()
        summary.update(
            train_loss=metrics.get("train_loss"),
            global_steps=result.global_step,
            train_time_s=round(train_time, 3),
            tokens_trained=tokens,
            supervised_tokens_trained=supervised,
            supervised_token_fraction=round(supervised / max(tokens, 1), 4),
            tokens_per_second=round(tokens / max(train_time, 1e-9), 2),
        )
        if args.load_best_model_at_end and trainer.state.best_model_checkpoint:
            # the weights in output_dir (and evaluated below) are this checkpoint's
            summary.update(best_model_checkpoint=trainer.state.best_model_checkpoint,
                           best_metric={args.metric_for_best_model: trainer.state.best_metric})
        print(f"[paddlenlp_ext] train loss: {metrics.get('train_loss'):.4f}", flush=True)
    if args.do_eval:
        metrics = trainer.evaluate()
        if cfg.data.eval_with_do_generation and args.should_save:
            gen_metrics = evaluate_generation(cfg, model, tokenizer, args.output_dir)
            metrics.update(gen_metrics)
            summary.update(gen_metrics)
            print("[paddlenlp_ext] generation eval: " + ", ".join(f"{k} {v:.4f}" for k, v in gen_metrics.items()),
                  flush=True)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        summary.update(eval_loss=metrics["eval_loss"], eval_perplexity=metrics.get("eval_perplexity"),
                       eval_accuracy=metrics.get("eval_accuracy"))
        print(f"[paddlenlp_ext] eval loss: {metrics['eval_loss']:.4f} "
              f"(perplexity {metrics.get('eval_perplexity', float('nan')):.3f}, "
              f"token accuracy {metrics.get('eval_accuracy', float('nan')):.4f})", flush=True)
    return write_run_summary(args, summary, step_timer, wall_start)


def write_run_summary(args, summary: Dict[str, Any], step_timer, wall_start: float) -> Dict[str, Any]:
    """Add step times, peak memory and wall time; write output_dir/run_summary.json (main process)."""
    if step_timer.step_times:
        summary["step_times_s"] = step_timer.step_times
        summary["rss_after_first_step_bytes"] = step_timer.rss_after_first_step
    summary.update(peak_memory_bytes())
    summary["wall_time_s"] = round(time.time() - wall_start, 3)
    if args.should_save:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, RUN_SUMMARY_NAME), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary


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
        out = {"rss_before_model_bytes": self.rss_before_model, "rss_after_load_bytes": self.rss_after_load,
               "method": self.method, "trainable_params": self.trainable, "total_params": self.total}
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
    if cfg.model.lora_path or cfg.adapter_method or cfg.model.neftune:
        from .. import adapters as adapter_api
    if cfg.model.lora_path:
        # continue training (or evaluate) a saved adapter; its own config wins
        adapter_config = adapter_api.load_adapter(model, cfg.model.lora_path)
    elif cfg.adapter_method:
        adapter_config = adapter_config_from_run(cfg, getattr(model.config, "model_type", None))
        # adapter init depends on the seed only, not on how many random numbers the load path drew
        # (the streaming loader draws none; from_pretrained's random init did)
        set_seed(args.seed)
        adapter_api.apply_adapters(model, adapter_config)
    prefix_io = prefix_info = None
    if cfg.model.prefix_tuning:  # the frozen model behind trained key/value prefixes (paddlenlp_ext.prefix)
        from ..prefix.io import attach_prefix

        set_seed(args.seed)
        model, prefix_io, prefix_info = attach_prefix(model, cfg.model, model_dtype(args))
    from ..adapters import count_parameters

    trainable, total = count_parameters(model)
    method = describe_method(cfg, adapter_config)
    logger.info(f"method: {method}; trainable parameters {trainable:,} of {total:,} ({100.0 * trainable / total:.4f}%)")
    return BuiltModel(model, adapter_config, quantization, load_stats, prefix_io, prefix_info, method, trainable,
                      total, rss_before_model, current_rss_bytes())


def adapter_config_from_run(cfg: RunConfig, model_type: Optional[str] = None):
    from ..adapters.config import adapter_config_from_args

    return adapter_config_from_args({**dataclasses.asdict(cfg.model), "quantization": quantization_dict(cfg),
                                     "model_type": model_type})


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
