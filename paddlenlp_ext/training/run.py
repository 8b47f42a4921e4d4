"""The steps every run shares, which the one run recipe (``training.recipe``) calls in order: training args,
resolved_config.json, the tokenizer, the resume checks (``start_run``), the library patches, the data
callbacks, training and saving (``train_and_save``) and run_summary.json (``write_run_summary``).

Data is read before the model so that a malformed line fails in seconds, not after a model load.  The
model half is ``training.model_build``; the console, train.log, VisualDL and loss.png are
``training.logfile`` / ``training.reporting`` (docs/logging.md).
"""

import contextlib
import json
import os
import resource
import sys
import time
from typing import Any, Dict

from ..config.parse import ConfigError, RunConfig

# the model half of the build; load_model is re-exported for llm/tools/check_packing.py
from .model_build import build_model, load_model  # noqa: F401

RESOLVED_CONFIG_NAME = "resolved_config.json"
RUN_SUMMARY_NAME = "run_summary.json"


def build_training_args(cfg: RunConfig):
    import paddle

    from .training_args import make_training_arguments

    where = cfg.source or "config"
    on_gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if cfg.training.get("fp16") and not on_gpu:
        raise ConfigError(
            [f"{where}: fp16=true needs a GPU (Paddle's CPU build has no fp16 kernels); use bf16 (O1) or fp32 on CPU"]
        )
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


def load_tokenizer(cfg: RunConfig):
    from ..models.tokenizer import TokenizerLoadError
    from ..models.tokenizer import load_tokenizer as load_any_tokenizer

    from ..models.registration import register_qwen3

    register_qwen3()  # our model families (Qwen3) known to PaddleNLP's Auto classes
    from ..models.registration import register_decoder

    register_decoder()  # ... and our decoder's rows (models/family_table.py, Family.decoder)

    path = cfg.model.tokenizer_name_or_path or cfg.model.model_name_or_path
    try:
        tokenizer = load_any_tokenizer(path)  # tokenizer.json-only directories included
    except TokenizerLoadError as e:
        raise ConfigError([f"{cfg.source or 'config'}: tokenizer of {path!r}: {e}"]) from e
    if tokenizer.pad_token_id is None:
        # Padding positions never carry loss or attention from real tokens; any id works.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def evaluate_generation(cfg: RunConfig, model, tokenizer, output_dir: str) -> Dict[str, float]:
    from ..evaluation.generation import evaluate_dev_by_generation

    return evaluate_dev_by_generation(cfg, model, tokenizer, output_dir)  # any data format (docs/data.md)


def check_complete_checkpoint(ckpt: str, cfg: RunConfig) -> None:
    from .trainer import CHECKPOINT_COMPLETE_NAME

    if not os.path.isfile(os.path.join(ckpt, CHECKPOINT_COMPLETE_NAME)):
        raise ConfigError(
            [
                f"{cfg.source or 'config'}: resume_from_checkpoint {ckpt!r} is incomplete (no {CHECKPOINT_COMPLETE_NAME}: "
                "the run stopped while saving it, or it was not written by paddlenlp_ext); resume from an earlier "
                "checkpoint-* directory"
            ]
        )


def lazy_resume_point(args):
    """(stream cursor, global step) stored in the checkpoint we resume from.

    The Trainer must not replay the stream to skip consumed batches: the
    cursor already points past them, so ignore_data_skip is turned on (logged)."""
    from ..data.streaming import DATA_STATE_NAME, load_cursor
    from .console import current

    ckpt = args.resume_from_checkpoint
    cursor = load_cursor(ckpt)
    if cursor is None:
        raise ConfigError(
            [
                f"resume_from_checkpoint {ckpt!r} has no {DATA_STATE_NAME}: it was not written by a "
                "lazy=true run, so the stream position is unknown"
            ]
        )
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        step = int(json.load(f)["global_step"])
    if not args.ignore_data_skip:
        args.ignore_data_skip = True
        current().line("derived setting: ignore_data_skip = True (lazy stream resumes from its stored cursor)")
    current().line(f"lazy stream resumes at {cursor} (global step {step})")
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
        from ..integrations.dense_attention import fast_dense_attention
        from ..integrations.rms_norm import fast_rms_norm
        from ..integrations.rotary import fast_rotary

        # bit-identical rotary embeddings and dense-mask attention, cheaper on CPU (integrations/)
        patches.enter_context(fast_rotary())
        patches.enter_context(fast_dense_attention())
        # RMSNorm as one node with x * x instead of pow (CPU fp32; within 1e-6 of PaddleNLP's)
        patches.enter_context(fast_rms_norm())
        if cfg.model.use_flash_attention:
            from ..integrations.flashmask import cpu_flashmask, native_flashmask_available

            # The patch dispatches per call: GPU tensors go to Paddle's kernels,
            # the rest to paddlenlp_ext.kernels.flashmask_attention; it also
            # accepts our [batch, 1, seq, 1] start-row layout.
            patches.enter_context(cpu_flashmask())
            path = (
                "Paddle's native kernels (fp16/bf16)"
                if native_flashmask_available()
                else "paddlenlp_ext.kernels.flashmask_attention (block-sparse, CPU; packed documents: per document)"
            )
            print(f"[paddlenlp_ext] attention: use_flash_attention via {path}", file=sys.stderr)
        yield


def start_run(cfg: RunConfig):
    """What every run does first (fine-tuning and DPO): training args, resolved_config.json, the derived
    settings logged, the seed, the resume checkpoint checked, the tokenizer, and (lazy) the stream cursor
    to resume at.  Returns (args, tokenizer, resume_cursor or None, resume_step)."""
    from paddlenlp.trainer import set_seed

    from .console import current

    args = build_training_args(cfg)
    if args.should_save:
        write_resolved_config(cfg, args.output_dir)
    for key, note in cfg.derived.items():
        current().line(f"derived setting: {key} = {note}")
    set_seed(args.seed)
    if args.do_train:
        print_memory_plan(cfg)
    if args.do_train and args.resume_from_checkpoint:
        check_complete_checkpoint(args.resume_from_checkpoint, cfg)
    tokenizer = load_tokenizer(cfg)
    resume_cursor, resume_step = None, 0
    if cfg.data.lazy and args.do_train and args.resume_from_checkpoint:
        resume_cursor, resume_step = lazy_resume_point(args)
    return args, tokenizer, resume_cursor, resume_step


def train_and_save(trainer, cfg: RunConfig, args, data, summary: Dict[str, Any]) -> float:
    """The training half every run shares (fine-tuning and DPO): train (resuming if asked), save the
    final weights, train metrics and state, note the lazy stream and the best checkpoint in ``summary``.
    Returns the seconds trained over the whole run (the parts before a resume included)."""
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    metrics = dict(result.metrics)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    if cfg.data.lazy:
        data.reports["train"]["stream"] = data.train.report()
    summary.update(
        train_loss=metrics.get("train_loss"),
        global_steps=result.global_step,
        train_time_s=round(trainer.train_time_s, 3),
    )
    if trainer.train_time_before:
        # train_time_s covers the whole run; wall_time_s only this process: say how much came before
        summary["train_time_before_resume_s"] = round(trainer.train_time_before, 3)
    if args.load_best_model_at_end and trainer.state.best_model_checkpoint:
        # the weights in output_dir (and evaluated after training) are this checkpoint's
        summary.update(
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            best_metric={args.metric_for_best_model: trainer.state.best_metric},
        )
    return trainer.train_time_s


def print_memory_plan(cfg: RunConfig) -> None:
    """One console line with the planner's per-device estimate (docs/parallel.md); a warning when it
    exceeds this device's memory (the GPU's, else the host's)."""
    import paddle
    from paddlenlp.utils.log import logger

    from .llm_meta import on_gpu
    from ..planner import PlanError, estimate_for_run, format_one_line, host_memory_bytes
    from .console import current

    try:
        estimate = estimate_for_run(cfg)
    except PlanError as e:
        logger.warning(f"memory plan unavailable: {e}")
        return
    total = paddle.device.cuda.get_device_properties().total_memory if on_gpu() else host_memory_bytes()
    line = format_one_line(estimate, device_memory=total)
    if total and estimate.per_device_bytes > total:
        logger.warning(line)
    else:
        current().line(line)


def attach_data_callbacks(trainer, train_dataset, cfg: RunConfig, args, resume_step: int) -> None:
    """Per-epoch reshuffle of packed rows and, for a lazy stream, its cursor in every checkpoint."""
    from .callbacks import EpochCallback, StreamCursorSaver

    if hasattr(train_dataset, "set_epoch"):
        trainer.add_callback(EpochCallback(train_dataset))
    if cfg.data.lazy and args.do_train:
        rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.dataset_world_size
        trainer.checkpoint_extras.append(StreamCursorSaver(train_dataset, rows_per_step, resume_step))


def cpu_setup_record() -> Dict[str, Any]:
    """``runtime.cpu_env``'s decision and the CPU math variables as this process has them now (after
    paddle's import, which sets ``OMP_NUM_THREADS=1`` when it is unset)."""
    from ..runtime import cpu_env

    decision = cpu_env.current()
    record = decision.as_dict() if decision else {"enabled": None, "text": "cpu: set-up not run"}
    record["env"] = {k: os.environ.get(k) for k in cpu_env.THREAD_VARS + cpu_env.CODE_PATH_VARS}
    return record


def write_run_summary(args, summary: Dict[str, Any], step_timer, wall_start: float) -> Dict[str, Any]:
    """Add step times, peak memory and wall time; write output_dir/run_summary.json (main process);
    then the final loss.png and the console's final table (``training.reporting``)."""
    from .rank_counts import finish_together
    from .reporting import report_final

    if step_timer.step_times:
        summary["step_times_s"] = step_timer.step_times
        summary["rss_after_first_step_bytes"] = step_timer.rss_after_first_step
    summary.update(peak_memory_bytes())
    summary["cpu"] = cpu_setup_record()
    summary["wall_time_s"] = round(time.time() - wall_start, 3)
    if args.should_save:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, RUN_SUMMARY_NAME), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, default=str)
    report_final(args, summary)
    finish_together()  # no process exits while another still writes (rank_counts.finish_together)
    return summary
