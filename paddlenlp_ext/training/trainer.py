"""PaddleNLP Trainer with adapter-aware saving, token accounting and NEFTune lengths.

The trainer receives built objects (model with adapters applied, datasets,
collator); it knows adapters only through the ``adapters`` save/load API.
"""

import math
import os
import time
from typing import Optional

import paddle
from paddlenlp.trainer import Trainer
from paddlenlp.trainer.trainer import TRAINING_ARGS_NAME
from paddlenlp.utils.log import logger

from .. import adapters as adapter_api

REAL_TOKENS_KEY = "real_tokens"
# Written last into every checkpoint: a checkpoint without it was cut short
# (the run died while saving) and must not be resumed from.
CHECKPOINT_COMPLETE_NAME = "CHECKPOINT_COMPLETE"


class FinetuneTrainer(Trainer):
    def __init__(self, *args, adapter_config=None, neftune_hook=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.adapter_config = adapter_config
        self.neftune_hook = neftune_hook
        self.trained_tokens = 0
        self.trained_supervised_tokens = 0
        self.train_start_time: Optional[float] = None
        self._log_history = []
        # callables(checkpoint_dir) that add files to each checkpoint before it is marked complete
        self.checkpoint_extras = []

    def log(self, logs, **kwargs):
        # PaddleNLP empties state.log_history on every log call; keep it, so
        # trainer_state.json (and checkpoints) carry the whole history.
        super().log(logs, **kwargs)
        self._log_history.append({**logs, "step": self.state.global_step})
        self.state.log_history = list(self._log_history)

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

    def _load_full_safetensors(self, directory: str):
        """Our full-model checkpoints are safetensors (PaddleNLP's loader wants model_state.pdparams)."""
        from safetensors.numpy import load_file

        state = {}
        for path in _safetensors_files(directory):
            state.update(load_file(path))
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"checkpoint {directory} lacks {len(missing)} weights, e.g. {missing[:3]}")
        for name, tensor in own.items():
            tensor.set_value(paddle.to_tensor(state[name]).astype(tensor.dtype))
        logger.info(f"Loaded model weights from {directory}")

    # -- saving ----------------------------------------------------------
    def _save(self, output_dir: Optional[str] = None, state_dict=None, merge_tensor_parallel=False):
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.adapter_config is None and (self.args.unified_checkpoint or self.args.should_save_sharding_stage1_model):
            # PaddleNLP's own sharded/unified formats
            return super()._save(output_dir, state_dict, merge_tensor_parallel)
        if not self.args.should_save:
            return
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

    def _save_checkpoint(self, model, metrics=None):
        from paddlenlp.trainer.trainer_utils import PREFIX_CHECKPOINT_DIR

        super()._save_checkpoint(model, metrics)
        ckpt = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(ckpt):
            for extra in self.checkpoint_extras:
                extra(ckpt, self.state)
            with open(os.path.join(ckpt, CHECKPOINT_COMPLETE_NAME), "w") as f:
                f.write(f"global_step {self.state.global_step}\n")

    def _load_from_checkpoint(self, resume_from_checkpoint=None):
        if self.adapter_config is None:
            if resume_from_checkpoint and _safetensors_files(str(resume_from_checkpoint)):
                return self._load_full_safetensors(str(resume_from_checkpoint))
            return super()._load_from_checkpoint(resume_from_checkpoint)
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            from paddlenlp.trainer.trainer_utils import get_last_checkpoint

            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No checkpoint found in {self.args.output_dir} to resume from")
        if resume_from_checkpoint:
            adapter_api.load_adapter_weights(self.model, resume_from_checkpoint)
            logger.info(f"Loaded adapter weights from {resume_from_checkpoint}")


def _safetensors_files(directory: str):
    """Weight files of a safetensors checkpoint directory (single file or index + shards)."""
    import json

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(directory, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    single = os.path.join(directory, "model.safetensors")
    return [single] if os.path.isfile(single) else []
