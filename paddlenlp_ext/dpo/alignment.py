"""AlignmentTrainer: what DPO, KTO, reward models and GRPO (and PPO) share on top of FinetuneTrainer.

* the reference model, in one of REFERENCE_MODES (as PaddleNLP's ``paddlenlp/trl/dpo_trainer.py``):

  - ``"adapters"``: the same model with its adapters switched off (``adapters.adapters_disabled``),
    under ``paddle.no_grad`` -- no weight copy;
  - ``"copy"`` (full fine-tuning): a frozen deep copy of the model taken before training, in eval mode --
    one more copy of the weights (no gradients, no optimizer state); ``ref_model_update_steps`` > 0 copies
    the policy's weights into it every N optimizer steps;
  - ``"none"``: no reference (reference-free DPO losses, reward models, GRPO with beta 0);

  each trainer says which through :meth:`AlignmentTrainer.reference_mode`;
* the policy forward on the scored positions only, its per-answer log-probs and the router aux loss of
  an MoE policy;
* metric storage: every micro-batch stores its metrics (:meth:`AlignmentTrainer.store_metrics`); each
  training log adds their means since the previous log, over the data-parallel ranks too (so they reach
  ``trainer_state.json``); an evaluation adds the eval set's means with the ``eval_`` prefix (so
  ``metric_for_best_model`` can name them);
* the global batch's pair (example, completion) mean of a per-pair loss (:meth:`global_pair_mean`), and the
  run totals ``trained_pairs`` / ``trained_real_tokens``;
* what the console shows: :attr:`PROGRESS_METRICS` (log keys on each progress line) and
  :attr:`ACCURACY_METRIC` (the eval line's accuracy), read by ``training.callbacks.ConsoleProgress``.

Each mode's trainer (``dpo.trainer.DPOTrainer``, ``kto.trainer.KTOTrainer``, ``reward.trainer.RewardTrainer``,
``grpo.trainer.GRPOTrainer``) subclasses this one with its own ``__init__`` (``super().__init__`` first) and
``compute_loss``.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Dict, Optional

import numpy as np
import paddle
import paddle.nn as nn
from paddlenlp.utils.log import logger

from .. import adapters as adapter_api
from ..training.moe_aux import add_aux_loss
from ..training.trainer import FinetuneTrainer
from .logps import pair_logps, scored_logits

REFERENCE_MODES = ("adapters", "copy", "none")
MASK_KEYS = ("attn_mask_startend_row_indices", "attention_mask")


def disable_dropout(model: nn.Layer) -> None:
    """As PaddleNLP's DPOTrainer (disable_dropout=True): dropout would make policy and reference differ."""
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, nn.Dropout):
            layer.p = 0.0


class AlignmentTrainer(FinetuneTrainer):
    #: log key -> console label, shown on each progress line after the learning rate (ConsoleProgress)
    PROGRESS_METRICS: Dict[str, str] = {}
    #: the eval metric (without "eval_") the console's eval line shows as the accuracy; None: none
    ACCURACY_METRIC: Optional[str] = None
    #: dropout off in the policy (a reference forward must see the same network); a reward model keeps it
    DISABLE_DROPOUT = True
    #: whether this trainer saves through a weights_io of its own (the reward model's score head)
    OWN_WEIGHTS_IO = False

    def __init__(self, *args, alignment_config, **kwargs):
        super().__init__(*args, **kwargs)
        if self.neftune_hook is not None or (self.weights_io is not None and not self.OWN_WEIGHTS_IO):
            raise ValueError(f"{type(self).__name__} does not support neftune or prefix tuning")
        self.alignment_config = alignment_config  # the mode's key group (RunConfig.alignment)
        # run totals (summed over ranks into each checkpoint): pairs / examples / completions, row tokens minus padding
        self.trained_pairs = 0
        self.trained_real_tokens = 0
        self._stored = defaultdict(lambda: defaultdict(list))  # split -> metric -> values since the last log
        self._init_reference(self.reference_mode())

    def reference_mode(self) -> str:
        """One of REFERENCE_MODES: by default the base under the adapters, or a frozen copy (full fine-tuning)."""
        return "adapters" if self.adapter_config is not None else "copy"

    def progress_metrics(self) -> Dict[str, str]:
        return dict(self.PROGRESS_METRICS)

    def accuracy_metric(self) -> Optional[str]:
        return self.ACCURACY_METRIC

    def _init_reference(self, mode: str) -> None:
        """The reference model of ``mode`` (REFERENCE_MODES), dropout off."""
        if mode not in REFERENCE_MODES:
            raise ValueError(f"reference mode {mode!r} is not one of {REFERENCE_MODES}")
        self.reference = mode
        if self.DISABLE_DROPOUT:
            disable_dropout(self.model)
        self.ref_model: Optional[nn.Layer] = None
        if self.reference == "copy":
            # frozen copy of the starting weights (same dtype as the policy's): + 1 x the weights in memory
            self.ref_model = copy.deepcopy(self.model)
            self.ref_model.eval()
            for p in self.ref_model.parameters():
                p.stop_gradient = True
        if self.alignment_config.ref_model_update_steps > 0 and self.reference != "copy":
            raise ValueError("ref_model_update_steps > 0 needs full fine-tuning (a reference copy to update)")
        self._ref_synced_at = 0

    def store_metrics(self, model, metrics: Dict[str, object], per_pair: bool = False) -> None:
        """Keep this micro-batch's metrics for the next training log (or the evaluation's means); every rank
        stores, ``_averaged`` reduces over ranks.  ``per_pair``: each value is a list with one entry per pair
        (the logged mean is then over pairs, not over micro-batches)."""
        split = "train" if model.training else "eval"
        for key, value in metrics.items():
            if per_pair:
                self._stored[split][key].extend(value)
            else:
                self._stored[split][key].append(value)

    # -- forward -----------------------------------------------------------
    @staticmethod
    def _forward(model, inputs, real_tokens=None):
        """(logits, index): lm_head only at the scored positions where the family allows it.  ``real_tokens``
        [B, S]: the policy's training forward on an MoE row, whose router aux loss is recorded (``logps``)."""
        kw = {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"]}
        for key in MASK_KEYS:
            if inputs.get(key) is not None:
                kw[key] = inputs[key]
                break
        return scored_logits(model, kw, inputs["logp_index"], real_tokens=real_tokens)  # [1, T, V] or [B, S, V]; [T]

    def _policy_real_tokens(self, model, inputs, pop: bool = True):
        """The batch's real tokens [B, S] when this is a training forward of an MoE row whose router aux loss
        (or expert load, for the bias update) the run keeps; else None.  ``pop``: taken out of ``inputs`` either
        way (no model input; GRPO's rollout rows are reused, so they keep it)."""
        real = inputs.pop("real_tokens", None) if pop else inputs.get("real_tokens")
        if not model.training or self.moe_aux_log is None:
            return None
        if real is None:  # a collator without it would leave the aux loss out silently
            raise ValueError(
                f"{type(self).__name__}: the training batch has no real_tokens [B, S], which the "
                "router aux loss of an MoE row needs (dpo/pair_rows.py and grpo/rows.py write it)"
            )
        return real

    def with_router_aux(self, model, loss, real_tokens):
        """``loss`` + ``router_aux_loss_coef * aux`` of the policy forward just run (MoE rows, training; as TRL's
        DPOTrainer / KTOTrainer add ``aux_loss_coef * aux_loss``), the aux loss and expert load logged;
        ``loss`` unchanged otherwise (no aux loss asked for, evaluation, a dense model)."""
        return loss if real_tokens is None else add_aux_loss(model, loss, self.moe_aux_log)

    @staticmethod
    def _answer_logps(forward, inputs):
        logits, index = forward
        return pair_logps(
            logits, index, inputs["logp_token"], inputs["logp_segment"], int(inputs["num_pairs"]), normalize=False
        )

    def _reference_logps(self, model, inputs):
        """(chosen sum [N], rejected sum [N]) of the reference, or (None, None)."""
        if self.reference == "none":
            return None, None
        with paddle.no_grad():
            if self.reference == "copy":
                chosen, rejected, _, _ = self._answer_logps(self._forward(self.ref_model, inputs), inputs)
                return chosen, rejected
            was_training = model.training
            with adapter_api.adapters_disabled(model):
                model.eval()
                try:
                    chosen, rejected, _, _ = self._answer_logps(self._forward(model, inputs), inputs)
                finally:
                    if was_training:
                        model.train()
            return chosen, rejected

    def _maybe_sync_reference(self) -> None:
        n, step = self.alignment_config.ref_model_update_steps, self.state.global_step
        if n > 0 and self.ref_model is not None and step > 0 and step % n == 0 and step != self._ref_synced_at:
            self.ref_model.set_state_dict(self.model.state_dict())
            self._ref_synced_at = step
            logger.info(f"DPO: reference model updated with the policy's weights at step {step}")

    def label_counts(self, dataset):
        """[n, 2]: pairs and chosen answer tokens of every row, so the global batch carries both totals."""
        counts = np.zeros((len(dataset), 2), dtype=np.int64)
        for i in range(len(dataset)):
            row = dataset[i]
            counts[i] = (int(row["num_pairs"]), int((np.asarray(row["logp_segment"]) % 2 == 0).sum()))
        return counts

    def _count_trained(self, inputs) -> None:
        """A training micro-batch: sync the reference if due, count its tokens and pairs."""
        self._maybe_sync_reference()
        self.trained_tokens += int(inputs["input_ids"].shape[0] * inputs["input_ids"].shape[1])
        self.trained_supervised_tokens += int(inputs["logp_token"].shape[0])
        self.trained_pairs += int(inputs["num_pairs"])
        self.trained_real_tokens += int(inputs["num_real_tokens"])

    def global_pair_mean(self, losses, global_counts):
        """``losses`` [N] -> the mean over the pairs of the GLOBAL batch when ``global_counts`` (its [pairs,
        chosen tokens], while training) is given, else over these pairs.  After PaddleNLP's /accumulation and
        data parallel's mean over ranks, one process's gradient is then that of the whole global batch
        (used by KTO and reward models, whose loss is a plain per-pair mean)."""
        if global_counts is None:
            return losses.mean()
        total = int(np.asarray(global_counts.numpy()).reshape([-1])[0])
        scale = float(self.args.dataset_world_size * self.args.gradient_accumulation_steps)
        return losses.sum() * (scale / max(total, 1))

    def prediction_step(self, model, inputs, prediction_loss_only=False, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with paddle.no_grad(), self.autocast_smart_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # -- metrics -------------------------------------------------------------
    def _averaged(self, split: str) -> dict:
        """Mean of each metric over the stored micro-batches of every data-parallel rank.

        Every rank logs at the same steps (PaddleNLP's ``_maybe_log_save_evaluate`` runs on all
        ranks), so the sums and counts are all-reduced over the default group, which under data
        parallel and sharding is the set of ranks that saw different pairs (TP and PP are refused).
        """
        stored = self._stored.pop(split, {})
        keys = sorted(key for key, values in stored.items() if values)
        sums = [float(sum(stored[key])) for key in keys]
        counts = [float(len(stored[key])) for key in keys]
        if keys and paddle.distributed.get_world_size() > 1:
            both = paddle.to_tensor(sums + counts, dtype="float64")  # [2K]
            paddle.distributed.all_reduce(both)
            values = both.numpy().tolist()
            sums, counts = values[: len(keys)], values[len(keys) :]
        return {key: total / count for key, total, count in zip(keys, sums, counts)}

    def log(self, logs, **kwargs):
        if "loss" in logs:  # a training log: the micro-batches since the previous one
            logs.update(self._averaged("train"))
        return super().log(logs, **kwargs)

    def on_evaluation_start(self) -> None:
        self._stored.pop("eval", None)

    def extra_eval_metrics(self, prefix: str) -> dict:
        return {f"{prefix}_{key}": value for key, value in self._averaged("eval").items()}

    def evaluate(self, *args, **kwargs):
        # FinetuneTrainer adds eval perplexity, which means nothing for a preference loss
        metrics = super(FinetuneTrainer, self).evaluate(*args, **kwargs)
        return metrics
