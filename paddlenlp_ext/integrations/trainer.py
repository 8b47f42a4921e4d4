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
    on_checkpoint_written(ckpt_dir)   add files to a finished checkpoint (then mark it complete)
    amp_excluded_layers(model) -> list  layers O2 AMP must not cast (quantized bases' fp32 scales)
    load_weights(resume_from_checkpoint) -> bool
                                      restore weights on resume (False: PaddleNLP's loader runs);
                                      gets the raw argument: a path, True (latest) or None;
                                      also reloads the best checkpoint (load_best_model_at_end)
    on_evaluation_start()             before each evaluation loop
    extra_eval_metrics(prefix) -> dict  metrics added to the evaluation's (logged, best-model choice)

Best-model reload: PaddleNLP reloads the best checkpoint inline at the end of
``_inner_training_loop`` when ``args.load_best_model_at_end``, from its own
weight files (``model_state.pdparams`` or a unified checkpoint), which our
adapter / safetensors checkpoints are not (it warns and keeps the last weights,
or fails).  When we own saving, ``train`` switches that flag off for the loop
(best-checkpoint tracking depends on ``metric_for_best_model`` only) and
reloads ``state.best_model_checkpoint`` through ``load_weights``.

The signatures of the overridden methods are listed in ``RELIED_ON`` and
checked by ``tests/test_integrations.py``.
"""

from __future__ import annotations

import os
from typing import Optional

from paddlenlp.trainer import Trainer
from paddlenlp.trainer.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
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
    ("paddlenlp.trainer.Trainer", "evaluation_loop", ("self", "dataloader", "description", "prediction_loss_only",
                                                       "ignore_keys", "metric_key_prefix", "max_eval_iters")),
    ("paddlenlp.trainer.Trainer", "train", ("self", "resume_from_checkpoint", "ignore_keys_for_eval")),
    ("paddlenlp.trainer.trainer_utils", "PREFIX_CHECKPOINT_DIR", None),
    ("paddlenlp.trainer.trainer_utils", "get_last_checkpoint", ("folder", "signal_folder", "uc_async_save")),
]


def checkpoint_dir(output_dir: str, global_step: int) -> str:
    """Where PaddleNLP's Trainer writes the checkpoint of ``global_step``."""
    return os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")


def last_checkpoint(output_dir: str) -> Optional[str]:
    return get_last_checkpoint(output_dir)


class TrainerBoundary(Trainer):
    """PaddleNLP Trainer with its private save/resume/log paths routed to public hooks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._full_log_history = []

    # -- hooks (overridden by paddlenlp_ext.training.trainer) ----------------
    def owns_saving(self) -> bool:
        return False

    def save_weights(self, output_dir: str) -> None:
        raise NotImplementedError

    def on_checkpoint_written(self, checkpoint_dir: str) -> None:
        pass

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
    def train(self, resume_from_checkpoint=None, ignore_keys_for_eval=None):
        reload_best = bool(self.args.load_best_model_at_end) and self.owns_saving()
        if reload_best:
            self.args.load_best_model_at_end = False  # see the module docstring
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint,
                                   ignore_keys_for_eval=ignore_keys_for_eval)
        finally:
            if reload_best:
                self.args.load_best_model_at_end = True
        best = self.state.best_model_checkpoint
        if reload_best and best:
            logger.info(f"Loading best model from {best} ({self.args.metric_for_best_model} = {self.state.best_metric})")
            self.load_weights(best)
        return output

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval", max_eval_iters=-1):
        self.on_evaluation_start()
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                         metric_key_prefix, max_eval_iters)
        output.metrics.update(self.extra_eval_metrics(metric_key_prefix))
        return output

    # -- PaddleNLP private overrides ----------------------------------------
    def log(self, logs, **kwargs):
        # PaddleNLP empties state.log_history on every log call; keep it, so
        # trainer_state.json (and checkpoints) carry the whole history.
        super().log(logs, **kwargs)
        self._full_log_history.append({**logs, "step": self.state.global_step})
        self.state.log_history = list(self._full_log_history)

    def _decorate_exclude_layers(self, model):
        # paddle.amp.decorate(level="O2") casts every layer's weights and buffers to fp16/bf16
        return list(super()._decorate_exclude_layers(model)) + list(self.amp_excluded_layers(model))

    def _save(self, output_dir: Optional[str] = None, state_dict=None, merge_tensor_parallel=False):
        if not self.owns_saving():
            target = output_dir if output_dir is not None else self.args.output_dir
            return self.save_foreign(target, lambda d: super(TrainerBoundary, self)._save(
                d, state_dict, merge_tensor_parallel))
        if self.args.should_save:
            self.save_weights(output_dir if output_dir is not None else self.args.output_dir)

    def _save_checkpoint(self, model, metrics=None):
        super()._save_checkpoint(model, metrics)
        ckpt = checkpoint_dir(self.args.output_dir, self.state.global_step)
        if self.args.should_save and os.path.isdir(ckpt):
            self.on_checkpoint_written(ckpt)

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        if self.load_weights(resume_from_checkpoint):
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint)
