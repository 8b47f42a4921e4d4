"""The Trainer base class: every override of a PaddleNLP ``Trainer`` private method.

PaddleNLP's Trainer saves, checkpoints and resumes through private methods
(``_save``, ``_save_checkpoint``, ``_load_from_checkpoint``) and empties
``state.log_history`` on every ``log`` call.  :class:`TrainerBoundary`
overrides exactly those and turns them into public hooks that
``paddlenlp_ext.training.trainer`` implements:

    owns_saving() -> bool             we write the weights (else PaddleNLP's _save runs)
    save_weights(output_dir)          write model/adapter weights + tokenizer into output_dir
    save_foreign(output_dir, write)   where PaddleNLP's own writer (unified checkpoint, sharding
                                      stage1) puts its files: call write(directory)
    checkpoint_staging(final) -> str|None
                                      the directory PaddleNLP writes checkpoint-N into instead of
                                      output_dir (None: in place); PaddleNLP's own rotation is off
    before_checkpoint()               on every rank before a checkpoint is written (collectives)
    on_checkpoint_written(written, final)
                                      the checkpoint is in ``written`` (staged or in place): add
                                      files, mark it complete, move it to ``final``, rotate
    checkpoint_save_failed(final, staging, error) -> Exception
                                      an OSError while writing a checkpoint: clean up, say what to do
    amp_excluded_layers(model) -> list  layers O2 AMP must not cast (quantized bases' fp32 scales)
    load_weights(resume_from_checkpoint) -> bool
                                      restore weights on resume (False: PaddleNLP's loader runs);
                                      gets the raw argument: a path, True (latest) or None;
                                      also reloads the best checkpoint (load_best_model_at_end)
    on_evaluation_start()             before each evaluation loop
    extra_eval_metrics(prefix) -> dict  metrics added to the evaluation's (logged, best-model choice)

Run totals across a resume: PaddleNLP restarts its loss sum at 0 in every
``train`` call but divides by all steps (``train_loss = _total_loss_scalar /
(global_step - _skip_global_steps)``), so a resumed run reported the resumed
steps' loss divided by all of them.  ``loss_sum()`` is the sum so far (for the
checkpoint), ``restore_loss_sum(x)`` puts a checkpoint's sum back, added once
at the first log/save point of the loop (after PaddleNLP zeroed it), so the
sum continues exactly as in an uninterrupted run.  ``state.log_history``: the
history a resume loads from the checkpoint is kept and extended.

Best-model reload: PaddleNLP reloads the best checkpoint inline at the end of
``_inner_training_loop`` when ``args.load_best_model_at_end``, from its own
weight files (``model_state.pdparams`` or a unified checkpoint), which our
adapter / safetensors checkpoints are not (it warns and keeps the last weights,
or fails).  When we own saving, ``train`` switches that flag off for the loop
(best-checkpoint tracking depends on ``metric_for_best_model`` only) and
reloads ``state.best_model_checkpoint`` through ``load_weights``; the reload is
announced as our own console line (PaddleNLP's INFO record goes to train.log).

Resume: PaddleNLP draws a "Skipping the first batches" tqdm bar unless
``args.disable_tqdm`` (the flag's only use inside ``train``; the progress
callbacks were chosen when the Trainer was built): ``train`` sets it for the
loop, so that bar is never drawn (our progress lines say where the run resumed).

The signatures of the overridden methods are listed in ``RELIED_ON`` and
checked by ``tests/test_integrations.py``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

from paddlenlp.trainer import Trainer
from paddlenlp.trainer.trainer import TRAINER_STATE_NAME
from paddlenlp.trainer.trainer_utils import PREFIX_CHECKPOINT_DIR
from paddlenlp.utils.log import logger

from .versions import check_versions

check_versions()

#: (object path, attribute, parameter names) this module overrides or calls.
RELIED_ON = [
    ("paddlenlp.trainer.Trainer", "_save", ("self", "output_dir", "state_dict", "merge_tensor_parallel")),
    ("paddlenlp.trainer.Trainer", "_save_checkpoint", ("self", "model", "metrics")),
    ("paddlenlp.trainer.Trainer", "_load_from_checkpoint", ("self", "resume_from_checkpoint")),
    ("paddlenlp.trainer.Trainer", "log", ("self", "logs", "kwargs")),
    ("paddlenlp.trainer.Trainer", "_decorate_exclude_layers", ("self", "model")),
    (
        "paddlenlp.trainer.Trainer",
        "evaluation_loop",
        (
            "self",
            "dataloader",
            "description",
            "prediction_loss_only",
            "ignore_keys",
            "metric_key_prefix",
            "max_eval_iters",
        ),
    ),
    ("paddlenlp.trainer.Trainer", "train", ("self", "resume_from_checkpoint", "ignore_keys_for_eval")),
    (
        "paddlenlp.trainer.Trainer",
        "_maybe_log_save_evaluate",
        ("self", "tr_loss", "model", "epoch", "ignore_keys_for_eval", "kwargs"),
    ),
    ("paddlenlp.trainer.trainer_utils", "PREFIX_CHECKPOINT_DIR", None),
    ("paddlenlp.trainer.trainer", "TRAINER_STATE_NAME", None),
]

#: (method, attribute): instance attributes of the Trainer read or written here, and the method
#: that assigns them (``tests/test_integrations.py`` checks the assignment is still there).
RELIED_ON_ATTRIBUTES = [
    ("paddlenlp.trainer.Trainer._inner_training_loop", "_total_loss_scalar"),  # the loss sum behind train_loss
    ("paddlenlp.trainer.Trainer.__init__", "_skip_global_steps"),
]


def checkpoint_dir(output_dir: str, global_step: int) -> str:
    """Where PaddleNLP's Trainer writes the checkpoint of ``global_step``."""
    return os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")


@contextlib.contextmanager
def _checkpoint_written_into(args, staging: Optional[str]):
    """PaddleNLP's _save_checkpoint writes ``args.output_dir/checkpoint-N`` and then rotates: point it
    at ``staging`` (when given) and switch its rotation off (ours counts complete checkpoints only)."""
    saved = (args.output_dir, args.output_signal_dir, args.save_total_limit)
    try:
        if staging is not None:
            args.output_dir = args.output_signal_dir = staging
        args.save_total_limit = None
        yield
    finally:
        args.output_dir, args.output_signal_dir, args.save_total_limit = saved


class TrainerBoundary(Trainer):
    """PaddleNLP Trainer with its private save/resume/log paths routed to public hooks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._full_log_history = []
        self._published_history = None  # the list log() last put into state.log_history
        self._live_tr_loss = None  # PaddleNLP's running (not yet logged) loss tensor of the loop
        self._loss_sum_to_restore = None

    # -- hooks (overridden by paddlenlp_ext.training.trainer) ----------------
    def owns_saving(self) -> bool:
        return False

    def save_weights(self, output_dir: str) -> None:
        raise NotImplementedError

    def checkpoint_staging(self, final: str) -> Optional[str]:
        return None

    def before_checkpoint(self) -> None:
        pass

    def on_checkpoint_written(self, written: str, final: str) -> None:
        pass

    def checkpoint_save_failed(self, final: str, staging: Optional[str], error: OSError) -> Exception:
        return error

    def load_weights(self, resume_from_checkpoint) -> bool:
        return False

    def amp_excluded_layers(self, model) -> list:
        return []

    def save_foreign(self, output_dir: str, write) -> None:
        """PaddleNLP writes the weights (``write(directory)``); default: straight into output_dir."""
        write(output_dir)

    def on_evaluation_start(self) -> None:
        pass

    def extra_eval_metrics(self, prefix: str) -> dict:
        return {}

    # -- public overrides that rely on PaddleNLP internals --------------------
    def console_line(self, text: str) -> None:
        """One line on the run's console (the training layer's console overrides this; here PaddleNLP's logger)."""
        logger.info(text)

    def train(self, resume_from_checkpoint=None, ignore_keys_for_eval=None):
        reload_best = bool(self.args.load_best_model_at_end) and self.owns_saving()
        if reload_best:
            self.args.load_best_model_at_end = False  # see the module docstring
        disable_tqdm, self.args.disable_tqdm = self.args.disable_tqdm, True  # no "Skipping the first batches" bar
        try:
            output = super().train(
                resume_from_checkpoint=resume_from_checkpoint, ignore_keys_for_eval=ignore_keys_for_eval
            )
        finally:
            self.args.disable_tqdm = disable_tqdm
            if reload_best:
                self.args.load_best_model_at_end = True
        best = self.state.best_model_checkpoint
        if self.args.load_best_model_at_end and best:
            metric = self.state.best_metric
            metric = f"{metric:.4f}" if isinstance(metric, float) else metric
            # our line either way: when PaddleNLP reloaded it (a save we do not own), its INFO record of it is
            # in train.log only (the console policy), yet which weights end up in output_dir is news
            self.console_line(f"Loading best model from {best} ({self.args.metric_for_best_model} = {metric})")
            if reload_best:
                self.load_weights(best)
        return output

    def evaluation_loop(
        self,
        dataloader,
        description,
        prediction_loss_only=None,
        ignore_keys=None,
        metric_key_prefix="eval",
        max_eval_iters=-1,
    ):
        self.on_evaluation_start()
        output = super().evaluation_loop(
            dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix, max_eval_iters
        )
        output.metrics.update(self.extra_eval_metrics(metric_key_prefix))
        return output

    def loss_sum(self) -> float:
        """The training loss summed over the steps so far (as PaddleNLP sums it for train_loss)."""
        live = float(self._live_tr_loss.item()) if self._live_tr_loss is not None else 0.0
        return float(getattr(self, "_total_loss_scalar", 0.0)) + live + (self._loss_sum_to_restore or 0.0)

    def restore_loss_sum(self, value: float) -> None:
        """Continue from a checkpoint's loss sum (added at the first log/save point of the loop)."""
        self._loss_sum_to_restore = float(value)

    def save_checkpoint_now(self) -> None:
        """A checkpoint of the current step, after the training loop (which folded its running loss
        into the sum already)."""
        self._live_tr_loss = None
        self._save_checkpoint(self.model_wrapped, metrics=None)

    # -- PaddleNLP private overrides ----------------------------------------
    def log(self, logs, **kwargs):
        # PaddleNLP empties state.log_history on every log call; keep it, so
        # trainer_state.json (and checkpoints) carry the whole history.
        if self.state.log_history is not self._published_history and self.state.log_history:
            # a new state with a history: a resume loaded the checkpoint's, which covers every step
            # before it (entries logged by this process before train(), e.g. eval before training,
            # repeat the checkpoint's own)
            self._full_log_history = list(self.state.log_history)
        super().log(logs, **kwargs)
        self._full_log_history.append({**logs, "step": self.state.global_step})
        self.state.log_history = self._published_history = list(self._full_log_history)

    def _maybe_log_save_evaluate(self, tr_loss, model, epoch, ignore_keys_for_eval, **kwargs):
        # tr_loss is the loop's running loss (a local of _inner_training_loop): kept for loss_sum()
        self._live_tr_loss = tr_loss
        if self._loss_sum_to_restore is not None:
            # _inner_training_loop set _total_loss_scalar = 0.0 before the first step; no log yet
            self._total_loss_scalar += self._loss_sum_to_restore
            self._loss_sum_to_restore = None
        return super()._maybe_log_save_evaluate(tr_loss, model, epoch, ignore_keys_for_eval, **kwargs)

    def _decorate_exclude_layers(self, model):
        # paddle.amp.decorate(level="O2") casts every layer's weights and buffers to fp16/bf16
        return list(super()._decorate_exclude_layers(model)) + list(self.amp_excluded_layers(model))

    def _save(self, output_dir: Optional[str] = None, state_dict=None, merge_tensor_parallel=False):
        if not self.owns_saving():
            target = output_dir if output_dir is not None else self.args.output_dir
            return self.save_foreign(
                target, lambda d: super(TrainerBoundary, self)._save(d, state_dict, merge_tensor_parallel)
            )
        target = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            self.save_weights(target)
        elif (
            self.args.tensor_parallel_degree > 1 or self.args.pipeline_parallel_degree > 1
        ) and self.args.should_save_model_state:
            # the split weights (or the pipeline stages' adapters) are gathered to the writer: every
            # tensor-parallel / pipeline rank takes part
            self.join_weights_gather(target)

    def _save_checkpoint(self, model, metrics=None):
        final = checkpoint_dir(self.args.output_dir, self.state.global_step)
        self.before_checkpoint()
        staging = self.checkpoint_staging(final)
        try:
            with _checkpoint_written_into(self.args, staging):
                super()._save_checkpoint(model, metrics)
            written = final if staging is None else checkpoint_dir(staging, self.state.global_step)
            if staging is not None and self.state.best_model_checkpoint == written:
                self.state.best_model_checkpoint = final  # its trainer_state.json named the staging path
                if self.args.should_save:
                    self.state.save_to_json(os.path.join(written, TRAINER_STATE_NAME))
            if self.args.should_save and os.path.isdir(written):
                self.on_checkpoint_written(written, final)
        except OSError as e:  # disk full, permission: the hook cleans up and says what to do
            raise self.checkpoint_save_failed(final, staging, e) from e

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        if self.load_weights(resume_from_checkpoint):
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint)
