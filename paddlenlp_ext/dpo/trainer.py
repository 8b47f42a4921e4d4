"""DPOTrainer: preference training on the batch contract of :mod:`paddlenlp_ext.dpo`.

One step: the policy forward (no labels) -> per-answer log-probs
(``logps.pair_logps``) -> the reference's log-probs -> ``losses.preference_loss``
-> ``combine_losses`` with the SFT term.  The reference (``dpo.alignment.AlignmentTrainer``'s
modes) is the base under the adapters, a frozen copy (full fine-tuning), or none for
``reference_free`` (and the reference-free or / simpo): the reference log-probs are 0.

Metrics (PaddleNLP's names): rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins, logps/chosen, logps/rejected,
``{loss_type}_loss``, sft_loss.  Training: averaged over every micro-batch
since the previous log (so over gradient accumulation too) and over the
data-parallel ranks and added to the
Trainer's log at each logging step (so they reach ``trainer_state.json``).
Evaluation: averaged over the eval set, with the ``eval_`` prefix, part of the
evaluation's metrics (so ``metric_for_best_model`` can be e.g.
``rewards/accuracies``).
"""

from __future__ import annotations

import numpy as np
from paddlenlp.utils.log import logger

from ..data.global_batches import GLOBAL_TOKENS_KEY
from .alignment import AlignmentTrainer
from .losses import (
    REFERENCE_FREE_ONLY,
    canonical_loss_type,
    combine_losses,
    pair_metrics,
    preference_loss,
    sft_nll,
    uses_average_logps,
)


def reference_mode(dpo_config, adapter_config) -> str:
    """ "none" (reference_free / or / simpo), "adapters" (the base under the adapters) or "copy"."""
    if dpo_config.reference_free or canonical_loss_type(dpo_config.loss_type) in REFERENCE_FREE_ONLY:
        return "none"
    return "adapters" if adapter_config is not None else "copy"


class DPOTrainer(AlignmentTrainer):
    PROGRESS_METRICS = {"rewards/accuracies": "reward acc"}
    ACCURACY_METRIC = "rewards/accuracies"

    def __init__(self, *args, dpo_config, **kwargs):
        super().__init__(*args, alignment_config=dpo_config, **kwargs)
        self.loss_type = canonical_loss_type(dpo_config.loss_type)
        self.normalize = bool(dpo_config.normalize_logps) or uses_average_logps(self.loss_type)
        logger.info(
            f"DPO: loss_type {self.loss_type}, reference {self.reference}, "
            f"{'mean' if self.normalize else 'summed'} answer log-probs"
        )

    def reference_mode(self) -> str:
        return reference_mode(self.alignment_config, self.adapter_config)

    def compute_loss(self, model, inputs, return_outputs=False):
        # [2]: pairs and chosen tokens of the whole global batch (data/global_batches.py), while training
        global_counts = inputs.pop(GLOBAL_TOKENS_KEY, None)
        o = self.alignment_config
        training = model.training
        real_tokens = self._policy_real_tokens(model, inputs)
        if training:
            self._count_trained(inputs)
        ref_chosen, ref_rejected = self._reference_logps(model, inputs)
        forward = self._forward(model, inputs, real_tokens)  # the policy: its router aux loss only, never the ref's
        chosen, rejected, chosen_tokens, rejected_tokens = self._answer_logps(forward, inputs)  # [N] each
        sft = sft_nll(chosen, chosen_tokens)  # [] mean NLL of the chosen tokens
        if self.normalize:
            chosen, rejected = chosen / chosen_tokens.clip(min=1.0), rejected / rejected_tokens.clip(min=1.0)
            if ref_chosen is not None:
                ref_chosen = ref_chosen / chosen_tokens.clip(min=1.0)
                ref_rejected = ref_rejected / rejected_tokens.clip(min=1.0)
        pref, chosen_rewards, rejected_rewards = preference_loss(
            self.loss_type,
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            beta=o.beta,
            label_smoothing=o.label_smoothing,
            simpo_gamma=o.simpo_gamma,
            dpop_lambda=o.dpop_lambda,
            reference_free=o.reference_free,
        )
        if training and global_counts is not None:
            # the global batch's pair mean and chosen-token mean (not a mean of per-micro-batch means):
            # after PaddleNLP's /accumulation and data parallel's mean over ranks, one process's gradient
            pairs, chosen_total = (int(x) for x in np.asarray(global_counts.numpy()).reshape([-1]))
            scale = float(self.args.dataset_world_size * self.args.gradient_accumulation_steps)
            loss = pref.astype("float32").sum() * (o.pref_loss_ratio * scale / max(pairs, 1))
            if o.sft_loss_ratio:
                loss = loss + sft * chosen_tokens.sum() * (o.sft_loss_ratio * scale / max(chosen_total, 1))
        else:
            loss = combine_losses(pref, sft, o.pref_loss_ratio, o.sft_loss_ratio)
        loss = self.with_router_aux(model, loss, real_tokens)
        metrics = pair_metrics(chosen_rewards, rejected_rewards, chosen, rejected, loss_type=self.loss_type)
        metrics[f"{self.loss_type}_loss"] = float(pref.astype("float32").mean()) * o.pref_loss_ratio
        metrics["sft_loss"] = float(sft)
        self.store_metrics(model, metrics)
        return (loss, {"logits": forward[0]}) if return_outputs else loss
