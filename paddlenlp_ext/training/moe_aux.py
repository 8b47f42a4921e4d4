"""The router's load-balancing loss of MoE rows in training, and its logging (docs/moe.md).

The run's coefficient (``router_aux_loss_coef``, alias ``moe_aux_loss_coef``; default the checkpoint's
when its ``output_router_logits`` is true) is put on the model config by :func:`configure` before the
model is built: ``output_router_logits`` = coef > 0, so the decoder computes transformers'
``load_balancing_loss_func`` in each training forward (``DecoderForCausalLM.moe_state``).
:func:`add_aux_loss` adds ``coef * aux`` to the micro-batch's loss (once: the model's own loss with
labels already holds it) and hands the value and each MoE layer's expert counts to :class:`MoEAuxLog`,
which puts ``aux_loss`` and ``expert_load_max_over_mean`` (the worst layer; ``.../moe_layer_<i>`` per
MoE layer; 1.0 = balanced) into every training log (``FinetuneTrainer.log``: console, VisualDL,
trainer_state.json) and the run's ``moe`` summary (run_summary.json).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional


def moe_row(model_type: Optional[str]) -> bool:
    """Whether ``model_type`` trains on the decoder's MoE row (``Arch.mlp == "moe"`` and ``decoder=True``)."""
    from ..models.family_table import row

    family = row(model_type)
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
    """Means of the aux loss and of each layer's expert load (max/mean) over the steps since the last log."""

    def __init__(self, coef: float):
        self.coef = coef
        self._aux: List[float] = []
        self._counts: Optional[List[Any]] = None  # per layer: summed counts [E] (numpy)
        self.history: List[Dict[str, Any]] = []

    def record(self, aux: float, counts: list) -> None:
        self._aux.append(aux)
        arrays = [c.numpy() for c in counts]
        self._counts = arrays if self._counts is None else [a + b for a, b in zip(self._counts, arrays)]

    def fill(self, logs: Dict[str, Any], step: int) -> None:
        """Add the means since the last training log to ``logs`` (a training log: one with ``loss``).

        Worked example: two steps with aux 1.1 and 1.3, one MoE layer with counts [6, 2] then [2, 2]
        -> aux_loss 1.2, expert_load_max_over_mean 8 / (12 / 2) = 1.3333.
        """
        if "loss" not in logs or not self._aux:
            return
        logs["aux_loss"] = round(sum(self._aux) / len(self._aux), 6)
        loads = []
        for c in self._counts or []:
            total = float(c.sum())
            loads.append(round(float(c.max()) / (total / len(c)), 4) if total > 0 else 0.0)
        for i, v in enumerate(loads):
            logs[f"expert_load_max_over_mean/moe_layer_{i}"] = v
        if loads:
            logs["expert_load_max_over_mean"] = max(loads)
        self.history.append({"step": int(step), "aux_loss": logs["aux_loss"], "expert_load_max_over_mean": loads})
        self._aux, self._counts = [], None

    def summary(self) -> Dict[str, Any]:
        """run_summary.json's ``moe``: the coefficient and the logged aux loss / per-layer load over the run."""
        return {"router_aux_loss_coef": self.coef, "logged": self.history}


def add_aux_loss(model, loss, log: Optional[MoEAuxLog]):
    """``loss`` + ``coef * aux`` of the forward just run (when the model computed one and has not added it)."""
    inner = getattr(model, "_layers", model)  # paddle.DataParallel keeps the model in _layers
    state = getattr(inner, "moe_state", None)
    if not state or state.get("aux_loss") is None:
        return loss
    aux = state["aux_loss"]
    inner.moe_state = {}
    coef = float(getattr(inner.config, "router_aux_loss_coef", 0.0) or 0.0)
    if log is not None:
        log.record(float(aux), state.get("counts") or [])
    if coef > 0 and not state.get("in_loss"):
        loss = loss + coef * aux.astype(loss.dtype)
    return loss
