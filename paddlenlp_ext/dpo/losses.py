"""Preference-loss formulas (DPO and its family), PaddleNLP 3.0.0b4 semantics.

Reference: ``paddlenlp/transformers/dpo_criterion.py`` (``DPOCriterion.dpo_loss``
and ``dpo_logps``) and ``paddlenlp/trl/dpo_trainer.py`` (argument checks,
``reference_free`` handling, ``log_metric``).  Re-implemented here, per pair.

Notation (all ``[N]``, one entry per preference pair):
    pc, pr  policy log-prob of the chosen / rejected answer
    rc, rr  reference log-prob of the chosen / rejected answer (0 when reference free)
    logits  = (pc - pr) - (rc - rr)          the unscaled log-ratio difference

Which log-probs to pass: PaddleNLP scores ``ipo``, ``or`` (ORPO) and ``simpo``
with token-averaged log-probs (``average_log_prob=True``; see
:data:`AVERAGE_LOGPS_LOSSES` / :func:`uses_average_logps`) and every other
loss with summed log-probs.  ``preference_loss`` uses whatever it is given;
``pair_logps(..., normalize=uses_average_logps(loss_type))`` produces the
right kind.  The SFT term is always built from *summed* log-probs (see
:func:`sft_nll`).

Loss formulas (``b`` = beta, ``ls`` = label_smoothing):
    sigmoid   -(1-ls) logsig(b*logits) - ls logsig(-b*logits)          (DPO; cDPO for ls > 0)
    hinge     relu(1 - b*logits)                                         (SLiC)
    ipo       (logits - 1/(2b))^2                                        (IPO, b = tau)
    simpo     -(1-ls) logsig(b*logits - gamma) - ls logsig(-(b*logits - gamma)),
              reference free, so logits = avg(pc) - avg(pr)              (SimPO)
    or        -logsig(log_odds), log_odds = (pc-pr) - (log(1-e^pc) - log(1-e^pr)),
              averaged log-probs, no beta, reference free               (ORPO odds-ratio term)
    kto_pair  0.5 * [(1 - sig(b*((pc-rc) - KL_r))) + (1 - sig(b*(KL_c - (pr-rr))))],
              KL_c = clip(mean_batch(pc-rc), 0), KL_r = clip(mean_batch(pr-rr), 0)
    dpop      -logsig(b*logits) + lambda * relu(rc - pc)                 (DPO-Positive, PaddleNLP form)
    sppo_hard ((pc-rc) - 1/(2b))^2 + ((pr-rr) + 1/(2b))^2
    nca_pair  -logsig(b(pc-rc)) - 0.5 logsig(-b(pc-rc)) - 0.5 logsig(-b(pr-rr))

Rewards (as PaddleNLP's ``log_metric``, for every loss type):
    chosen_rewards = b * (pc - rc), rejected_rewards = b * (pr - rr), detached,
    with rc = rr = 0 when reference free (so for simpo/or: b * average log-prob).
"""

from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F

__all__ = [
    "PREFERENCE_LOSSES",
    "LOSS_ALIASES",
    "AVERAGE_LOGPS_LOSSES",
    "REFERENCE_FREE_CAPABLE",
    "REFERENCE_FREE_ONLY",
    "LABEL_SMOOTHING_LOSSES",
    "canonical_loss_type",
    "uses_average_logps",
    "validate_loss_args",
    "preference_loss",
    "sft_nll",
    "combine_losses",
    "pair_metrics",
]

#: PaddleNLP's names (``dpo_config.loss_type``); ``"or"`` is ORPO.
PREFERENCE_LOSSES = ("sigmoid", "hinge", "ipo", "kto_pair", "sppo_hard", "nca_pair", "dpop", "or", "simpo")
#: Accepted spellings mapped to PaddleNLP's name.
LOSS_ALIASES = {"orpo": "or"}
#: Loss types PaddleNLP evaluates on token-averaged log-probs.
AVERAGE_LOGPS_LOSSES = ("ipo", "or", "simpo")
#: Loss types that may run with ``reference_free=True`` (PaddleNLP DPOTrainer check).
REFERENCE_FREE_CAPABLE = ("sigmoid", "hinge", "ipo", "or", "simpo")
#: Loss types that never use a reference model (PaddleNLP refuses a ref_model for them).
REFERENCE_FREE_ONLY = ("or", "simpo")
#: Loss types whose formula uses ``label_smoothing``.
LABEL_SMOOTHING_LOSSES = ("sigmoid", "simpo")


def canonical_loss_type(loss_type: str) -> str:
    """Map an accepted spelling (e.g. ``"orpo"``) to PaddleNLP's name, or raise ValueError."""
    if not isinstance(loss_type, str):
        raise ValueError(f"loss_type must be a string, got {type(loss_type).__name__}")
    name = LOSS_ALIASES.get(loss_type, loss_type)
    if name not in PREFERENCE_LOSSES:
        raise ValueError(
            f"Unknown preference loss_type {loss_type!r}; expected one of {list(PREFERENCE_LOSSES)} "
            f"(aliases: {LOSS_ALIASES})"
        )
    return name


def uses_average_logps(loss_type: str) -> bool:
    """True if PaddleNLP scores this loss with token-averaged log-probs (``pair_logps(normalize=True)``)."""
    return canonical_loss_type(loss_type) in AVERAGE_LOGPS_LOSSES


def _finite_number(name, value):
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return x


def validate_loss_args(
    loss_type: str,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    dpop_lambda: float = 50.0,
    reference_free: bool = False,
    has_reference: bool | None = None,
    pref_loss_ratio: float = 1.0,
    sft_loss_ratio: float = 0.0,
) -> str:
    """Check a preference-loss configuration; return the canonical loss name.

    ``has_reference``: whether reference log-probs / a reference model are
    supplied (``None`` = unknown, skip those checks).  Raises ``ValueError``
    with a message naming the offending option for:

    * unknown ``loss_type``;
    * ``beta <= 0`` (every formula divides by or scales with beta);
    * ``label_smoothing`` outside ``[0, 0.5)``, or ``> 0`` for a loss type that
      ignores it (only sigmoid and simpo use it; PaddleNLP ignores it silently);
    * ``dpop_lambda < 0``; non-finite ``simpo_gamma``;
    * ``reference_free=True`` for a loss type that needs the reference
      (kto_pair, sppo_hard, nca_pair, dpop), or together with reference log-probs;
    * a reference for ``or`` / ``simpo`` (reference-free by definition);
    * no reference for the other loss types when ``reference_free`` is False;
    * negative loss ratios, or both ratios zero.
    """
    name = canonical_loss_type(loss_type)
    beta = _finite_number("beta", beta)
    if beta <= 0:
        raise ValueError(f"beta must be > 0 for loss_type {name!r}, got {beta}")
    ls = _finite_number("label_smoothing", label_smoothing)
    if not 0.0 <= ls < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) (conservative DPO), got {ls}")
    if ls > 0 and name not in LABEL_SMOOTHING_LOSSES:
        raise ValueError(
            f"label_smoothing={ls} has no effect for loss_type {name!r}; "
            f"it is only used by {list(LABEL_SMOOTHING_LOSSES)}"
        )
    _finite_number("simpo_gamma", simpo_gamma)
    if _finite_number("dpop_lambda", dpop_lambda) < 0:
        raise ValueError(f"dpop_lambda must be >= 0, got {dpop_lambda}")
    if reference_free and name not in REFERENCE_FREE_CAPABLE:
        raise ValueError(
            f"loss_type {name!r} does not support reference_free=True; "
            f"reference-free loss types are {list(REFERENCE_FREE_CAPABLE)}"
        )
    if has_reference is not None:
        if has_reference and reference_free:
            raise ValueError("reference_free=True but reference log-probs / a reference model were given")
        if has_reference and name in REFERENCE_FREE_ONLY:
            raise ValueError(f"loss_type {name!r} is reference free and does not take a reference model / log-probs")
        if not has_reference and not reference_free and name not in REFERENCE_FREE_ONLY:
            raise ValueError(
                f"loss_type {name!r} needs reference log-probs (or set reference_free=True, "
                f"allowed for {list(REFERENCE_FREE_CAPABLE)})"
            )
    p = _finite_number("pref_loss_ratio", pref_loss_ratio)
    s = _finite_number("sft_loss_ratio", sft_loss_ratio)
    if p < 0 or s < 0:
        raise ValueError(f"pref_loss_ratio and sft_loss_ratio must be >= 0, got {p} and {s}")
    if p == 0 and s == 0:
        raise ValueError("pref_loss_ratio and sft_loss_ratio are both 0: the loss would be identically zero")
    return name


def _log1m_exp(x):
    """log(1 - exp(x)) for x < 0 ([N]); via expm1, accurate for x near 0."""
    return paddle.log(-paddle.expm1(x))  # [N]


def preference_loss(
    loss_type,
    policy_chosen,
    policy_rejected,
    ref_chosen,
    ref_rejected,
    *,
    beta=0.1,
    label_smoothing=0.0,
    simpo_gamma=0.5,
    dpop_lambda=50.0,
    reference_free=False,
    policy_chosen_avg=None,
):
    """Per-pair preference loss and rewards.

    Args:
        loss_type: one of :data:`PREFERENCE_LOSSES` (or an alias, ``"orpo"``).
        policy_chosen, policy_rejected: ``[N]`` policy log-probs (summed, or
            token-averaged for :data:`AVERAGE_LOGPS_LOSSES`, as PaddleNLP).
        ref_chosen, ref_rejected: ``[N]`` reference log-probs, or ``None``
            when ``reference_free`` or for the reference-free ``or``/``simpo``
            (treated as 0, as PaddleNLP's trainer passes zeros).
        beta, label_smoothing, simpo_gamma, dpop_lambda: PaddleNLP defaults.
        reference_free: PaddleNLP's ``dpo_config.reference_free``.
        policy_chosen_avg: not supported; must be None.  PaddleNLP does not
            put an NLL term inside the per-pair loss: ORPO's NLL part is the
            batch SFT term added by :func:`combine_losses` (``sft_loss_ratio``),
            and length normalisation is chosen by the caller via
            :func:`uses_average_logps`.  Raises ValueError if given.

    Returns:
        ``(loss [N], chosen_rewards [N], rejected_rewards [N])``.  The loss is
        NOT multiplied by ``pref_loss_ratio`` (see :func:`combine_losses`);
        ``loss.mean()`` equals PaddleNLP's ``dpo_loss / pref_loss_ratio``
        (for kto_pair the per-pair value is the mean of its two halves, so the
        mean over pairs equals PaddleNLP's mean over the 2N concatenated terms).
        Rewards are detached.
    """
    if policy_chosen_avg is not None:
        raise ValueError(
            "policy_chosen_avg is not used: pass token-averaged log-probs as policy_chosen/policy_rejected "
            "for ipo/or/simpo (uses_average_logps) and add the NLL/SFT term with combine_losses()"
        )
    has_ref = ref_chosen is not None or ref_rejected is not None
    name = validate_loss_args(
        loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma,
        dpop_lambda=dpop_lambda,
        reference_free=reference_free,
        has_reference=has_ref,
    )
    if has_ref and (ref_chosen is None or ref_rejected is None):
        raise ValueError("pass both ref_chosen and ref_rejected, or neither")
    beta = float(beta)
    ls = float(label_smoothing)

    pc = policy_chosen.astype("float32")  # [N]
    pr = policy_rejected.astype("float32")  # [N]
    if pc.shape != pr.shape or pc.ndim != 1:
        raise ValueError(f"policy_chosen/policy_rejected must both be [N], got {pc.shape} and {pr.shape}")
    if has_ref:
        rc = ref_chosen.astype("float32").detach()  # [N]
        rr = ref_rejected.astype("float32").detach()  # [N]
        if rc.shape != pc.shape or rr.shape != pc.shape:
            raise ValueError(f"reference log-probs must be [N] like the policy's, got {rc.shape} and {rr.shape}")
    else:
        rc = paddle.zeros_like(pc)  # [N]
        rr = paddle.zeros_like(pr)  # [N]

    chosen_lr = pc - rc  # [N] log pi/pi_ref (chosen)
    rejected_lr = pr - rr  # [N] log pi/pi_ref (rejected)
    logits = chosen_lr - rejected_lr  # [N] (pc - pr) - (rc - rr)

    if name == "sigmoid":
        loss = -F.log_sigmoid(beta * logits) * (1 - ls) - F.log_sigmoid(-beta * logits) * ls  # [N]
    elif name == "hinge":
        loss = F.relu(1 - beta * logits)  # [N]
    elif name == "ipo":
        loss = (logits - 1 / (2 * beta)) ** 2  # [N]
    elif name == "simpo":
        z = beta * logits - float(simpo_gamma)  # [N]
        loss = -F.log_sigmoid(z) * (1 - ls) - F.log_sigmoid(-z) * ls  # [N]
    elif name == "or":
        log_odds = (pc - pr) - (_log1m_exp(pc) - _log1m_exp(pr))  # [N]
        loss = -F.log_sigmoid(log_odds)  # [N]
    elif name == "kto_pair":
        kl_c = paddle.clip(chosen_lr.mean(), min=0)  # [] batch estimate
        kl_r = paddle.clip(rejected_lr.mean(), min=0)  # []
        loss_c = 1 - F.sigmoid(beta * (chosen_lr - kl_r))  # [N] chosen half uses the rejected KL
        loss_r = 1 - F.sigmoid(beta * (kl_c - rejected_lr))  # [N] rejected half uses the chosen KL
        loss = 0.5 * (loss_c + loss_r)  # [N]
    elif name == "dpop":
        loss = -F.log_sigmoid(beta * logits) + float(dpop_lambda) * F.relu(rc - pc)  # [N]
    elif name == "sppo_hard":
        loss = (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2  # [N]
    elif name == "nca_pair":
        cr = beta * chosen_lr  # [N]
        rj = beta * rejected_lr  # [N]
        loss = -F.log_sigmoid(cr) - 0.5 * F.log_sigmoid(-cr) - 0.5 * F.log_sigmoid(-rj)  # [N]
    else:  # pragma: no cover - canonical_loss_type guards this
        raise ValueError(name)

    chosen_rewards = (beta * chosen_lr).detach()  # [N]
    rejected_rewards = (beta * rejected_lr).detach()  # [N]
    return loss, chosen_rewards, rejected_rewards


def sft_nll(chosen_logps_sum, chosen_tokens):
    """PaddleNLP's SFT term: ``-sum_pairs(chosen log-prob sum) / sum_pairs(chosen tokens)``.

    ``chosen_logps_sum`` ``[N]`` must be the *summed* (not averaged) chosen
    log-probs and ``chosen_tokens`` ``[N]`` the chosen token counts (both from
    :func:`~paddlenlp_ext.dpo.logps.pair_logps` with ``normalize=False``).
    This is the token-level mean NLL over all chosen tokens of the batch (not
    the mean of per-pair means), as ``DPOCriterion.dpo_logps`` computes it
    before any length averaging -- also for ipo/or/simpo.  Returns a scalar.
    """
    total = chosen_tokens.astype("float32").sum().detach()  # []
    return -chosen_logps_sum.astype("float32").sum() / paddle.clip(total, min=1.0)  # []


def combine_losses(pref_loss, sft_loss, pref_loss_ratio=1.0, sft_loss_ratio=0.0):
    """``pref_loss_ratio * mean(pref_loss) + sft_loss_ratio * sft_loss`` (PaddleNLP ``DPOCriterion.forward``).

    ``pref_loss``: ``[N]`` per-pair loss from :func:`preference_loss`.
    ``sft_loss``: scalar from :func:`sft_nll`, i.e. the mean NLL per chosen
    token over the whole batch (sum of chosen-token NLLs / number of chosen
    tokens); may be ``None`` when ``sft_loss_ratio == 0``.  ORPO = ``"or"``
    with ``sft_loss_ratio > 0``.  Returns a scalar tensor.
    """
    p = float(pref_loss_ratio)
    s = float(sft_loss_ratio)
    if p < 0 or s < 0:
        raise ValueError(f"pref_loss_ratio and sft_loss_ratio must be >= 0, got {p} and {s}")
    total = pref_loss.astype("float32").mean() * p  # []
    if s != 0:
        if sft_loss is None:
            raise ValueError(f"sft_loss_ratio={s} but sft_loss is None")
        total = total + sft_loss.astype("float32").reshape([]) * s  # []
    return total


def pair_metrics(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected, *, loss_type=None):
    """Means over pairs as python floats (keys as PaddleNLP's ``log_metric``).

    rewards/chosen, rewards/rejected, rewards/accuracies (fraction with
    chosen > rejected reward, strict), rewards/margins, logps/chosen,
    logps/rejected.  With ``loss_type="or"`` also log_odds_ratio and
    log_odds_chosen as PaddleNLP logs them.
    """
    cr = chosen_rewards.astype("float32").detach()  # [N]
    rr = rejected_rewards.astype("float32").detach()  # [N]
    pc = policy_chosen.astype("float32").detach()  # [N]
    pr = policy_rejected.astype("float32").detach()  # [N]
    out = {
        "rewards/chosen": float(cr.mean()),
        "rewards/rejected": float(rr.mean()),
        "rewards/accuracies": float((cr > rr).astype("float32").mean()),
        "rewards/margins": float((cr - rr).mean()),
        "logps/chosen": float(pc.mean()),
        "logps/rejected": float(pr.mean()),
    }
    if loss_type is not None and canonical_loss_type(loss_type) == "or":
        log_odds = (pc - pr) - (_log1m_exp(pc) - _log1m_exp(pr))  # [N]
        out["log_odds_ratio"] = float(log_odds.mean())
        out["log_odds_chosen"] = float(F.log_sigmoid(log_odds).mean())
    return out
