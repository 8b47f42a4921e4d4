"""DPO-family loss formulas and per-pair log-probs (paddlenlp_ext.dpo.losses / .logps).

Expected numbers are computed independently with ``math`` / numpy from the
paper formulas; parity tests call PaddleNLP 3.0.0b4's own
``DPOCriterion.dpo_loss`` / ``dpo_logps`` (constructible without a model).
"""

import math
import zlib

import numpy as np
import paddle
import pytest

from paddlenlp_ext.dpo.logps import pair_logps
from paddlenlp_ext.dpo.losses import (
    PREFERENCE_LOSSES,
    combine_losses,
    pair_metrics,
    preference_loss,
    sft_nll,
    uses_average_logps,
    validate_loss_args,
)


def t(x):
    return paddle.to_tensor(np.asarray(x, dtype="float32"))


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


# Worked example: pc=-5, pr=-7, rc=-6, rr=-6.5, beta=0.1
# chosen log-ratio = 1, rejected log-ratio = -0.5, logits = 1.5, beta*logits = 0.15
PC, PR, RC, RR, BETA = -5.0, -7.0, -6.0, -6.5, 0.1


def loss1(loss_type, pc=PC, pr=PR, rc=RC, rr=RR, **kw):
    ref = (None, None) if rc is None else (t([rc]), t([rr]))
    loss, cr, rj = preference_loss(loss_type, t([pc]), t([pr]), *ref, **kw)
    assert loss.shape == [1] and cr.shape == [1] and rj.shape == [1]
    return float(loss[0]), float(cr[0]), float(rj[0])


def test_sigmoid_worked_example():
    expected = -math.log(1 / (1 + math.exp(-0.1 * ((-5 + 6) - (-7 + 6.5)))))  # = log(1 + e^-0.15)
    assert abs(expected - 0.6209570478) < 1e-9
    loss, cr, rj = loss1("sigmoid", beta=BETA)
    assert abs(loss - expected) < 1e-6
    assert abs(cr - 0.1 * (PC - RC)) < 1e-6 and abs(rj - 0.1 * (PR - RR)) < 1e-6  # 0.1, -0.05


def test_label_smoothing_conservative_dpo():
    ls = 0.1
    expected = (1 - ls) * -logsig(0.15) + ls * -logsig(-0.15)
    loss, _, _ = loss1("sigmoid", beta=BETA, label_smoothing=ls)
    assert abs(loss - expected) < 1e-6
    assert abs(expected - (0.9 * 0.6209570478 + 0.1 * 0.7709570478)) < 1e-6


def test_hinge_ipo_sppo_nca_worked_examples():
    assert abs(loss1("hinge", beta=BETA)[0] - 0.85) < 1e-6  # relu(1 - 0.15)
    assert abs(loss1("ipo", beta=BETA)[0] - 12.25) < 1e-5  # (1.5 - 5)^2
    assert abs(loss1("sppo_hard", beta=BETA)[0] - 36.25) < 1e-5  # (1 - 5)^2 + (-0.5 + 5)^2
    nca = -logsig(0.1) - 0.5 * logsig(-0.1) - 0.5 * logsig(0.05)
    assert abs(loss1("nca_pair", beta=BETA)[0] - nca) < 1e-6


def test_dpop_penalty():
    # policy chosen above the reference: no penalty, same as DPO
    assert abs(loss1("dpop", beta=BETA)[0] - 0.6209570478) < 1e-6
    # pc=-6.2 < rc=-6: logits = (-6.2+6) - (-0.5) = 0.3; penalty 50 * 0.2 = 10
    expected = -logsig(0.1 * 0.3) + 50 * 0.2
    assert abs(loss1("dpop", pc=-6.2, beta=BETA)[0] - expected) < 1e-5
    assert abs(loss1("dpop", pc=-6.2, beta=BETA, dpop_lambda=5.0)[0] - (-logsig(0.03) + 1.0)) < 1e-5


def test_simpo_and_orpo_reference_free():
    # average log-probs; simpo: -logsig(beta*(avg_c - avg_r) - gamma) = -logsig(2*0.5 - 0.5)
    loss, cr, rj = loss1("simpo", pc=-0.8, pr=-1.3, rc=None, beta=2.0, simpo_gamma=0.5)
    assert abs(loss - -logsig(0.5)) < 1e-6
    assert abs(cr - 2.0 * -0.8) < 1e-6 and abs(rj - 2.0 * -1.3) < 1e-6  # reward = beta * avg logp
    ls_loss = loss1("simpo", pc=-0.8, pr=-1.3, rc=None, beta=2.0, simpo_gamma=0.5, label_smoothing=0.2)[0]
    assert abs(ls_loss - (0.8 * -logsig(0.5) + 0.2 * -logsig(-0.5))) < 1e-6
    # ORPO odds-ratio term: log odds(y) = log p - log(1 - p)
    log_odds = (-0.8 - math.log(1 - math.exp(-0.8))) - (-1.3 - math.log(1 - math.exp(-1.3)))
    for name in ("or", "orpo"):
        assert abs(loss1(name, pc=-0.8, pr=-1.3, rc=None)[0] - -logsig(log_odds)) < 1e-6


def test_kto_pair_batch_kl():
    pc, pr, rc, rr = [-5.0, -4.0], [-7.0, -3.0], [-6.0, -4.5], [-6.5, -2.0]
    clr = [a - b for a, b in zip(pc, rc)]  # [1, 0.5]
    rlr = [a - b for a, b in zip(pr, rr)]  # [-0.5, -1]
    kl_c = max(0.0, sum(clr) / 2)  # 0.75
    kl_r = max(0.0, sum(rlr) / 2)  # 0
    halves = [1 - sig(0.1 * (c - kl_r)) for c in clr] + [1 - sig(0.1 * (kl_c - r)) for r in rlr]
    loss, _, _ = preference_loss("kto_pair", t(pc), t(pr), t(rc), t(rr), beta=0.1)
    assert abs(float(loss.mean()) - sum(halves) / 4) < 1e-6
    for i in range(2):
        assert abs(float(loss[i]) - 0.5 * (halves[i] + halves[2 + i])) < 1e-6


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_policy_equals_reference_acceptance(beta):
    rng = np.random.default_rng(0)
    pc, pr = -rng.uniform(1, 30, 6), -rng.uniform(1, 30, 6)
    for name, expected in [("sigmoid", math.log(2)), ("hinge", 1.0), ("ipo", (1 / (2 * beta)) ** 2)]:
        loss, cr, rj = preference_loss(name, t(pc), t(pr), t(pc), t(pr), beta=beta)
        np.testing.assert_allclose(loss.numpy(), expected, rtol=0, atol=1e-6 * max(1.0, expected))
        np.testing.assert_allclose(cr.numpy(), 0.0, atol=1e-6)
        np.testing.assert_allclose(rj.numpy(), 0.0, atol=1e-6)


def test_rewards_definition_and_reference_free():
    rng = np.random.default_rng(1)
    pc, pr, rc, rr = (-rng.uniform(1, 20, 5) for _ in range(4))
    for name in ("sigmoid", "hinge", "ipo", "dpop", "kto_pair", "sppo_hard", "nca_pair"):
        _, cr, rj = preference_loss(name, t(pc), t(pr), t(rc), t(rr), beta=0.3)
        np.testing.assert_allclose(cr.numpy(), 0.3 * (pc - rc), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(rj.numpy(), 0.3 * (pr - rr), rtol=1e-5, atol=1e-5)
    # reference_free == a reference of zeros
    for name in ("sigmoid", "hinge", "ipo"):
        a = preference_loss(name, t(pc), t(pr), None, None, beta=0.3, reference_free=True)
        zeros = t(np.zeros(5))
        b = preference_loss(name, t(pc), t(pr), zeros, zeros, beta=0.3)
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6)


def test_validation_errors():
    with pytest.raises(ValueError, match="Unknown preference loss_type"):
        validate_loss_args("dpo_v2")
    with pytest.raises(ValueError, match="beta must be > 0"):
        validate_loss_args("sigmoid", beta=0.0)
    with pytest.raises(ValueError, match="does not support reference_free"):
        validate_loss_args("kto_pair", reference_free=True)
    with pytest.raises(ValueError, match="reference free"):
        validate_loss_args("simpo", has_reference=True)
    with pytest.raises(ValueError, match="needs reference"):
        validate_loss_args("sigmoid", has_reference=False)
    with pytest.raises(ValueError, match="label_smoothing"):
        validate_loss_args("hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        validate_loss_args("sigmoid", label_smoothing=0.5)
    with pytest.raises(ValueError, match="dpop_lambda"):
        validate_loss_args("dpop", dpop_lambda=-1)
    with pytest.raises(ValueError, match="both 0"):
        validate_loss_args("sigmoid", pref_loss_ratio=0, sft_loss_ratio=0)
    assert validate_loss_args("orpo", has_reference=False) == "or"
    with pytest.raises(ValueError, match="needs reference"):
        preference_loss("sigmoid", t([-1.0]), t([-2.0]), None, None)
    with pytest.raises(ValueError, match="reference free"):
        preference_loss("simpo", t([-1.0]), t([-2.0]), t([-1.0]), t([-2.0]))
    assert uses_average_logps("ipo") and uses_average_logps("orpo") and not uses_average_logps("sigmoid")


def test_combine_losses_and_metrics():
    pref = t([1.0, 3.0])
    sft = paddle.to_tensor(2.0)
    assert abs(float(combine_losses(pref, sft, 1.0, 0.0)) - 2.0) < 1e-6
    assert abs(float(combine_losses(pref, sft, 0.5, 0.25)) - (0.5 * 2.0 + 0.25 * 2.0)) < 1e-6
    assert abs(float(combine_losses(pref, None, 2.0, 0.0)) - 4.0) < 1e-6
    with pytest.raises(ValueError):
        combine_losses(pref, None, 1.0, 1.0)
    # sft = token-level mean NLL over all chosen tokens of the batch
    assert abs(float(sft_nll(t([-6.0, -2.0]), t([3.0, 1.0]))) - 2.0) < 1e-6
    m = pair_metrics(t([0.1, -0.2, 0.3]), t([-0.05, 0.1, 0.3]), t([-5.0, -6.0, -7.0]), t([-7.0, -8.0, -9.0]))
    assert set(m) == {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    }
    assert all(isinstance(v, float) for v in m.values())
    assert abs(m["rewards/accuracies"] - 1 / 3) < 1e-6  # strict >: the tie does not count
    assert abs(m["rewards/margins"] - (0.15 - 0.3 + 0.0) / 3) < 1e-6
    assert abs(m["rewards/chosen"] - 0.2 / 3) < 1e-6 and abs(m["logps/rejected"] + 8.0) < 1e-6


# ---------------------------------------------------------------- PaddleNLP parity
def _criterion(**cfg):
    from types import SimpleNamespace

    from paddlenlp.transformers.dpo_criterion import DPOCriterion

    dpo = dict(
        loss_type="sigmoid",
        beta=0.1,
        label_smoothing=0.0,
        simpo_gamma=0.5,
        dpop_lambda=50,
        pref_loss_ratio=1.0,
        sft_loss_ratio=0.0,
    )
    dpo.update(cfg)
    model_cfg = SimpleNamespace(tensor_parallel_output=False, tensor_parallel_degree=1)
    return DPOCriterion(model_cfg, dpo_config=SimpleNamespace(**dpo))


PARITY_CASES = [
    ("sigmoid", dict(beta=0.1)),
    ("sigmoid", dict(beta=0.3, label_smoothing=0.2)),
    ("sigmoid", dict(beta=0.2, reference_free=True)),
    ("hinge", dict(beta=0.1)),
    ("hinge", dict(beta=0.2, reference_free=True)),
    ("ipo", dict(beta=0.1)),
    ("ipo", dict(beta=0.5, reference_free=True)),
    ("simpo", dict(beta=2.0, simpo_gamma=0.5)),
    ("simpo", dict(beta=2.5, simpo_gamma=1.4, label_smoothing=0.1)),
    ("or", dict(beta=0.1)),
    ("kto_pair", dict(beta=0.1)),
    ("kto_pair", dict(beta=0.5), 1.5),  # reference below the policy: both batch KL terms positive (not clipped)
    ("dpop", dict(beta=0.1, dpop_lambda=50.0)),
    ("sppo_hard", dict(beta=0.1)),
    ("nca_pair", dict(beta=0.2)),
]


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_parity_with_paddlenlp_dpo_loss(case):
    loss_type, kw, ref_shift = (*case, 0.0)[:3]
    assert loss_type in PREFERENCE_LOSSES
    # crc32, not hash(): str hashes are salted per process (PYTHONHASHSEED), so the inputs would change per run
    rng = np.random.default_rng(zlib.crc32(repr((loss_type, sorted(kw.items()))).encode()))
    n = 8
    if uses_average_logps(loss_type):
        vals = [-rng.uniform(0.05, 3.0, n) for _ in range(4)]  # token-averaged
    else:
        vals = [-rng.uniform(5.0, 60.0, n) for _ in range(4)]
        # reference near the policy: both branches of the dpop / kto clips
        vals[2] = vals[0] + rng.normal(0, 2.0, n) - ref_shift
        vals[3] = vals[1] + rng.normal(0, 2.0, n) - ref_shift
    pc, pr, rc, rr = vals
    ref_free = kw.get("reference_free", False) or loss_type in ("or", "simpo")

    mine_pc, mine_pr = t(pc), t(pr)
    mine_pc.stop_gradient = mine_pr.stop_gradient = False
    ref = (None, None) if ref_free else (t(rc), t(rr))
    loss, cr, rj = preference_loss(loss_type, mine_pc, mine_pr, *ref, **kw)
    loss.mean().backward()

    crit = _criterion(loss_type=loss_type, **{k: v for k, v in kw.items() if k != "reference_free"})
    their_pc, their_pr = t(pc), t(pr)
    their_pc.stop_gradient = their_pr.stop_gradient = False
    # PaddleNLP's trainer passes zeros as the reference when reference free (or/simpo require it)
    their_ref = (t(np.zeros(n)), t(np.zeros(n))) if ref_free else (t(rc), t(rr))
    theirs = crit.dpo_loss(their_pc, their_pr, *their_ref)
    theirs.backward()

    np.testing.assert_allclose(float(loss.mean()), float(theirs), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mine_pc.grad.numpy(), their_pc.grad.numpy(), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(mine_pr.grad.numpy(), their_pr.grad.numpy(), rtol=1e-4, atol=1e-7)
    # rewards as PaddleNLP's log_metric: beta * (policy - reference)
    np.testing.assert_allclose(cr.numpy(), kw["beta"] * (pc - their_ref[0].numpy()), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rj.numpy(), kw["beta"] * (pr - their_ref[1].numpy()), rtol=1e-5, atol=1e-6)


def test_parity_with_paddlenlp_dpo_logps_and_sft_loss():
    """pair_logps + sft_nll + combine_losses vs DPOCriterion.dpo_logps/forward on an unpacked batch."""
    rng = np.random.default_rng(7)
    b, s, v = 2, 9, 11
    logits = rng.normal(0, 2, (b, s, v)).astype("float32")
    # row: (chosen start, rejected start, rejected end) in PaddleNLP's shifted-label positions
    spans = [(2, 5, 8), (1, 3, 7)]
    chosen_labels = np.zeros((b, s), "int64")
    rejected_labels = np.zeros((b, s), "int64")
    idx, tok, seg = [], [], []
    for row, (c0, r0, r1) in enumerate(spans):
        chosen_labels[row, c0:r0] = rng.integers(1, v, r0 - c0)
        rejected_labels[row, r0:r1] = rng.integers(1, v, r1 - r0)
        for p in range(c0, r1):
            idx.append(row * s + p)
            tok.append(chosen_labels[row, p] + rejected_labels[row, p])
            seg.append(2 * row + (0 if p < r0 else 1))
    response_indexs = paddle.to_tensor([[row, *sp] for row, sp in enumerate(spans)], dtype="int64")
    i64 = lambda x: paddle.to_tensor(np.asarray(x, "int64"))  # noqa: E731

    for avg in (False, True):
        crit = _criterion(sft_loss_ratio=1.0)
        pc_t, pr_t, sft_t = crit.dpo_logps(
            paddle.to_tensor(logits), i64(chosen_labels), i64(rejected_labels), response_indexs, avg
        )
        pc, pr, nc, nr = pair_logps(paddle.to_tensor(logits), i64(idx), i64(tok), i64(seg), b, normalize=avg)
        np.testing.assert_allclose(pc.numpy(), pc_t.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(pr.numpy(), pr_t.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(nc.numpy(), [3, 2])
        np.testing.assert_allclose(nr.numpy(), [3, 4])
    sums = pair_logps(paddle.to_tensor(logits), i64(idx), i64(tok), i64(seg), b)
    np.testing.assert_allclose(float(sft_nll(sums[0], sums[2])), float(sft_t), rtol=1e-5)

    # full forward: reference supplied -> (pc, pr, sft_loss, dpo_loss, loss)
    crit = _criterion(loss_type="sigmoid", beta=0.1, pref_loss_ratio=0.7, sft_loss_ratio=0.3)
    rc, rr = t([-20.0, -15.0]), t([-18.0, -25.0])
    out = crit(paddle.to_tensor(logits), (i64(chosen_labels), i64(rejected_labels), response_indexs, rc, rr))
    pref, _, _ = preference_loss("sigmoid", sums[0], sums[1], rc, rr, beta=0.1)
    total = combine_losses(pref, sft_nll(sums[0], sums[2]), 0.7, 0.3)
    np.testing.assert_allclose(float(total), float(out[4]), rtol=1e-5)


# ---------------------------------------------------------------- pair_logps
def _ls(row):
    """log_softmax of a python list, by hand."""
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def _hand_batch():
    # B=1, S=4, V=3
    logits = [[[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.5, -1.0, 3.0]]]
    # (index, token, segment), deliberately unsorted; index 0 is used twice (chosen[0] and rejected[0])
    entries = [(2, 1, 2), (0, 1, 0), (0, 2, 1), (1, 0, 0), (2, 0, 3), (3, 2, 3)]
    return logits, entries


def test_pair_logps_hand_example():
    logits, entries = _hand_batch()
    ln3 = math.log(3.0)
    # row 0 = [0,0,0] -> -ln 3 for every token; row 1 token 0 -> 1 - ln(e + 2)
    c0 = -ln3 + (1 - math.log(math.e + 2))
    r0 = -ln3
    # row 2 token 1 -> 2 - ln(2 + e^2); row 2 token 0 -> -ln(2 + e^2); row 3 token 2 -> 3 - ln(e^.5 + e^-1 + e^3)
    c1 = 2 - math.log(2 + math.e**2)
    r1 = -math.log(2 + math.e**2) + 3 - math.log(math.exp(0.5) + math.exp(-1.0) + math.exp(3.0))
    idx, tok, seg = (paddle.to_tensor([e[k] for e in entries], dtype="int64") for k in range(3))
    lg = paddle.to_tensor(np.asarray(logits, "float32"))
    c, r, nc, nr = pair_logps(lg, idx, tok, seg, 2)
    np.testing.assert_allclose(c.numpy(), [c0, c1], atol=1e-6)
    np.testing.assert_allclose(r.numpy(), [r0, r1], atol=1e-6)
    np.testing.assert_allclose(nc.numpy(), [2, 1])
    np.testing.assert_allclose(nr.numpy(), [1, 2])
    c, r, _, _ = pair_logps(lg, idx, tok, seg, 2, normalize=True)
    np.testing.assert_allclose(c.numpy(), [c0 / 2, c1], atol=1e-6)
    np.testing.assert_allclose(r.numpy(), [r0, r1 / 2], atol=1e-6)
    # an empty trailing pair keeps its slot: zeros, not NaN, not dropped
    c, r, nc, nr = pair_logps(lg, idx, tok, seg, 3, normalize=True)
    assert c.shape == [3] and float(c[2]) == 0.0 and float(r[2]) == 0.0 and float(nc[2]) == 0.0


@pytest.mark.parametrize("normalize", [False, True])
def test_pair_logps_gradient_matches_dense_numpy(normalize):
    rng = np.random.default_rng(3)
    b, s, v, n = 2, 5, 7, 3
    logits = rng.normal(0, 1.5, (b, s, v))
    tcount = 14
    idx = rng.integers(0, b * s, tcount)
    tok = rng.integers(0, v, tcount)
    seg = np.concatenate([np.arange(2 * n), rng.integers(0, 2 * n, tcount - 2 * n)])
    w = rng.normal(0, 1, 2 * n)  # weights on (chosen_0, ..., chosen_{n-1}, rejected_0, ...)

    lg = paddle.to_tensor(logits.astype("float32"), stop_gradient=False)
    c, r, _, _ = pair_logps(lg, *(paddle.to_tensor(x, dtype="int64") for x in (idx, tok, seg)), n, normalize)
    (paddle.concat([c, r]) * paddle.to_tensor(w.astype("float32"))).sum().backward()

    # independent dense computation: d log_softmax(x)[k] / dx = onehot(k) - softmax(x)
    flat = logits.reshape(b * s, v)
    counts = np.bincount(seg, minlength=2 * n).astype(float)
    seg_w = {2 * p: w[p] for p in range(n)} | {2 * p + 1: w[n + p] for p in range(n)}
    grad = np.zeros_like(flat)
    val = np.zeros(2 * n)
    for i, k, g in zip(idx, tok, seg):
        x = flat[i]
        sm = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        scale = seg_w[g] / (counts[g] if normalize else 1.0)
        grad[i] += scale * (np.eye(v)[k] - sm)
        val[g] += (x[k] - x.max() - np.log(np.exp(x - x.max()).sum())) / (counts[g] if normalize else 1.0)
    np.testing.assert_allclose(c.numpy(), val[0::2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r.numpy(), val[1::2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lg.grad.numpy(), grad.reshape(b, s, v), rtol=1e-4, atol=1e-5)


def test_pair_logps_low_precision_logits_are_scored_in_float32():
    logits, entries = _hand_batch()
    idx, tok, seg = (paddle.to_tensor([e[k] for e in entries], dtype="int64") for k in range(3))
    lg16 = paddle.to_tensor(np.asarray(logits, "float32")).astype("bfloat16")
    c, r, _, _ = pair_logps(lg16, idx, tok, seg, 2)
    assert c.dtype == paddle.float32
    c32, r32, _, _ = pair_logps(paddle.to_tensor(np.asarray(logits, "float32")), idx, tok, seg, 2)
    np.testing.assert_allclose(c.numpy(), c32.numpy(), atol=1e-6)  # these logits are exact in bf16
