"""What a run reports while it trains and when it ends, for fine-tuning and DPO alike.

:func:`attach_reporting` (after the trainer is built) prints the configuration
line and adds the console progress, the run-long VisualDL writer and the
``loss.png`` curve; :func:`report_final` (from ``write_run_summary``) draws the
final curve and prints the final table.  The console itself and train.log are
``training.logfile.run_logging``'s; the formats are ``training.console``'s.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List

from ..runtime import cpu_env
from .console import config_line, current, final_table

#: weight files in output_dir -> what the table calls them (first match wins)
WEIGHT_KINDS = (
    ("adapter_model.safetensors", "adapter"),
    ("prefix_model_state.pdparams", "prefix"),
    ("model.safetensors", "model weights"),
    ("model.safetensors.index.json", "model weights"),
    ("model_state.pdparams", "model weights"),
)


def attach_reporting(trainer, cfg, args, built, reports: Dict[str, Dict[str, Any]], tokens: Callable[[], int]) -> None:
    """Console progress, VisualDL for the whole run and loss.png on ``trainer``; prints the configuration line.

    ``built``: ``training.model_build.BuiltModel``; ``reports``: the data reports by split;
    ``tokens()``: the tokens this process has trained so far (the trainer's counter)."""
    from ..integrations.logging import replace_console_callbacks
    from .callbacks import ConsoleProgress, LossCurve, loss_plot_path

    console = current()
    # PaddleNLP's disable_tqdm: true = plain lines; false = a live bar, on a terminal only
    console.bar = console.main and not args.disable_tqdm and console.stream.isatty()
    # the trainer declares what its progress and eval lines show (e.g. DPO's reward accuracy, GRPO's reward and KL)
    progress = ConsoleProgress(
        console, tokens, args.dataset_world_size, trainer.progress_metrics(), trainer.accuracy_metric()
    )
    close_visualdl = replace_console_callbacks(trainer, progress)
    if close_visualdl is not None:
        console.closers.append(close_visualdl)
    curve = LossCurve(
        loss_plot_path(args.output_dir), title=f"{built.method}: {args.output_dir}", enabled=args.should_save
    )
    trainer.add_callback(curve)
    console.finishers.append(curve.write)  # after the final evaluation, which comes after on_train_end
    decision = cpu_env.current()
    line = config_line(
        cfg.model.model_name_or_path,
        built.method,
        built.trainable,
        built.total,
        reports,
        cpu=decision.text if decision else None,
    )
    notice = packing_notice(cfg, args, built.model)
    console.line(line + (f" | {notice}" if notice else ""))


def packing_notice(cfg, args, model):
    """config.packing_payoff's notice for this fine-tune (None for DPO: not measured there)."""
    import paddle

    from ..config.packing_payoff import packing_payoff

    if cfg.alignment is not None:
        return None
    config = getattr(model, "config", None) or getattr(getattr(model, "model", None), "config", None)
    return packing_payoff(
        bool(cfg.data.zero_padding),
        bool(cfg.model.flash_mask),
        args.per_device_train_batch_size,
        getattr(config, "hidden_size", None),
        on_cpu=paddle.get_device().startswith("cpu"),
    )


def outputs_of(args) -> List[str]:
    """What output_dir holds for the user: the weights, loss.png, train.log, VisualDL records, the summary."""
    out_dir = args.output_dir
    names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    out = [next((kind for name, kind in WEIGHT_KINDS if name in names), None)]
    out += [n for n in ("loss.png", "train.log") if n in names]
    logging_dir = os.path.abspath(args.logging_dir or "")
    if (
        "visualdl" in (args.report_to or [])
        and os.path.isdir(logging_dir)
        and logging_dir.startswith(os.path.abspath(out_dir) + os.sep)
    ):
        out.append(os.path.relpath(logging_dir, out_dir).split(os.sep)[0] + "/ (VisualDL)")
    out.append("run_summary.json")
    return [o for o in out if o]


def report_final(args, summary: Dict[str, Any]) -> None:
    """loss.png with the final evaluation, then the final table (main process)."""
    console = current()
    console.finish()
    console.line("summary:")
    for row in final_table(summary, args.output_dir, outputs_of(args)):
        console.line(row)
