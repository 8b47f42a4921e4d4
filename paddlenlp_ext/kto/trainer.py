"""KTOTrainer: the alignment base's reference, forward and metric bookkeeping with the KTO loss.

One step: the reference log-probs of every example's completion and of its mismatched
completion (adapters disabled for LoRA, the frozen copy for full fine-tuning:
``AlignmentTrainer._reference_logps``) -> the policy's (one forward over the packed rows) -> the KL
reference point z0 (over this micro-batch's mismatched pairs, and over every data-parallel rank)
-> :func:`~paddlenlp_ext.kto.losses.kto_loss`.  The loss is the mean over the examples of the
global batch (as DPO's pair mean), so gradient accumulation and data parallel give the same
gradient as one big batch (z0 aside, which is per micro-batch as in TRL).

Metrics (logged at every logging step, averaged over micro-batches and ranks, ``eval_``
prefixed in evaluation): rewards/chosen, rewards/rejected, logps/chosen, logps/rejected,
loss/chosen, loss/rejected (chosen = desirable, rejected = undesirable examples), kl, kto_loss.
"""

from __future__ import annotations

from paddlenlp.utils.log import logger

from ..data.global_batches import GLOBAL_TOKENS_KEY
from ..dpo.alignment import AlignmentTrainer
from .losses import kl_reference_point, kto_loss, kto_metrics


class KTOTrainer(AlignmentTrainer):
    """trained_pairs counts examples (one pair row slot each); the reference is always there."""

    def __init__(self, *args, kto_config, **kwargs):
        super().__init__(*args, alignment_config=kto_config, **kwargs)
        self.loss_type = kto_config.loss_type  # one loss: the mode's name
        logger.info(
            f"KTO: reference {self.reference}, beta {kto_config.beta}, desirable_weight "
            f"{kto_config.desirable_weight}, undesirable_weight {kto_config.undesirable_weight}"
        )

    def compute_loss(self, model, inputs, return_outputs=False):
        global_counts = inputs.pop(GLOBAL_TOKENS_KEY, None)  # [2]: examples and completion tokens of the global batch
        labels = inputs.pop("kto_label")  # [N] 1 desirable, 0 undesirable
        o = self.alignment_config
        training = model.training
        real_tokens = self._policy_real_tokens(model, inputs)
        if training:
            self._count_trained(inputs)
        ref_logps, ref_kl_logps = self._reference_logps(model, inputs)  # [N] each, no gradient
        forward = self._forward(model, inputs, real_tokens)  # the policy: its router aux loss only, never the ref's
        logps, kl_logps, _, _ = self._answer_logps(forward, inputs)  # [N] each
        z0 = kl_reference_point(kl_logps, ref_kl_logps, reduce_over_ranks=True)  # []
        losses, rewards = kto_loss(
            logps,
            ref_logps,
            labels,
            z0,
            beta=o.beta,
            desirable_weight=o.desirable_weight,
            undesirable_weight=o.undesirable_weight,
        )  # [N], [N]
        loss = self.global_pair_mean(losses, global_counts if training else None)  # the global batch's example mean
        loss = self.with_router_aux(model, loss, real_tokens)  # + coef * aux on MoE rows (TRL's KTOTrainer)
        metrics = kto_metrics(losses, rewards, logps, labels, z0)
        metrics["kto_loss"] = float(losses.mean())
        self.store_metrics(model, metrics)
        return (loss, {"logits": forward[0]}) if return_outputs else loss
