"""Load balancing of MoE rows in training: the router's aux loss, the expert load log, DeepSeek-V3's bias
update and ``freeze_router`` (docs/moe.md).

The run's coefficient (``router_aux_loss_coef``, alias ``moe_aux_loss_coef``; default the checkpoint's
when its ``output_router_logits`` is true) is put on the model config by :func:`configure` before the
model is built: ``output_router_logits`` = coef > 0, so the decoder computes transformers'
``load_balancing_loss_func`` in each training forward (``DecoderForCausalLM.moe_state``).
Before each training forward :func:`prepare_forward` hands the collator's ``real_tokens`` to the model, so the
aux loss and the expert counts leave padding out in every batch form (padded without a mask, packed rows).
:func:`add_aux_loss` adds ``coef * aux`` to the micro-batch's loss (once: the model's own loss with
labels already holds it) and hands the value and each MoE layer's expert counts to :class:`MoEAuxLog`,
which puts ``aux_loss`` and ``expert_load_max_over_mean`` (the worst layer; ``.../moe_layer_<i>`` per
MoE layer; 1.0 = balanced) into every training log (``FinetuneTrainer.log``: console, VisualDL,
trainer_state.json) and the per-layer load (fraction per expert, max, mean) into the run's ``moe`` summary
(run_summary.json).  :func:`bias_update_callback` moves each layer's ``e_score_correction_bias`` after every
optimizer step (``moe_router_bias_update_rate``); :func:`freeze_routers` fixes the router weights.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional


def moe_row(model_type: Optional[str], hf_layout: bool = False) -> bool:
    """Whether ``model_type`` trains on the decoder's MoE row (``Arch.mlp == "moe"`` and ``decoder=True``);
    ``hf_layout``: a transformers-layout checkpoint (qwen3_moe's trains on the decoder, ``family_table.layout_row``).
    """
    from ..models.family_table import layout_row

    family = layout_row(model_type, hf_layout)
    return family is not None and family.decoder and family.arch is not None and family.arch.mlp == "moe"


def configure(model_config, model_args) -> float:
    """Set the run's aux-loss coefficient on ``model_config`` (an MoE row's); returns it (0.0: no aux loss).

    Worked example: run keys {} and a checkpoint with router_aux_loss_coef 0.001, output_router_logits false
    -> 0.0 (no aux loss, as transformers); ``router_aux_loss_coef: 0.02`` -> 0.02, output_router_logits true.
    """
    from ..models.decoder.moe_spec import AUX_LOSS_ALIAS, AUX_LOSS_KEY, router_aux_loss_coef

    keys = {k: getattr(model_args, k, None) for k in (AUX_LOSS_KEY, AUX_LOSS_ALIAS)}
    coef = router_aux_loss_coef(keys, model_config.to_dict())
    model_config.router_aux_loss_coef = coef
    model_config.output_router_logits = coef > 0
    return coef


class MoEAuxLog:
    """The aux loss and each MoE layer's expert counts, per training log and per optimizer step.

    ``record`` takes every training forward's aux loss (None without one) and per-layer counts [E]; ``fill``
    puts the means since the last log into the training log; ``take_step_counts`` hands the counts of the
    optimizer step just taken (all its gradient-accumulation micro-batches) to the bias update.
    """

    def __init__(self, coef: float, bias_rate: float = 0.0):
        self.coef = coef
        self.bias_rate = bias_rate
        self._aux: List[float] = []
        self._counts: Optional[List[Any]] = None  # per layer: counts [E] (numpy) summed since the last log
        self._step_counts: Optional[List[Any]] = None  # the same since the last optimizer step
        self.history: List[Dict[str, Any]] = []
        self.bias_updates = 0

    def record(self, aux: Optional[float], counts: list) -> None:
        if aux is not None:
            self._aux.append(aux)
        arrays = [c.numpy() for c in counts]
        self._counts = _add(self._counts, arrays)
        self._step_counts = _add(self._step_counts, arrays)

    def take_step_counts(self) -> Optional[List[Any]]:
        """Per MoE layer, the expert counts [E] of the forwards since the last call (None: no forward)."""
        out, self._step_counts = self._step_counts, None
        return out

    def fill(self, logs: Dict[str, Any], step: int) -> None:
        """Add the means since the last training log to ``logs`` (a training log: one with ``loss``).

        Worked example: two steps with aux 1.1 and 1.3, one MoE layer with counts [6, 2] then [2, 2]
        -> aux_loss 1.2, expert_load_max_over_mean 8 / (12 / 2) = 1.3333; the history entry also holds the
        layer's fraction per expert [0.6667, 0.3333].
        """
        if "loss" not in logs or (not self._aux and self._counts is None):
            return
        entry: Dict[str, Any] = {"step": int(step)}
        if self._aux:
            logs["aux_loss"] = entry["aux_loss"] = round(sum(self._aux) / len(self._aux), 6)
        layers = [layer_load(c) for c in self._counts or []]
        for i, stats in enumerate(layers):
            logs[f"expert_load_max_over_mean/moe_layer_{i}"] = stats["max_over_mean"]
        if layers:
            logs["expert_load_max_over_mean"] = max(s["max_over_mean"] for s in layers)
        entry["expert_load_max_over_mean"] = [s["max_over_mean"] for s in layers]
        entry["expert_load"] = layers
        self.history.append(entry)
        self._aux, self._counts = [], None

    def summary(self) -> Dict[str, Any]:
        """run_summary.json's ``moe``: the coefficient, the bias update rate and how many updates were applied,
        and per training log the aux loss and each MoE layer's load (fraction per expert, max, mean, max/mean)."""
        out: Dict[str, Any] = {"router_aux_loss_coef": self.coef, "logged": self.history}
        if self.bias_rate:
            out.update(moe_router_bias_update_rate=self.bias_rate, bias_updates=self.bias_updates)
        return out


def _add(total, arrays):
    return list(arrays) if total is None else [a + b for a, b in zip(total, arrays)]


def layer_load(counts) -> Dict[str, Any]:
    """One layer's load figures from its expert counts [E] (numpy): the fraction of assignments per expert,
    its max, its mean (1/E) and max/mean (1.0 = balanced, E/k = every token on the same k experts).

    >>> import numpy as np
    >>> layer_load(np.array([6.0, 2.0, 0.0, 0.0]))
    {'fraction': [0.75, 0.25, 0.0, 0.0], 'max': 0.75, 'mean': 0.25, 'max_over_mean': 3.0}
    """
    total = float(counts.sum())
    n = len(counts)
    frac = [round(float(c) / total, 4) if total > 0 else 0.0 for c in counts]
    top = max(frac) if frac else 0.0
    return {
        "fraction": frac,
        "max": top,
        "mean": round(1.0 / n, 6),
        "max_over_mean": round(float(counts.max()) * n / total, 4) if total > 0 else 0.0,
    }


def prepare_forward(model, real_tokens) -> None:
    """Before a training forward of an MoE row: its real tokens [B, L] (the collator's ``real_tokens``) for
    the aux loss and the expert counts, and ask for the counts even without an aux loss."""
    inner = getattr(model, "_layers", model)  # paddle.DataParallel keeps the model in _layers
    if hasattr(inner, "moe_next_forward"):
        inner.moe_next_forward(token_mask=real_tokens, counts=True)


def add_aux_loss(model, loss, log: Optional[MoEAuxLog]):
    """``loss`` + ``coef * aux`` of the forward just run (when the model computed one and has not added it);
    the aux loss and the expert counts go to ``log``."""
    inner = getattr(model, "_layers", model)  # paddle.DataParallel keeps the model in _layers
    state = getattr(inner, "moe_state", None)
    if not state or "counts" not in state:
        return loss
    aux = state.get("aux_loss")
    inner.moe_state = {}
    coef = float(getattr(inner.config, "router_aux_loss_coef", 0.0) or 0.0)
    if log is not None:
        log.record(None if aux is None else float(aux), state.get("counts") or [])
    if aux is not None and coef > 0 and not state.get("in_loss"):
        loss = loss + coef * aux.astype(loss.dtype)
    return loss


def record_body_forward(model, router_logits, real_tokens) -> None:
    """After a body-only training forward of the policy on an MoE row (the body + lm_head split of preference
    training, a reward model's score head, GRPO's policy log-probs): record what ``DecoderForCausalLM.forward``
    records after a whole one, for :func:`add_aux_loss`: the aux loss of ``router_logits`` (the body output's,
    one [B*S, E] per MoE layer; None or empty without ``output_router_logits``) over the real tokens
    ``real_tokens`` [B, S] (1 = a token of an example, 0 = padding), not yet in the loss, and each MoE layer's
    expert counts over the same tokens.  Only for the policy's training forward: never a reference's."""
    from ..models.decoder.moe_balance import expert_load, load_balancing_loss

    inner = getattr(model, "_layers", model)  # paddle.DataParallel keeps the model in _layers
    blocks = moe_blocks(inner)
    if not blocks or not inner.training:
        return
    spec = blocks[0].spec
    aux = (
        load_balancing_loss(list(router_logits), spec.num_experts, spec.top_k, attention_mask=real_tokens)
        if router_logits
        else None
    )  # [] float32
    counts = [expert_load(b.last_selected, b.spec.num_experts, attention_mask=real_tokens) for b in blocks]  # [E]
    inner.moe_state = {"aux_loss": aux, "in_loss": False, "counts": counts}


def attach_moe_log(trainer, model, bias_rate: float) -> None:
    """On an MoE row with an aux loss (``output_router_logits``) or a bias update: ``trainer.moe_aux_log`` (the aux
    loss joins each training micro-batch's loss and is logged with the expert load) and the bias update callback.
    Every training mode (fine-tuning, DPO, KTO, reward models, GRPO, PPO) sets it up here."""
    config = getattr(model, "config", None)
    # the decoder's MoE rows, a transformers-layout qwen3_moe too (family_table.layout_row: its model has the blocks)
    on_moe = moe_row(getattr(config, "model_type", None)) or bool(moe_blocks(model))
    if not on_moe or not (getattr(config, "output_router_logits", False) or bias_rate > 0):
        return
    trainer.moe_aux_log = MoEAuxLog(float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0), bias_rate)
    if bias_rate > 0:
        trainer.add_callback(bias_update_callback(model, trainer.moe_aux_log, bias_rate))


def moe_blocks(model) -> list:
    """The MoE blocks of a decoder MoE row ([] for any other model)."""
    inner = getattr(model, "_layers", model)
    return inner.moe_blocks() if hasattr(inner, "moe_blocks") else []


def freeze_routers(model) -> int:
    """``freeze_router: true``: every MoE layer's router weights (and gpt-oss' router bias) get no gradient, so
    the optimizer never moves them; the experts still train.  Returns the number of parameters frozen."""
    params = [p for blk in moe_blocks(model) for p in blk.router_parameters()]
    for p in params:
        p.stop_gradient = True
    return len(params)


def bias_update_callback(model, log: MoEAuxLog, rate: float):
    """A trainer callback that, after each optimizer step, moves every MoE layer's ``e_score_correction_bias``
    by ``rate * sign(mean load - load)`` from the expert counts of that step's forwards (every
    gradient-accumulation micro-batch; summed over data-parallel ranks, so every rank applies the same step).
    The gate weights are never touched (``moe_balance.update_correction_bias``)."""
    import paddle
    from paddlenlp.trainer import TrainerCallback

    from ..models.decoder.moe_balance import update_correction_bias

    class MoEBiasUpdate(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            counts = log.take_step_counts()
            if counts is None:
                return
            blocks = moe_blocks(model)
            for blk, c in zip(blocks, counts):
                t = paddle.to_tensor(c, dtype="float32")  # [E]
                if paddle.distributed.get_world_size() > 1:
                    paddle.distributed.all_reduce(t)  # sign(mean - load) is the same for the sum over ranks
                update_correction_bias(blk, t, rate)
            log.bias_updates += 1

    return MoEBiasUpdate()
