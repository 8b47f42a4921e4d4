"""RewardTrainer: the pairwise (Bradley-Terry) loss on last-token scores, DPO's bookkeeping.

One step: one forward of the decoder body over the (packed) pair rows -> the score head at every
answer's last token (``score_index``) -> ``-log sigmoid(r_chosen - r_rejected)`` per pair.  The loss
is the mean over the pairs of the GLOBAL batch (pair counts from ``data/global_batches.py``), so
gradient accumulation and data parallel give the gradient of one big batch, as DPO's pair mean.

Metrics (logged at every logging step, averaged over the pairs of every micro-batch since the previous
log and over ranks; ``eval_`` prefixed in evaluation, so the dev pair accuracy is exact): rewards/accuracies (chosen score > rejected), rewards/margins (chosen - rejected),
rewards/chosen, rewards/rejected (mean scores) -- DPO's names, so the console's final table and
``metric_for_best_model`` read them alike.  There is no reference model.
"""

from __future__ import annotations

from collections import defaultdict

from paddlenlp.utils.log import logger

from ..data.global_batches import GLOBAL_TOKENS_KEY
from ..dpo.trainer import DPOTrainer
from ..training.trainer import FinetuneTrainer
from .head import pair_score_metrics, pairwise_loss, sequence_scores


class RewardTrainer(DPOTrainer):
    def __init__(self, *args, reward_config, **kwargs):
        FinetuneTrainer.__init__(self, *args, **kwargs)  # DPOTrainer's own init builds a reference model
        if self.neftune_hook is not None:
            raise ValueError("RewardTrainer does not support neftune")
        self.dpo_config = reward_config  # what the shared DPOTrainer methods read (ref_model_update_steps)
        self.trained_pairs = 0
        self.trained_real_tokens = 0
        self.loss_type = "reward"
        self.normalize = False
        self.reference = "none"
        self.ref_model = None
        self._ref_synced_at = 0
        self._stored = defaultdict(lambda: defaultdict(list))
        logger.info("Reward model: pairwise loss -log sigmoid(r_chosen - r_rejected) on last-token scores")

    def compute_loss(self, model, inputs, return_outputs=False):
        global_counts = inputs.pop(GLOBAL_TOKENS_KEY, None)  # [2]: pairs and chosen tokens of the global batch
        training = model.training
        real_tokens = self._policy_real_tokens(model, inputs)
        if training:
            self._count_trained(inputs)
        # [2N]: chosen, rejected of each pair; on an MoE body its router aux loss is recorded (training)
        scores = sequence_scores(model, inputs, inputs["score_index"], real_tokens=real_tokens)
        pairs = scores.reshape([-1, 2])  # [N, 2]
        chosen, rejected = pairs[:, 0], pairs[:, 1]  # [N] each
        losses = pairwise_loss(chosen, rejected)  # [N]
        loss = self.global_pair_mean(losses, global_counts if training else None)  # the global batch's pair mean
        loss = self.with_router_aux(model, loss, real_tokens)  # + coef * aux on an MoE body
        split = "train" if training else "eval"
        for key, values in pair_score_metrics(chosen, rejected).items():  # every rank stores; _averaged reduces
            self._stored[split][key].extend(values)  # one value per pair: the logged means are over pairs
        return (loss, {"logits": scores}) if return_outputs else loss
