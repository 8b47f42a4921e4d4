"""PaddleNLP Trainer with adapter-aware saving, token accounting and NEFTune lengths.

The trainer receives built objects (model with adapters applied, datasets,
collator); it knows adapters only through the ``adapters`` save/load API and
PaddleNLP's private Trainer methods only through
``integrations.trainer.TrainerBoundary``'s public hooks.
"""

import json
import math
import os
import shutil
import tempfile
import time
from typing import Optional

import paddle
from paddlenlp.trainer.trainer import TRAINING_ARGS_NAME
from paddlenlp.utils.log import logger

from .. import adapters as adapter_api
from ..integrations.trainer import TrainerBoundary, last_checkpoint

REAL_TOKENS_KEY = "real_tokens"
# Written last into every checkpoint: a checkpoint without it was cut short
# (the run died while saving) and must not be resumed from.
CHECKPOINT_COMPLETE_NAME = "CHECKPOINT_COMPLETE"


class FinetuneTrainer(TrainerBoundary):
    def __init__(self, *args, adapter_config=None, neftune_hook=None, weights_io=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.adapter_config = adapter_config
        # object with save(model, dir) / load(model, dir) that owns the saved weights (prefix.io.PrefixCheckpointIO)
        self.weights_io = weights_io
        self.neftune_hook = neftune_hook
        self.trained_tokens = 0
        self.trained_supervised_tokens = 0
        self.train_start_time: Optional[float] = None
        # callables(checkpoint_dir, state) that add files to each checkpoint before it is marked complete
        self.checkpoint_extras = []
        self.eval_accuracy = TokenAccuracy()

    # -- forward ---------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False):
        real = inputs.pop(REAL_TOKENS_KEY, None)  # [batch, seq] 1 = example token
        if model.training:
            if real is not None:
                self.trained_tokens += int(real.sum())
            self.trained_supervised_tokens += int((inputs["labels"] != -100).sum())
            if self.neftune_hook is not None:
                self.neftune_hook.set_token_lengths(
                    adapter_api.token_lengths_from_batch(
                        position_ids=inputs.get("position_ids"), attention_mask=real
                    )
                )
        if model.training or "labels" not in inputs:
            return super().compute_loss(model, inputs, return_outputs=return_outputs)
        labels = inputs["labels"]  # [batch, seq], already shifted: position i predicts labels[i]
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
        self.eval_accuracy.update(logits_of(outputs), labels)
        return (loss, outputs) if return_outputs else loss

    def global_token_counts(self):
        """(tokens, supervised tokens) trained, summed over data-parallel ranks."""
        return sum_over_ranks([self.trained_tokens, self.trained_supervised_tokens])

    def train(self, *args, **kwargs):
        self.train_start_time = time.time()
        return super().train(*args, **kwargs)

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
        return self.weights_io is not None or self.adapter_config is not None or not (
            self.args.unified_checkpoint or self.args.should_save_sharding_stage1_model)

    def save_weights(self, output_dir: str) -> None:
        """Write into a staging directory next to the files, then move each file into place with
        os.replace: a run killed while saving leaves the previous files (checkpoint or final
        adapter/weights) whole, never a half-written one."""
        staged_write(output_dir, self._write_weights)

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
        else:
            self.model.save_pretrained(output_dir, safe_serialization=True, max_shard_size="4GB")

    def on_checkpoint_written(self, checkpoint_dir: str) -> None:
        for extra in self.checkpoint_extras:
            extra(checkpoint_dir, self.state)
        with open(os.path.join(checkpoint_dir, CHECKPOINT_COMPLETE_NAME), "w") as f:
            f.write(f"global_step {self.state.global_step}\n")

    def amp_excluded_layers(self, model) -> list:
        # quantized bases keep fp32 scales / code books under O2 (their codes are integers anyway)
        from ..quant import amp_excluded_layers

        return amp_excluded_layers(model)

    def load_weights(self, resume_from_checkpoint) -> bool:
        if self.adapter_config is None and self.weights_io is None:
            # Our full-model checkpoints are safetensors (PaddleNLP's loader wants model_state.pdparams).
            if resume_from_checkpoint and not isinstance(resume_from_checkpoint, bool) \
                    and safetensors_files(str(resume_from_checkpoint)):
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
        from safetensors.numpy import load_file

        state = {}
        for path in safetensors_files(directory):
            state.update(load_file(path))
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"checkpoint {directory} lacks {len(missing)} weights, e.g. {missing[:3]}")
        for name, tensor in own.items():
            tensor.set_value(paddle.to_tensor(state[name]).astype(tensor.dtype))
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


class TokenAccuracy:
    """Next-token accuracy over label positions, accumulated batch by batch.

    As PaddleNLP's SFT ``compute_metrics`` (argmax of the logits == label where label != -100),
    but only two integers are kept, not the predictions of the whole eval set.  Summed over
    data-parallel ranks.  Worked example: logits argmax [[3, 7, 1]] with labels
    [[-100, 7, 2]] -> 1 correct of 2 label positions -> 0.5.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.correct, self.total = 0, 0

    def update(self, logits, labels):
        # logits [batch, seq, vocab] -> predictions [batch, seq]; labels [batch, seq]
        with paddle.no_grad():
            preds = paddle.argmax(logits, axis=-1).astype(labels.dtype)
            mask = labels != -100
            self.correct += int(paddle.logical_and(preds == labels, mask).astype("int64").sum())
            self.total += int(mask.astype("int64").sum())

    def compute(self):
        correct, total = sum_over_ranks([self.correct, self.total])
        return correct / total if total else None


def sum_over_ranks(counts):
    """Integer counters summed over data-parallel ranks (unchanged in a single process)."""
    if paddle.distributed.get_world_size() > 1:
        t = paddle.to_tensor(counts, dtype="int64")
        paddle.distributed.all_reduce(t)
        counts = [int(x) for x in t.numpy()]
    return list(counts)


def safetensors_files(directory: str):
    """Weight files of a safetensors checkpoint directory (single file or index + shards)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(directory, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    single = os.path.join(directory, "model.safetensors")
    return [single] if os.path.isfile(single) else []
