"""What a run prints on the console: the text formats and the one object that writes them.

A run prints, on the main process only:

* one configuration line when the trainer is built (:func:`config_line`);
* one progress line per logging step (:func:`progress_line`): step/total, loss,
  learning rate, tokens/s, elapsed and ETA; on a terminal also a live bar
  (:func:`progress_bar`) redrawn every step under those lines;
* a few notes (derived settings, eval loss before training, generation metrics);
* the final table (:func:`final_table`).

Every line also goes to ``output_dir/train.log`` (``training.logfile`` installs
the file logger and the active :class:`Console`).  Nothing here imports paddle.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
from typing import Any, Callable, Dict, List, Optional

#: the stdlib logger whose records reach train.log only (console lines are printed separately)
FILE_LOGGER_NAME = "paddlenlp_ext.run"


# -- formats ------------------------------------------------------------------
def format_duration(seconds: Optional[float]) -> str:
    """``47`` -> ``0:47``; ``3723`` -> ``1:02:03``; None/inf/negative -> ``?``."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def eta_seconds(elapsed: float, steps_done: int, steps_left: int) -> Optional[float]:
    """Remaining time at the average pace of the steps done so far (None before the first step)."""
    if steps_done <= 0 or elapsed <= 0:
        return None
    return elapsed / steps_done * max(steps_left, 0)


def format_count(n: Optional[float]) -> str:
    """``4582.7`` -> ``4,583``; None -> ``-``."""
    return "-" if n is None else f"{n:,.0f}"


def format_bytes(n: Optional[float]) -> str:
    """``834666496`` -> ``796 MiB``; ``2147483648`` -> ``2.00 GiB``."""
    if n is None:
        return "-"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.0f} MiB"


def format_float(v: Any, digits: int = 4) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def format_bar(fraction: float, width: int, ascii_only: bool = False) -> str:
    """A bar of ``width`` cells filled to ``fraction`` (clamped to [0, 1]), eighths of a cell
    with Unicode blocks as tqdm draws it, ``#`` cells in ASCII.  ``format_bar(0.5, 4, True)`` -> ``##  ``."""
    fraction = min(max(fraction, 0.0), 1.0)
    if ascii_only:
        full = int(fraction * width)
        return ("#" * full).ljust(width)
    eighths = int(fraction * width * 8)
    full, part = divmod(eighths, 8)
    bar = "\u2588" * full + ("" if part == 0 or full >= width else chr(0x2590 - part))
    return bar.ljust(width)


def _step_text(step: int, total: int) -> str:
    width = len(str(total))
    pct = 100.0 * step / total if total else 0.0
    return f"step {step:>{width}}/{total} ({pct:3.0f}%)"


def progress_line(
    step: int,
    total: int,
    loss: Optional[float],
    lr: Optional[float],
    tokens_per_s: Optional[float],
    elapsed: float,
    eta: Optional[float],
    extra: Optional[Dict[str, float]] = None,
) -> str:
    """``step  10/150 (  7%)  loss 7.1777  lr 1.00e-02  4,583 tok/s  elapsed 0:04  ETA 0:47``"""
    parts = [_step_text(step, total), f"loss {format_float(loss)}"]
    if lr is not None:
        parts.append(f"lr {lr:.2e}")
    for name, value in (extra or {}).items():
        parts.append(f"{name} {format_float(value)}")
    parts += [
        f"{format_count(tokens_per_s)} tok/s",
        f"elapsed {format_duration(elapsed)}",
        f"ETA {format_duration(eta)}",
    ]
    return "  ".join(parts)


def progress_bar(
    step: int,
    total: int,
    elapsed: float,
    eta: Optional[float],
    loss: Optional[float],
    columns: int = 100,
    ascii_only: bool = False,
) -> str:
    """``  42/150 |█████▋        | 28% loss 1.2345 0:13<0:35``, at most ``columns - 1`` characters."""
    width = len(str(total))
    tail = (
        f" {100.0 * step / total if total else 0:3.0f}% loss {format_float(loss)} "
        f"{format_duration(elapsed)}<{format_duration(eta)}"
    )
    head = f"{step:>{width}}/{total}"
    cells = min(columns - 3 - len(head) - len(tail), 40)
    if cells >= 5:  # else a narrow terminal: the figures without the bar
        head += " |" + format_bar(step / total if total else 0.0, cells, ascii_only) + "|"
    return (head + tail)[: max(columns - 1, 20)]


def _data_text(reports: Dict[str, Dict[str, Any]]) -> List[str]:
    """Data facts of the SFT (examples) or DPO (pairs) data reports, train first."""
    parts = []
    train = reports.get("train")
    if train:
        unit = "pairs" if "pairs" in train else "examples"
        cut = "".join(
            f", {format_count(train[k])} {k.split('_')[0]}"
            for k in ("truncated_examples", "dropped_examples")
            if k in train
        )  # the one truncation policy's counts (docs/data.md)
        parts.append(f"train {format_count(train.get(unit))} {unit}, {format_count(train.get('tokens'))} tokens{cut}")
    dev = reports.get("dev")
    if dev:
        unit = "pairs" if "pairs" in dev else "examples"
        parts.append(f"dev {format_count(dev.get(unit))}")
    first = train or dev
    if first:
        ratio = first.get("padding_ratio")
        pad = f", padding {100.0 * ratio:.1f}%" if isinstance(ratio, (int, float)) else ""
        parts.append(f"packing {first.get('packing', '?')}{pad}")
    return parts


def config_line(
    model_path: str,
    method: str,
    trainable: int,
    total: int,
    reports: Dict[str, Dict[str, Any]],
    cpu: Optional[str] = None,
) -> str:
    """``model tiny-llama | lora | trainable 18,688 / 176,704 (10.58%) | train 2,000 examples, ...``,
    ending with ``| cpu: 2 threads (2 CPUs), MKL AVX2 code path (AMD CPU)`` when ``cpu`` is given
    (``runtime.cpu_env``'s decision)."""
    name = os.path.basename(os.path.normpath(model_path)) if model_path else "?"
    share = f" ({100.0 * trainable / total:.2f}%)" if total else ""
    parts = [f"model {name}", method, f"trainable {format_count(trainable)} / {format_count(total)}{share}"]
    return " | ".join(parts + _data_text(reports) + ([cpu] if cpu else []))


def _eval_figures(summary: Dict[str, Any]):
    """(eval loss, eval loss before training, accuracy label, accuracy) of an SFT or a DPO summary."""
    dpo_eval = summary.get("eval") if isinstance(summary.get("eval"), dict) else {}
    before = summary.get("eval_loss_before_train")
    if before is None and isinstance(summary.get("eval_before_train"), dict):
        before = summary["eval_before_train"].get("eval_loss")
    loss = summary.get("eval_loss", dpo_eval.get("eval_loss"))
    if dpo_eval.get("eval_rewards/accuracies") is not None:
        return loss, before, "reward accuracy", dpo_eval["eval_rewards/accuracies"], dpo_eval
    return loss, before, "eval accuracy", summary.get("eval_accuracy"), dpo_eval


def final_table(summary: Dict[str, Any], output_dir: str, outputs: List[str]) -> List[str]:
    """The rows printed at the end of a run (train/eval figures, time, speed, memory, outputs)."""
    rows = []
    if summary.get("train_loss") is not None:
        rows.append(("train loss", f"{format_float(summary['train_loss'])} ({summary.get('global_steps', '?')} steps)"))
    loss, before, acc_name, acc, dpo_eval = _eval_figures(summary)
    if loss is not None:
        notes = [f"before training {format_float(before)}"] if before is not None else []
        if summary.get("eval_perplexity") is not None:
            notes.append(f"perplexity {summary['eval_perplexity']:.3f}")
        rows.append(("eval loss", format_float(loss) + (f" ({', '.join(notes)})" if notes else "")))
    if acc is not None:
        margin = dpo_eval.get("eval_rewards/margins")
        rows.append((acc_name, format_float(acc) + (f" (margin {format_float(margin)})" if margin is not None else "")))
    if summary.get("best_model_checkpoint"):
        metric = ", ".join(f"{k} {format_float(v)}" for k, v in (summary.get("best_metric") or {}).items())
        rows.append(("best model", f"{os.path.basename(summary['best_model_checkpoint'])} ({metric})"))
    train_time = summary.get("train_time_s")
    before = summary.get("train_time_before_resume_s")
    resumed = f" ({format_duration(before)} of it before the resume)" if before else ""
    time_text = (
        f"train {format_duration(train_time)}{resumed}, " if train_time is not None else ""
    ) + f"{'this process' if before else 'total'} {format_duration(summary.get('wall_time_s'))}"
    rows.append(("time", time_text))
    tokens = summary.get("tokens_trained")
    if tokens and train_time:
        rows.append(("tokens/s", f"{format_count(tokens / max(train_time, 1e-9))} ({format_count(tokens)} tokens)"))
    memory = f"{format_bytes(summary.get('peak_rss_bytes'))} RSS"
    if summary.get("peak_gpu_bytes"):
        memory += f", {format_bytes(summary['peak_gpu_bytes'])} GPU"
    rows.append(("peak memory", memory))
    rows.append(("outputs", f"{output_dir}: {', '.join(outputs)}" if outputs else output_dir))
    width = max(len(k) for k, _ in rows) + 2
    return [f"  {(k + ':').ljust(width)}{v}" for k, v in rows]


# -- the writer ---------------------------------------------------------------
class Console:
    """Writes the run's console lines to stdout (main process) and every line to train.log.

    ``bar=True`` (a terminal and ``disable_tqdm`` false) keeps one live progress
    bar as the last line; :meth:`line` prints above it.  ``finishers`` run at the
    end of the run (:meth:`finish`) and ``closers`` when the run's logging ends.
    """

    def __init__(self, stream=None, main: bool = True, file_logger: Optional[logging.Logger] = None):
        self.stream = stream if stream is not None else sys.stdout
        self.main = main
        self.file_logger = file_logger or logging.getLogger(FILE_LOGGER_NAME)
        self.bar = False
        self.ascii_only = (getattr(self.stream, "encoding", None) or "").lower().replace("-", "") != "utf8"
        self._bar_text: Optional[str] = None
        self.finishers: List[Callable[[], None]] = []
        self.closers: List[Callable[[], None]] = []

    def columns(self) -> int:
        return shutil.get_terminal_size((100, 24)).columns

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def line(self, text: str) -> None:
        """A console line (main process), also in train.log."""
        self.file_logger.info(text)
        if not self.main:
            return
        if self._bar_text is not None:
            self._write("\r\033[K" + text + "\n" + self._bar_text)
        else:
            self._write(text + "\n")

    def show_bar(self, text: str) -> None:
        """Redraw the live bar (terminal only; never in train.log)."""
        if self.main and self.bar:
            self._bar_text = text
            self._write("\r" + text + "\033[K")

    def clear_bar(self) -> None:
        if self._bar_text is not None:
            self._bar_text = None
            self._write("\r\033[K")

    def finish(self) -> None:
        for fn in self.finishers:
            fn()
        self.finishers = []

    def close(self) -> None:
        self.clear_bar()
        for fn in self.closers:
            fn()
        self.closers = []


_active: List[Console] = []


def current() -> Console:
    """The console of the running run (``training.logfile.run_logging``), else a plain one on stdout."""
    return _active[-1] if _active else Console()


def activate(console: Console) -> None:
    _active.append(console)


def deactivate(console: Console) -> None:
    if console in _active:
        _active.remove(console)
