"""RewardTrainer: the pairwise (Bradley-Terry) loss on last-token scores, the alignment base's bookkeeping.

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

from paddlenlp.utils.log import logger

from ..data.global_batches import GLOBAL_TOKENS_KEY
from ..dpo.alignment import AlignmentTrainer
from .head import pair_score_metrics, pairwise_loss, sequence_scores


class RewardTrainer(AlignmentTrainer):
    PROGRESS_METRICS = {"rewards/accuracies": "reward acc"}
    ACCURACY_METRIC = "rewards/accuracies"
    DISABLE_DROPOUT = False  # no reference forward to match
    OWN_WEIGHTS_IO = True  # reward.io.RewardCheckpointIO saves the score head with the weights

    def __init__(self, *args, reward_config, **kwargs):
        super().__init__(*args, alignment_config=reward_config, **kwargs)
        self.loss_type = reward_config.loss_type  # one loss: the mode's name
        logger.info("Reward model: pairwise loss -log sigmoid(r_chosen - r_rejected) on last-token scores")

    def reference_mode(self) -> str:
        return "none"

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
        # one value per pair: the logged means are over pairs
        self.store_metrics(model, pair_score_metrics(chosen, rejected), per_pair=True)
        return (loss, {"logits": scores}) if return_outputs else loss
