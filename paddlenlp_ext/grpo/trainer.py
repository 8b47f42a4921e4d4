"""GRPOTrainer: online generation, rewards and the clipped objective inside PaddleNLP's Trainer.

The training set is the prompts (:class:`~paddlenlp_ext.grpo.data.PromptDataset`), consumed in the
order of :mod:`paddlenlp_ext.data.global_batches` (the same global batches whatever the number of
ranks; each rank its slice).  ``compute_loss`` of one micro-batch of prompts:

1. G completions per prompt (:func:`~paddlenlp_ext.grpo.sampling.sample_groups`, seeded by
   (seed, prompt index, step));
2. rewards (:class:`~paddlenlp_ext.grpo.rewards.RewardSet`) and group advantages;
3. the prompt + completion sequences packed into rows (:func:`~paddlenlp_ext.grpo.rows.sequence_rows`),
   the reference's per-token log-probs (adapters off for LoRA, the frozen copy for full
   fine-tuning: DPOTrainer's reference modes; none when beta = 0), then the policy's;
4. :func:`~paddlenlp_ext.grpo.objective.token_losses`, summed and divided by the completion tokens of
   the global batch (all-reduced over the data-parallel ranks).

Metrics (averaged over ranks at every logging step, in trainer_state.json, the console and
VisualDL): reward, reward_std, rewards/<function>, kl, clip_ratio, completion_length.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import paddle
import paddle.nn.functional as F
from paddlenlp.utils.log import logger

from .. import adapters as adapter_api
from ..data.global_batches import GLOBAL_TOKENS_KEY
from ..dpo.logps import scored_logits
from ..dpo.trainer import MASK_KEYS, DPOTrainer
from ..training.trainer import FinetuneTrainer
from .objective import global_token_loss, group_advantages, step_metrics, token_losses
from .rows import sequence_rows
from .sampling import sample_groups

ROW_KEYS = ("input_ids", "position_ids") + MASK_KEYS


def token_logps(model, batch, temperature: float):
    """[T] float32 log-prob of every completion token of ``batch`` (rows.sequence_rows, as tensors)."""
    kw = {k: batch[k] for k in ROW_KEYS if batch.get(k) is not None}
    logits, index = scored_logits(model, kw, batch["logp_index"])  # [B, S, V] or [1, T, V]; [T]
    flat = logits.reshape([-1, logits.shape[-1]])  # [B*S, V]
    rows = paddle.gather(flat, index, axis=0).astype("float32") / float(temperature)  # [T, V]
    return -F.cross_entropy(rows, batch["logp_token"].unsqueeze(-1), reduction="none").squeeze(-1)  # [T]


class GRPOTrainer(DPOTrainer):
    def __init__(self, *args, grpo_config, rewards, flash_mask: bool, packed: bool, **kwargs):
        FinetuneTrainer.__init__(self, *args, **kwargs)  # DPOTrainer's own init reads the DPO loss keys
        self.dpo_config = grpo_config  # what the shared DPOTrainer methods read (ref_model_update_steps)
        self.grpo = grpo_config
        self.rewards = rewards
        self.flash_mask, self.packed = bool(flash_mask), bool(packed)
        self.loss_type = "grpo"
        self.trained_pairs = 0  # completions (the shared summary's count)
        self.trained_real_tokens = 0
        self.trained_prompts = 0
        mode = "none" if grpo_config.beta == 0 else "adapters" if self.adapter_config is not None else "copy"
        self._init_reference(mode)
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.eos_ids = [int(tok.eos_token_id)]
        logger.info(f"GRPO: {grpo_config.num_generations} completions per prompt, reference {self.reference}, "
                    f"beta {grpo_config.beta}, epsilon {grpo_config.epsilon}, rewards {rewards.names}")

    def label_counts(self, dataset):
        return np.zeros(len(dataset), dtype=np.int64)  # completion tokens are known only after generation

    def _row_batch(self, prompts, completions):
        o = self.grpo
        capacity = o.max_prompt_len + o.max_completion_length if self.packed else None
        rows = sequence_rows(prompts, completions, self.pad_id, capacity, self.flash_mask)
        return {k: (paddle.to_tensor(v) if isinstance(v, np.ndarray) else v) for k, v in rows.items()}

    def _reference_token_logps(self, model, batch) -> Optional[paddle.Tensor]:
        if self.reference == "none":
            return None
        with paddle.no_grad():
            if self.reference == "copy":
                return token_logps(self.ref_model, batch, self.grpo.temperature)
            was_training = model.training
            with adapter_api.adapters_disabled(model):
                model.eval()
                try:
                    return token_logps(model, batch, self.grpo.temperature)
                finally:
                    if was_training:
                        model.train()

    def compute_loss(self, model, inputs, return_outputs=False):
        inputs.pop(GLOBAL_TOKENS_KEY, None)  # zeros: the completion tokens are counted below
        o, dataset = self.grpo, self.train_dataset
        dataset = getattr(dataset, "dataset", dataset)
        indices = [int(i) for i in np.asarray(inputs["prompt_index"].numpy()).reshape([-1])]
        G = int(o.num_generations)
        self._maybe_sync_reference()
        prompts = [dataset.ids[i] for i in indices]
        completions = sample_groups(self.model, prompts, indices, group=G, step=self.state.global_step,
                                    seed=self.args.seed, max_new_tokens=o.max_completion_length,
                                    temperature=o.temperature, top_p=o.top_p, eos_ids=self.eos_ids, pad_id=self.pad_id)
        texts = [self.tokenizer.decode([t for t in c if t not in self.eos_ids], skip_special_tokens=True)
                 for c in completions]
        columns = {k: [v for v in vals for _ in range(G)] for k, vals in dataset.columns(indices).items()}
        prompt_texts = [dataset.texts[i] for i in indices for _ in range(G)]
        total, per_func = self.rewards(prompt_texts, texts, columns)  # [n*G], {name: [n*G]}
        advantages = group_advantages(total, G, scale=o.scale_rewards)  # [n*G]

        seq_prompts = [p for p in prompts for _ in range(G)]
        batch = self._row_batch(seq_prompts, completions)
        ref = self._reference_token_logps(model, batch)  # [T] or None
        logps = token_logps(model, batch, o.temperature)  # [T]
        adv = paddle.to_tensor(advantages)[batch["logp_segment"]]  # [T]
        losses, kl, clipped = token_losses(logps, logps.detach(), adv, ref, epsilon=o.epsilon, beta=o.beta)  # [T] each
        local_tokens = int(batch["logp_token"].shape[0])
        world = max(int(self.args.dataset_world_size), 1)
        # the global batch's completion tokens, KL sum and clipped tokens (token means independent of the layout)
        sums = np.asarray([local_tokens, float(kl.sum()) if kl is not None else 0.0,
                           float(clipped.astype("float32").sum())], dtype=np.float64)  # [3]
        if world > 1:
            both = paddle.to_tensor(sums)
            paddle.distributed.all_reduce(both)
            sums = both.numpy()
        global_tokens = int(round(sums[0]))
        loss = global_token_loss(losses, global_tokens, world)
        lengths = np.asarray([len(c) for c in completions], dtype=np.float64)
        metrics = step_metrics(total, per_func, G, sums[1] / sums[0] if kl is not None else None, sums[2] / sums[0],
                               lengths)
        self.trained_tokens += int(batch["input_ids"].shape[0] * batch["input_ids"].shape[1])
        self.trained_supervised_tokens += local_tokens
        self.trained_real_tokens += int(batch["num_real_tokens"])
        self.trained_pairs += len(completions)
        self.trained_prompts += len(indices)
        for key, value in metrics.items():  # every rank stores; DPOTrainer._averaged reduces over ranks
            self._stored["train"][key].append(value)
        return (loss, {"logits": None}) if return_outputs else loss

    def log(self, logs, **kwargs):
        if "loss" in logs:
            logs.update(self._averaged("train"))
        return FinetuneTrainer.log(self, logs, **kwargs)
