"""PaddleNLP Trainer with adapter-aware saving, token accounting and NEFTune lengths.

The trainer receives built objects (model with adapters applied, datasets,
collator); it knows adapters only through the ``adapters`` save/load API and
PaddleNLP's private Trainer methods only through
``integrations.trainer.TrainerBoundary``'s public hooks.
"""

import json
import math
import os
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
    def __init__(self, *args, adapter_config=None, neftune_hook=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.adapter_config = adapter_config
        self.neftune_hook = neftune_hook
        self.trained_tokens = 0
        self.trained_supervised_tokens = 0
        self.train_start_time: Optional[float] = None
        # callables(checkpoint_dir, state) that add files to each checkpoint before it is marked complete
        self.checkpoint_extras = []

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
        return super().compute_loss(model, inputs, return_outputs=return_outputs)

    def global_token_counts(self):
        """(tokens, supervised tokens) trained, summed over data-parallel ranks."""
        counts = [self.trained_tokens, self.trained_supervised_tokens]
        if paddle.distributed.get_world_size() > 1:
            t = paddle.to_tensor(counts, dtype="int64")
            paddle.distributed.all_reduce(t)
            counts = [int(x) for x in t.numpy()]
        return counts

    def train(self, *args, **kwargs):
        self.train_start_time = time.time()
        return super().train(*args, **kwargs)

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
        return self.adapter_config is not None or not (
            self.args.unified_checkpoint or self.args.should_save_sharding_stage1_model)

    def save_weights(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        logger.info(f"Saving {'adapter' if self.adapter_config else 'model'} to {output_dir}")
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(output_dir)
        paddle.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.adapter_config is not None:
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
        if self.adapter_config is None:
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
        if resume_from_checkpoint:
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


def safetensors_files(directory: str):
    """Weight files of a safetensors checkpoint directory (single file or index + shards)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(directory, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    single = os.path.join(directory, "model.safetensors")
    return [single] if os.path.isfile(single) else []
