"""The fine-tuning loss on the decoder's rows runs the body and the lm_head apart, with the chunked lm_head +
cross-entropy (kernels/linear_cross_entropy.py) when the head is plain (training/loss.py).

On every MoE row (the tiny transformers-saved models of ``test_decoder_parity``, 4 experts top-2, loaded fresh)
one fine-tuning micro-step as ``FinetuneTrainer.compute_loss`` runs it (``prepare_forward`` with the batch's real
tokens, ``global_token_loss``, ``add_aux_loss`` with ``router_aux_loss_coef`` 0.5) gives the same loss, the same
gradient of every parameter (routers included), the same logged aux loss and the same expert counts as the
whole forward (``DecoderForCausalLM.forward``: [B, S, V] logits, the aux loss recorded by the model itself),
within fp32 rounding.  The batch is tail-padded, so an aux loss or counts over padding would differ.  Negative
control: the same step without the aux term is off by far more than the tolerance.  A dense decoder row takes
the chunked head too (tied to the embeddings: ernie4_5); a head with a final soft-cap (gemma2) or a bias
(ernie4_5_moe) does not: the loss keeps ``lm_head(rows)``.
"""

import numpy as np
import pytest

from paddlenlp_ext.models.family_table import FAMILIES

pytest.importorskip("torch")
pytest.importorskip("transformers")

#: the decoder's MoE rows and qwen3_moe (its transformers-layout checkpoints train on the decoder)
MOE_ROWS = [k for k, f in FAMILIES.items() if f.arch is not None and f.arch.mlp == "moe"]
COEF = 0.5


def _model(model_type, tmp_path_factory, coef=COEF):
    import paddle

    from test_decoder_parity import build, load_ours

    _, path, _ = build(model_type, tmp_path_factory)
    paddle.seed(0)
    model = load_ours(path, model_type)
    model.config.router_aux_loss_coef = coef  # as training/moe_aux.configure sets them
    model.config.output_router_logits = coef > 0
    model.train()
    return model


def _batch():
    """Three rows of 12, 7 and 4 tokens, tail-padded to 12 (no attention mask, as the fine-tuning collator pads),
    the first two tokens of each row unsupervised."""
    import paddle

    rng = np.random.default_rng(0)
    lengths = [12, 7, 4]
    ids = np.zeros((3, 12), dtype="int64")
    real = np.zeros((3, 12), dtype="int64")
    labels = np.full((3, 12), -100, dtype="int64")
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(3, 120, n)
        real[i, :n] = 1
        labels[i, 2:n] = rng.integers(3, 120, n - 2)
    return {"input_ids": paddle.to_tensor(ids), "labels": paddle.to_tensor(labels)}, paddle.to_tensor(real)


def _step(model, whole: bool, monkeypatch, aux: bool = True):
    """One micro-step as the trainer runs it: (loss, logged aux loss, expert counts, {param: grad}).
    ``whole``: the path before (the model's whole forward); ``aux``: add the aux term (False: negative control)."""
    from paddlenlp_ext.training import loss as loss_mod
    from paddlenlp_ext.training.moe_aux import MoEAuxLog, add_aux_loss, prepare_forward

    inputs, real = _batch()
    if whole:
        monkeypatch.setattr(loss_mod, "split_lm_head", lambda m, router_aux=False: None)
    log = MoEAuxLog(COEF)
    prepare_forward(model, real)
    n = int((inputs["labels"] != -100).sum())
    loss = loss_mod.global_token_loss(model, dict(inputs), n, 1, 1)
    state = dict(model.moe_state)
    if aux:
        loss = add_aux_loss(model, loss, log)
    loss.backward()
    monkeypatch.undo()
    logs = {"loss": 0.0}
    log.fill(logs, 1)
    counts = [c.numpy() for c in state.get("counts") or []]
    grads = {name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss), logs.get("aux_loss"), counts, grads


@pytest.mark.parametrize("model_type", MOE_ROWS)
def test_moe_row_step_equals_the_whole_forward(model_type, tmp_path_factory, monkeypatch):
    from paddlenlp_ext.models.heads import plain_head_weight, split_lm_head
    from paddlenlp_ext.training import loss as loss_mod

    before = _step(_model(model_type, tmp_path_factory), True, monkeypatch)
    model = _model(model_type, tmp_path_factory)
    assert split_lm_head(model, router_aux=True) is not None  # the body-only path is really taken
    used = []
    real_kernel = loss_mod.linear_cross_entropy_sum
    monkeypatch.setattr(loss_mod, "linear_cross_entropy_sum", lambda *a: used.append(1) or real_kernel(*a))
    after = _step(model, False, monkeypatch)
    plain = plain_head_weight(model.lm_head) is not None
    assert bool(used) == plain  # chunked unless the head has a bias or a soft-cap (ernie4_5_moe: lm_head bias)

    (l0, aux0, counts0, g0), (l1, aux1, counts1, g1) = before, after
    assert aux0 is not None and aux0 > 0 and abs(aux1 - aux0) <= 1e-5 * aux0, (aux0, aux1)
    assert abs(l1 - l0) <= 1e-5 * abs(l0), (l0, l1)
    assert len(counts0) == len(counts1) > 0
    for c0, c1 in zip(counts0, counts1):
        np.testing.assert_array_equal(c1, c0)
    assert g0.keys() == g1.keys() and any("gate" in k or "router" in k for k in g0), sorted(g0)[:8]
    for name in g0:
        scale = max(float(np.linalg.norm(g0[name])), 1e-6)
        assert float(np.linalg.norm(g1[name] - g0[name])) <= 1e-5 * scale, name


def test_dropping_the_aux_term_is_caught(tmp_path_factory, monkeypatch):
    """Negative control of the test above: the chunked step without the aux term is not the whole forward's."""
    l0, _, _, g0 = _step(_model("mixtral", tmp_path_factory), True, monkeypatch)
    l1, _, _, g1 = _step(_model("mixtral", tmp_path_factory), False, monkeypatch, aux=False)
    assert abs(l1 - l0) > 1e-3 * abs(l0), (l0, l1)
    routers = [k for k in g0 if "gate" in k and "proj" not in k]
    assert routers and max(float(np.linalg.norm(g1[k] - g0[k])) / float(np.linalg.norm(g0[k])) for k in routers) > 1e-3


def test_no_aux_loss_records_nothing(tmp_path_factory):
    """Coefficient 0 and no trainer request: the body-only step leaves ``moe_state`` empty, as the whole forward."""
    from paddlenlp_ext.training.loss import global_token_loss

    model = _model("qwen2_moe", tmp_path_factory, coef=0.0)
    inputs, _ = _batch()
    global_token_loss(model, dict(inputs), 10, 1, 1)
    assert model.moe_state == {}


@pytest.mark.parametrize("model_type,plain", [("mistral", True), ("ernie4_5", True), ("gemma2", False)])
def test_the_decoder_head_is_plain_without_bias_or_softcap(model_type, plain, tmp_path_factory, monkeypatch):
    """Dense decoder rows: the chunked head when plain, with the same loss and gradients as ``lm_head(rows)``."""
    from paddlenlp_ext.models.heads import plain_head_weight
    from paddlenlp_ext.training import loss as loss_mod

    model = _model(model_type, tmp_path_factory, coef=0.0)
    assert (plain_head_weight(model.lm_head) is not None) == plain
    if not plain:
        return
    l1, _, _, g1 = _step(model, False, monkeypatch, aux=False)
    monkeypatch.setattr(loss_mod, "plain_head_weight", lambda head: None)
    l0, _, _, g0 = _step(_model(model_type, tmp_path_factory, coef=0.0), False, monkeypatch, aux=False)
    assert abs(l1 - l0) <= 1e-5 * abs(l0)
    for name in g0:
        scale = max(float(np.linalg.norm(g0[name])), 1e-6)
        assert float(np.linalg.norm(g1[name] - g0[name])) <= 1e-5 * scale, name
