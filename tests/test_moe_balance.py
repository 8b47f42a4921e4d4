"""Load balancing of the decoder's MoE rows in training (docs/moe.md), in-process and fast.

* The aux loss counts real tokens only: a packed batch (FlashMask start rows, or the dense 4-D mask, with
  tail padding) and a padded batch without an attention mask (what PaddingCollator makes) give, with the
  collator's ``real_tokens``, transformers' own aux loss of the same documents unpacked with a padding mask
  (``output_router_logits=True``, its ``load_balancing_loss_func``) within 1e-6.  Negative control: without
  the real-token mask the padding counts and the value differs.
* The bias update (``moe_router_bias_update_rate``) as the trainer runs it: counts of every micro-batch of
  an optimizer step, then ``rate * sign(mean - load)`` on each MoE layer's ``e_score_correction_bias``; the
  load of a skewed router falls toward balance and the gate weights stay bit-identical.
* ``freeze_router``: the router parameters get no gradient; the experts do.
* The per-layer expert load in the training log and in run_summary.json's ``moe``.
"""

import numpy as np
import paddle
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paddlenlp_ext.data.collate import PackedCollator, PaddingCollator  # noqa: E402
from paddlenlp_ext.data.packed_row import build_packed_row  # noqa: E402
from paddlenlp_ext.models.family_table import FAMILIES  # noqa: E402
from paddlenlp_ext.training import moe_aux  # noqa: E402

from test_decoder_parity import VOCAB, build, load_ours  # noqa: E402

MOE_ROWS = [k for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp == "moe"]


def _docs(seed=11, lengths=(9, 5, 7, 4)):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in lengths]


def _hf_aux(hf, model_type, docs, monkeypatch):
    """transformers' aux loss of ``docs`` right-padded into one batch with a padding mask."""
    if model_type == "qwen2_moe":
        # transformers 4.55's qwen2_moe copy of load_balancing_loss_func crashes on CPU
        # (int(device.index) with index None); mixtral's is the same function minus that line
        from transformers.models.mixtral import modeling_mixtral
        from transformers.models.qwen2_moe import modeling_qwen2_moe

        monkeypatch.setattr(modeling_qwen2_moe, "load_balancing_loss_func", modeling_mixtral.load_balancing_loss_func)
    width = max(len(d) for d in docs)
    ids = np.zeros((len(docs), width), dtype="int64")
    mask = np.zeros((len(docs), width), dtype="int64")
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = d, 1
    if model_type in ("deepseek_v2", "deepseek_v3"):
        # DeepseekV2/V3ForCausalLM compute no aux loss: transformers' load_balancing_loss_func (mixtral's) on the
        # logits their own routers compute, read by a hook (as tests/test_moe_parity.py judges them)
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        gate_logits = []

        def keep(gate, inputs, _):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            gate_logits.append(torch.nn.functional.linear(x.float(), gate.weight.float()))

        hooks = [m.gate.register_forward_hook(keep) for m in hf.modules() if type(m).__name__.endswith("MoE")]
        with torch.no_grad():
            hf(torch.tensor(ids), attention_mask=torch.tensor(mask))
        for h in hooks:
            h.remove()
        return float(
            load_balancing_loss_func(
                tuple(gate_logits), hf.config.n_routed_experts, hf.config.num_experts_per_tok, torch.tensor(mask)
            )
        )
    with torch.no_grad():
        out = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), output_router_logits=True)
    return float(out.aux_loss)


def _our_aux(ours, batch, token_mask):
    inputs = {k: paddle.to_tensor(v) for k, v in batch.items() if k not in ("labels", "real_tokens")}
    ours.moe_next_forward(token_mask=None if token_mask is None else paddle.to_tensor(token_mask))
    return float(ours(**inputs, output_router_logits=True).aux_loss)


@pytest.fixture(params=MOE_ROWS)
def moe_row(request, tmp_path_factory):
    return (request.param,) + build(request.param, tmp_path_factory)


@pytest.mark.parametrize("form", ["flash_mask", "dense_4d", "padded"])
def test_aux_loss_counts_only_real_tokens(moe_row, form, monkeypatch):
    model_type, hf, _, ours = moe_row
    docs = _docs()
    want = _hf_aux(hf, model_type, docs, monkeypatch)
    examples = [{"input_ids": d, "labels": d} for d in docs]
    if form == "padded":  # the padded collator's batch has no attention mask, only real_tokens
        batch = PaddingCollator(pad_token_id=0, max_length=12)(examples)
    else:  # two packed rows of 16, each with tail padding
        rows = [build_packed_row(examples[:2], 16, 0), build_packed_row(examples[2:], 16, 0)]
        batch = PackedCollator(flash_mask=form == "flash_mask")(rows)
    assert (batch["real_tokens"] == 0).any()  # there is padding to leave out
    got = _our_aux(ours, batch, batch["real_tokens"])
    assert abs(got - want) < 1e-6, (model_type, form, got, want)
    # negative control: every position counted (the padding too) is another value
    assert abs(_our_aux(ours, batch, None) - want) > 1e-5, (model_type, form)


def _skewed_ernie(tmp_path_factory):
    """A fresh ernie4_5_moe (4 experts, top-2, MoE layers 1 and 3) whose routers send most tokens to experts
    0 and 1: their gate columns get the mean input direction of the layer."""
    _, _, path, _ = ("ernie4_5_moe",) + build("ernie4_5_moe", tmp_path_factory)
    model = load_ours(path, "ernie4_5_moe")
    batch = PaddingCollator(pad_token_id=0)([{"input_ids": d, "labels": d} for d in _docs(3, (12, 10, 12, 8))])
    blocks = model.moe_blocks()
    seen = {}
    hooks = [
        b.register_forward_pre_hook(lambda layer, args, i=i: seen.__setitem__(i, args[0])) for i, b in enumerate(blocks)
    ]
    with paddle.no_grad():
        model(input_ids=paddle.to_tensor(batch["input_ids"]))
    for h in hooks:
        h.remove()
    for i, b in enumerate(blocks):
        mean = seen[i].reshape([-1, seen[i].shape[-1]]).mean(axis=0).numpy()  # [H]
        w = b.gate.weight.numpy()  # [H, E]
        w[:, :2] += 2.0 * (mean / (mean**2).sum())[:, None]
        b.gate.weight.set_value(paddle.to_tensor(w))
    return model, batch


def _micro_batch(model, batch, log, rows):
    real = paddle.to_tensor(batch["real_tokens"][rows])
    moe_aux.prepare_forward(model, real)
    out = model(input_ids=paddle.to_tensor(batch["input_ids"][rows]))
    loss = moe_aux.add_aux_loss(model, out.logits.mean(), log)
    return loss


def test_bias_update_moves_toward_balance_and_never_the_gate(tmp_path_factory):
    model, batch = _skewed_ernie(tmp_path_factory)
    model.train()
    blocks = model.moe_blocks()
    gates = [b.gate.weight.numpy().copy() for b in blocks]
    log = moe_aux.MoEAuxLog(0.0, bias_rate=0.01)
    update = moe_aux.bias_update_callback(model, log, 0.01)
    # one optimizer step = two micro-batches (gradient accumulation): the update sees both
    _micro_batch(model, batch, log, slice(0, 2))
    first = [c.copy() for c in log._step_counts]
    _micro_batch(model, batch, log, slice(2, 4))
    real = int(batch["real_tokens"].sum())
    assert all(int(c.sum()) == 2 * real for c in log._step_counts)  # k=2 slots of every real token, both halves
    assert all((c >= f).all() and (c > f).any() for c, f in zip(log._step_counts, first))
    history = []
    for step in range(60):
        if step:
            _micro_batch(model, batch, log, slice(0, 2))
            _micro_batch(model, batch, log, slice(2, 4))
        counts = [c.copy() for c in log._step_counts]
        history.append(max(moe_aux.layer_load(c)["max_over_mean"] for c in counts))
        update.on_step_end(None, None, None)
        assert log._step_counts is None and log.bias_updates == step + 1
    assert history[0] > 1.6, history  # skewed to start with (2.0 = every token on experts 0 and 1)
    assert np.mean(history[-10:]) < 0.75 * history[0], history
    for b, g in zip(blocks, gates):
        np.testing.assert_array_equal(b.gate.weight.numpy(), g)  # the gate weights never move
        bias = b.correction_bias.numpy().reshape(-1)
        assert bias[:2].sum() < bias[2:].sum(), bias  # the overloaded experts were pushed down
        assert b.correction_bias.stop_gradient and all(p.name != b.correction_bias.name for p in model.parameters())
    # the bias is saved with the weights (a persistable buffer: in the state dict)
    state = model.state_dict()
    key = [k for k in state if k.endswith("moe_statics.e_score_correction_bias")][0]
    assert np.abs(state[key].numpy()).max() > 0


def test_freeze_routers_stop_the_router_gradient_only(tmp_path_factory):
    _, _, path, _ = ("ernie4_5_moe",) + build("ernie4_5_moe", tmp_path_factory)
    model = load_ours(path, "ernie4_5_moe")
    model.train()
    assert moe_aux.freeze_routers(model) == len(model.moe_blocks()) == 2
    ids = paddle.to_tensor(np.array(_docs(5, (8, 8))))
    model(input_ids=ids).logits.square().mean().backward()
    for b in model.moe_blocks():
        assert b.gate.weight.stop_gradient and b.gate.weight.grad is None
        assert b.experts[0].up_proj.weight.grad is not None or b.experts[1].up_proj.weight.grad is not None
    # a dense model has no router: nothing to freeze
    assert moe_aux.freeze_routers(paddle.nn.Linear(2, 2)) == 0


def test_per_layer_load_in_the_log_and_the_summary():
    log = moe_aux.MoEAuxLog(0.02)
    log.record(1.1, [paddle.to_tensor([6.0, 2.0]), paddle.to_tensor([4.0, 4.0])])
    log.record(1.3, [paddle.to_tensor([2.0, 2.0]), paddle.to_tensor([4.0, 4.0])])
    logs = {"loss": 3.0}
    log.fill(logs, step=2)
    assert logs["aux_loss"] == 1.2 and logs["expert_load_max_over_mean"] == 1.3333
    assert logs["expert_load_max_over_mean/moe_layer_0"] == 1.3333
    assert logs["expert_load_max_over_mean/moe_layer_1"] == 1.0
    assert all(not isinstance(v, (list, dict)) for v in logs.values())  # scalars only (console, VisualDL)
    entry = log.summary()["logged"][0]
    assert entry["step"] == 2 and entry["expert_load_max_over_mean"] == [1.3333, 1.0]
    assert entry["expert_load"][0] == {
        "fraction": [0.6667, 0.3333],
        "max": 0.6667,
        "mean": 0.5,
        "max_over_mean": 1.3333,
    }
    # without an aux loss (bias update only) the load is still logged, the aux loss is not
    log = moe_aux.MoEAuxLog(0.0, bias_rate=0.001)
    log.record(None, [paddle.to_tensor([3.0, 1.0])])
    logs = {"loss": 3.0}
    log.fill(logs, step=1)
    assert "aux_loss" not in logs and logs["expert_load_max_over_mean"] == 1.5
    assert log.summary()["moe_router_bias_update_rate"] == 0.001


def test_router_names_and_bias_come_from_the_checkpoints_moe_spec(tmp_path):
    """The config-time checks (``freeze_router`` vs ``lora_target_modules``, a bias to update) read the
    checkpoint's own MoE spec, so a new row with a correction bias (deepseek_v3) is covered without edits."""
    import json

    from paddlenlp_ext.config.family_checks import _router_names

    configs = {
        "ernie4_5_moe": dict(
            hidden_size=64,
            num_hidden_layers=4,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=32,
            moe_layer_start_index=1,
            moe_layer_interval=2,
        ),
        "mixtral": dict(hidden_size=64, num_hidden_layers=2, num_local_experts=4, intermediate_size=96),
        "deepseek_v3": dict(
            hidden_size=64,
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
        ),
    }
    want = {
        "ernie4_5_moe": (["ernie4_5_moe.layers.1.mlp.gate", "ernie4_5_moe.layers.3.mlp.gate"], True),
        "mixtral": (["mixtral.layers.0.block_sparse_moe.gate", "mixtral.layers.1.block_sparse_moe.gate"], False),
        "deepseek_v3": (["deepseek_v3.layers.1.mlp.gate", "deepseek_v3.layers.2.mlp.gate"], True),
    }
    for model_type, cfg in configs.items():
        d = tmp_path / model_type
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": model_type, **cfg}))
        assert _router_names(str(d), model_type) == want[model_type], model_type
    assert _router_names(str(tmp_path / "missing"), "mixtral") is None
