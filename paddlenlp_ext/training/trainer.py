"""PaddleNLP Trainer with adapter-aware saving, token accounting and NEFTune lengths.

The trainer receives built objects (model with adapters applied, datasets,
collator); it knows adapters only through the ``adapters`` save/load API and
PaddleNLP's private Trainer methods only through
``integrations.trainer.TrainerBoundary``'s public hooks.

Reliability (docs/reliability.md): checkpoints are staged and renamed into
place (``training.resume``), carry the run totals a resume continues from
(loss sum, ``trained_*`` counters, train time) and the run's settings, and
``save_total_limit`` counts complete checkpoints only; SIGTERM/SIGINT save a
checkpoint and stop (``training.signals``); a failed write is a ``SaveError``.
"""

import json
import math
import os
import shutil
import tempfile
import time
from typing import Dict, Optional

import paddle
from paddlenlp.trainer.trainer import TRAINING_ARGS_NAME
from paddlenlp.utils.log import logger

from .. import adapters as adapter_api
from ..data.global_batches import (
    GLOBAL_TOKENS_KEY,
    GlobalBatchSampler,
    GlobalTokensCollator,
    GlobalTokensView,
    label_token_counts,
)

# CHECKPOINT_COMPLETE_NAME is written last into every checkpoint: one without it was cut short
# (the run died while saving) and must not be resumed from.  Re-exported here for training.run.
from ..config.checkpoints import CHECKPOINT_COMPLETE_NAME, RESOLVED_CONFIG_NAME
from ..config.parse import ConfigError
from ..integrations.sharding import slice_aware_decay
from ..integrations.trainer import TrainerBoundary, checkpoint_dir
from ..adapters.pp_stage import save_stage_weights
from .console import current
from .errors import SaveError, TrainingInterrupted
from .loss import global_token_loss, shifts_labels_itself, token_mean_loss
from .moe_aux import add_aux_loss, prepare_forward
from .rank_counts import TokenAccuracy, sum_over_ranks
from .resume import (
    clean_stale_staging,
    last_checkpoint,
    publish_checkpoint,
    read_run_totals,
    resume_command,
    rotate_checkpoints,
    save_failure_message,
    staging_root,
    write_run_totals,
)
from .signals import InterruptCallback, StopRequest, stop_on_signals

__all__ = ["CHECKPOINT_COMPLETE_NAME", "FinetuneTrainer", "TokenAccuracy", "staged_write"]

REAL_TOKENS_KEY = "real_tokens"


class FinetuneTrainer(TrainerBoundary):
    def __init__(self, *args, adapter_config=None, neftune_hook=None, weights_io=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.adapter_config = adapter_config
        # object with save(model, dir) / load(model, dir) that owns the saved weights (prefix.io.PrefixCheckpointIO)
        self.weights_io = weights_io
        self.neftune_hook = neftune_hook
        # Integer attributes named trained_* are run totals (subclasses add their own, e.g. DPO's
        # trained_pairs): summed over ranks into each checkpoint and restored on resume.
        self.trained_tokens = 0
        self.trained_supervised_tokens = 0
        self.train_start_time: Optional[float] = None
        self.train_time_before = 0.0  # seconds trained before the checkpoint this run resumed from
        self.train_time_s = 0.0  # whole run, resumed parts included (set when train() returns)
        self._totals_at_checkpoint = None
        # callables(checkpoint_dir, state) that add files to each checkpoint before it is marked complete
        self.checkpoint_extras = []
        self.eval_accuracy = TokenAccuracy()
        self.moe_aux_log = None  # training.moe_aux.MoEAuxLog on MoE rows with an aux loss or a bias update

    def progress_metrics(self) -> Dict[str, str]:
        """Log key -> console label of this trainer's own metrics on each progress line (an alignment trainer's)."""
        return {}

    def accuracy_metric(self) -> Optional[str]:
        """The eval metric (without "eval_") the console's eval line shows as the accuracy: token accuracy."""
        return "accuracy"

    def console_line(self, text: str) -> None:
        """TrainerBoundary's hook: the line goes to the run's console (training/console.py)."""
        current().line(text)

    # -- data order -------------------------------------------------------
    def label_counts(self, dataset):
        """Label tokens of every training item (the global batch's N); DPO, which has no labels, overrides."""
        return label_token_counts(dataset)

    def get_train_dataloader(self):
        """One global order and one normalization (data/global_batches.py) for map-style training sets.

        The global batches depend only on the seed and per_device x accumulation x data ranks, and
        every micro-batch carries its global batch's label-token count.  A streamed (lazy) set keeps
        PaddleNLP's loader: its order is the file's, sharded over ranks.
        """
        dataset = self.train_dataset
        if dataset is None or isinstance(dataset, paddle.io.IterableDataset) or not hasattr(dataset, "__len__"):
            return super().get_train_dataloader()
        a = self.args
        sampler = GlobalBatchSampler(
            dataset,
            a.per_device_train_batch_size,
            a.gradient_accumulation_steps,
            a.dataset_world_size,
            a.dataset_rank,
            a.seed,
            a.dataloader_drop_last,
            counts=lambda: self.label_counts(dataset),
        )
        return paddle.io.DataLoader(
            GlobalTokensView(dataset),
            batch_sampler=sampler,
            collate_fn=GlobalTokensCollator(self.data_collator),
            num_workers=a.dataloader_num_workers,
        )

    def create_optimizer(self, lr_scheduler=None):
        # Sharding stage 3 steps parameters renamed "slice@" + name; PaddleNLP's weight-decay rule asks by
        # name and would leave every one of them undecayed (tests/test_sharding_sim.py).
        return slice_aware_decay(super().create_optimizer(lr_scheduler))

    # -- forward ---------------------------------------------------------
    def _count_trained(self, inputs, real) -> None:
        if real is not None:
            self.trained_tokens += int(real.sum())
        self.trained_supervised_tokens += int((inputs["labels"] != -100).sum())

    def training_pipeline_step(self, model, inputs):
        # pipeline parallel: PaddleNLP runs the micro-batch through the stages (training/pp_step.py), not
        # compute_loss; the token counters are kept here
        self._count_trained(inputs, inputs.pop(REAL_TOKENS_KEY, None))
        return super().training_pipeline_step(model, inputs)

    def compute_loss(self, model, inputs, return_outputs=False):
        real = inputs.pop(REAL_TOKENS_KEY, None)  # [batch, seq] 1 = example token
        if model.training:
            self._count_trained(inputs, real)
            if self.moe_aux_log is not None:  # MoE rows: the aux loss and expert load count real tokens only
                prepare_forward(model, real)
            if self.neftune_hook is not None:
                self.neftune_hook.set_token_lengths(
                    adapter_api.token_lengths_from_batch(position_ids=inputs.get("position_ids"), attention_mask=real)
                )
        global_tokens = inputs.pop(GLOBAL_TOKENS_KEY, None)  # [] N of this micro-batch's global batch
        if model.training and global_tokens is not None and not return_outputs:
            a = self.args
            loss = global_token_loss(
                model, inputs, int(global_tokens), a.dataset_world_size, a.gradient_accumulation_steps
            )
            return add_aux_loss(model, loss, self.moe_aux_log) if self.moe_aux_log is not None else loss
        own = "labels" in inputs and shifts_labels_itself(model)  # codegen: never hand it our shifted labels
        if (model.training or "labels" not in inputs) and not own:
            out = super().compute_loss(model, inputs, return_outputs=return_outputs)
            if model.training and self.moe_aux_log is not None:
                out = (
                    (add_aux_loss(model, out[0], self.moe_aux_log), out[1])
                    if return_outputs
                    else add_aux_loss(model, out, self.moe_aux_log)
                )
            return out
        labels = inputs["labels"]  # [batch, seq], already shifted: position i predicts labels[i]
        loss, outputs = (
            token_mean_loss(model, inputs) if own else super().compute_loss(model, inputs, return_outputs=True)
        )
        if model.training:
            return (loss, outputs) if return_outputs else loss
        self.eval_accuracy.update(logits_of(outputs), labels)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs, **kwargs):
        if self.moe_aux_log is not None:  # MoE rows: the aux loss and expert load since the last log
            self.moe_aux_log.fill(logs, self.state.global_step)
        super().log(logs, **kwargs)

    def global_token_counts(self):
        """(tokens, supervised tokens) trained, summed over data-parallel ranks."""
        return sum_over_ranks([self.trained_tokens, self.trained_supervised_tokens])

    def run_counters(self) -> dict:
        return {
            k: v
            for k, v in vars(self).items()
            if k.startswith("trained_") and isinstance(v, int) and not isinstance(v, bool)
        }

    def train_time_so_far(self) -> float:
        """Seconds of training of the whole run, the parts before a resume included."""
        return self.train_time_before + (time.time() - self.train_start_time if self.train_start_time else 0.0)

    def train(self, resume_from_checkpoint=None, ignore_keys_for_eval=None):
        """PaddleNLP's train, plus: ``True`` means the newest *complete* checkpoint; the run totals
        continue from the checkpoint; SIGTERM/SIGINT save a checkpoint and raise TrainingInterrupted."""
        self.train_start_time = time.time()
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no complete checkpoint in {self.args.output_dir} to resume from")
        elif resume_from_checkpoint is False:
            resume_from_checkpoint = None
        if self.args.should_save:
            for note in clean_stale_staging(self.args.output_dir):
                logger.info(note)
        self._restore_totals(resume_from_checkpoint)
        request = StopRequest()
        callback = InterruptCallback(request)
        self.add_callback(callback)
        try:
            with stop_on_signals(request):
                output = super().train(
                    resume_from_checkpoint=resume_from_checkpoint, ignore_keys_for_eval=ignore_keys_for_eval
                )
                if request and request.saved_step is None and self.state.global_step > 0:
                    self.save_checkpoint_now()  # the signal came after the last step's save point
                    request.saved_step = self.state.global_step
        finally:
            self.remove_callback(callback)
            self.train_time_s = self.train_time_so_far()
        if request:
            ckpt = checkpoint_dir(self.args.output_dir, request.saved_step) if request.saved_step else None
            raise TrainingInterrupted(request.signum, ckpt, resume_command(ckpt) if ckpt else "")
        return output

    def _restore_totals(self, checkpoint) -> None:
        """Loss sum, counters and train time of the run up to ``checkpoint`` (run_totals.json)."""
        try:
            totals = read_run_totals(checkpoint if isinstance(checkpoint, str) else None)
        except ValueError as e:  # a damaged checkpoint is bad input (exit 2), like an incomplete one
            raise ConfigError([f"resume_from_checkpoint: {e}; resume from another checkpoint"]) from e
        if totals is None:
            if checkpoint:
                logger.warning(
                    f"{checkpoint} has no run totals (older paddlenlp_ext): train_loss, token counts "
                    "and train time count the resumed steps only"
                )
            return
        self.restore_loss_sum(totals.get("loss_sum", 0.0))
        self.train_time_before = float(totals.get("train_time_s", 0.0))
        first = paddle.distributed.get_rank() == 0  # totals are global: one rank carries them
        for name, value in totals.get("counters", {}).items():
            setattr(self, name, int(value) if first else 0)
        logger.info(f"resuming run totals from {checkpoint}: {json.dumps(totals)}")

    def on_evaluation_start(self) -> None:
        self.eval_accuracy.reset()

    def extra_eval_metrics(self, prefix: str) -> dict:
        accuracy = self.eval_accuracy.compute()
        # logged, and used by metric_for_best_model "accuracy" (PaddleNLP's compute_metrics)
        return {} if accuracy is None else {f"{prefix}_accuracy": accuracy}

    def evaluate(self, *args, **kwargs):
        metrics = super().evaluate(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", "eval")
        loss = metrics.get(f"{prefix}_loss")
        if loss is not None:
            metrics[f"{prefix}_perplexity"] = math.exp(min(loss, 700.0))
        return metrics

    # -- saving and resuming (hooks of TrainerBoundary) -------------------
    def owns_saving(self) -> bool:
        # Full fine-tuning with unified checkpoints / sharding stage 1 uses PaddleNLP's own formats.
        return (
            self.weights_io is not None
            or self.adapter_config is not None
            or not (self.args.unified_checkpoint or self.args.should_save_sharding_stage1_model)
        )

    def save_weights(self, output_dir: str) -> None:
        """Write into a staging directory next to the files, then move each file into place with
        os.replace: a run killed while saving leaves the previous files (checkpoint or final
        adapter/weights) whole, never a half-written one.  A failed write of the final weights
        is a SaveError (a checkpoint's is reported by checkpoint_save_failed)."""
        try:
            staged_write(output_dir, self._write_weights)
        except OSError as e:
            if os.path.basename(os.path.normpath(output_dir)).startswith("checkpoint-"):
                raise
            raise SaveError(save_failure_message(output_dir, e, self.args.output_dir, is_checkpoint=False)) from e

    def save_foreign(self, output_dir: str, write) -> None:
        # PaddleNLP's unified-checkpoint writer: the final weights are staged too in a single
        # process.  With several processes every rank may write its own files (and with
        # async_save they arrive later), so those saves stay in place.
        is_checkpoint = os.path.basename(os.path.normpath(output_dir)).startswith("checkpoint-")
        if is_checkpoint or self.args.world_size > 1 or "async_save" in (self.args.unified_checkpoint_config or ""):
            return write(output_dir)
        staged_write(output_dir, write)

    def _write_weights(self, output_dir: str) -> None:
        logger.info(f"Saving {'adapter' if self.adapter_config else 'model'} to {output_dir}")
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(output_dir)
        paddle.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.weights_io is not None:  # e.g. a prefix: its own files only
            self.weights_io.save(self.model, output_dir)
        elif self.adapter_config is not None:
            adapter_api.save_adapter(self.model, self.adapter_config, output_dir)
            # the base model's config travels with the adapter (merge checks model_type)
            self.model.config.save_pretrained(output_dir)
        elif self.args.pipeline_parallel_degree > 1:
            # every stage writes its own layers; this one (the first) also the config and the whole index
            save_stage_weights(self.model, output_dir)
        else:
            # under tensor parallel every rank joins the gather (join_weights_gather); this one writes
            self.model.save_pretrained(
                output_dir,
                safe_serialization=True,
                max_shard_size="4GB",
                merge_tensor_parallel=self.args.tensor_parallel_degree > 1,
            )

    def join_weights_gather(self, output_dir: str) -> None:
        """A tensor-parallel rank that writes nothing (or a later pipeline stage): the collective half of
        ``_write_weights``.

        ``save_adapter`` gathers split adapter tensors to the writer (paddlenlp_ext/parallel) and
        ``save_pretrained(merge_tensor_parallel=True, is_main_process=False)`` gathers the model's;
        both write only on the writer, so the checkpoint holds the complete weights, not rank 0's shard.
        """
        if self.weights_io is not None:
            return  # prefix tuning refuses tensor parallel at config time
        if self.adapter_config is not None:
            adapter_api.save_adapter(self.model, self.adapter_config, output_dir)
        elif self.args.pipeline_parallel_degree > 1:
            save_stage_weights(self.model, output_dir)  # a later stage: its own layers' files
        else:
            self.model.save_pretrained(
                output_dir,
                safe_serialization=True,
                max_shard_size="4GB",
                merge_tensor_parallel=True,
                is_main_process=False,
            )

    def checkpoint_staging(self, final: str) -> Optional[str]:
        # Several processes (each writes its own files, no barrier after) and async saves (files
        # arrive later) write in place; the marker still tells complete from cut short.
        if self.args.world_size > 1 or "async_save" in (self.args.unified_checkpoint_config or ""):
            marker = os.path.join(final, CHECKPOINT_COMPLETE_NAME)
            if self.args.should_save and os.path.isfile(marker):
                os.remove(marker)  # rewritten in place: incomplete until marked again
            return None
        root = staging_root(final)
        shutil.rmtree(root, ignore_errors=True)
        return root

    def before_checkpoint(self) -> None:
        # every rank: the counters are summed over ranks (a collective), written by the main process
        names = sorted(self.run_counters())
        self._totals_at_checkpoint = {
            "global_step": self.state.global_step,
            "loss_sum": self.loss_sum(),
            "train_time_s": round(self.train_time_so_far(), 3),
            "counters": dict(zip(names, sum_over_ranks([getattr(self, n) for n in names]))),
        }

    def on_checkpoint_written(self, written: str, final: str) -> None:
        for extra in self.checkpoint_extras:
            extra(written, self.state)
        # the settings this checkpoint was trained with: a resume under others is refused (config.resume)
        resolved = os.path.join(self.args.output_dir, RESOLVED_CONFIG_NAME)
        if os.path.isfile(resolved):
            shutil.copyfile(resolved, os.path.join(written, RESOLVED_CONFIG_NAME))
        if self._totals_at_checkpoint is not None:
            write_run_totals(written, self._totals_at_checkpoint)
        with open(os.path.join(written, CHECKPOINT_COMPLETE_NAME), "w") as f:
            f.write(f"global_step {self.state.global_step}\n")
        if written != final:
            publish_checkpoint(written, final)
        for path in rotate_checkpoints(
            self.args.output_dir, self.args.save_total_limit, self.state.best_model_checkpoint
        ):
            logger.info(f"Deleted older checkpoint {path} (save_total_limit={self.args.save_total_limit})")

    def checkpoint_save_failed(self, final: str, staging: Optional[str], error: OSError) -> Exception:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        return SaveError(save_failure_message(final, error, self.args.output_dir, is_checkpoint=True))

    def amp_excluded_layers(self, model) -> list:
        # quantized bases keep fp32 scales / code books under O2 (their codes are integers anyway)
        from ..models.quantize import amp_excluded_layers

        return amp_excluded_layers(model)

    def load_weights(self, resume_from_checkpoint) -> bool:
        if self.adapter_config is None and self.weights_io is None:
            # Our full-model checkpoints are safetensors (PaddleNLP's loader wants model_state.pdparams).
            if (
                resume_from_checkpoint
                and not isinstance(resume_from_checkpoint, bool)
                and safetensors_files(str(resume_from_checkpoint))
            ):
                self._load_full_safetensors(str(resume_from_checkpoint))
                return True
            return False
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            resume_from_checkpoint = last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No checkpoint found in {self.args.output_dir} to resume from")
        if resume_from_checkpoint and self.weights_io is not None:
            self.weights_io.load(self.model, str(resume_from_checkpoint))
            logger.info(f"Loaded weights from {resume_from_checkpoint}")
        elif resume_from_checkpoint:
            adapter_api.load_adapter_weights(self.model, resume_from_checkpoint)
            logger.info(f"Loaded adapter weights from {resume_from_checkpoint}")
        return True

    def _load_full_safetensors(self, directory: str):
        """Load this process's weights tensor by tensor (a pipeline stage reads only its own layers'
        tensors, never the whole checkpoint)."""
        from safetensors import safe_open

        own = self.model.state_dict()
        where = {}  # name -> file, from the headers only
        for path in safetensors_files(directory):
            with safe_open(path, "np") as f:
                where.update({name: path for name in f.keys() if name in own})
        missing = sorted(set(own) - set(where))
        if missing:
            raise ValueError(f"checkpoint {directory} lacks {len(missing)} weights, e.g. {missing[:3]}")
        for path in sorted(set(where.values())):
            with safe_open(path, "np") as f:
                for name in (n for n, p in where.items() if p == path):
                    own[name].set_value(paddle.to_tensor(f.get_tensor(name)).astype(own[name].dtype))
        logger.info(f"Loaded model weights from {directory}")


def staged_write(output_dir: str, write) -> None:
    """``write(staging)`` into a fresh directory inside ``output_dir``, then move each file into
    place with ``os.replace`` (atomic per file) and drop shards the new index no longer names.
    An exception or a kill during ``write`` leaves ``output_dir``'s previous files untouched."""
    os.makedirs(output_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".saving-", dir=output_dir)
    try:
        write(staging)
        before = set(safetensors_files(output_dir))
        for name in sorted(os.listdir(staging)):
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        for stale in before - set(safetensors_files(output_dir)):
            os.remove(stale)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def logits_of(outputs):
    """The logits of a PaddleNLP causal-LM output: a dict/ModelOutput or a (loss, logits, ...) tuple."""
    if isinstance(outputs, dict):
        return outputs["logits"]
    return outputs[1] if isinstance(outputs, (tuple, list)) else outputs.logits


def safetensors_files(directory: str):
    """Weight files of a safetensors checkpoint directory (single file or index + shards)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(directory, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    single = os.path.join(directory, "model.safetensors")
    return [single] if os.path.isfile(single) else []
