"""Our decoder under tensor (and sequence) parallelism: 2 simulated ranks equal one process, on every dense row.

The rows come from the family table (every decoder row whose MLP is dense), so a new row is tested without
editing this file; the non-default knobs are tests/test_decoder_parity.py's ``KNOBS`` (windows, soft-caps,
partial rotary, biases, tied embeddings, q/k norms).  Each rank gets the single-device weights sliced by THIS
test's own numpy code (:func:`expected_split`: column-parallel q/k/v/gate/up and the vocab, row-parallel o/down,
a fused projection per segment), runs in lock step with the others (``parallel.SimulatedGroup``), and then:

* the loss on every rank equals the single process's (1e-5), and every parameter's gradient, gathered by this
  test's own code, equals the single process's (1e-5 relative to max(1, |grad|));
* with LoRA on the row's targets, every adapter gradient (gathered with ``unshard_adapter_states``) and the
  complete adapter checkpoint (``full_adapter_state_dict``) equal the single process's;
* negative controls fail: a contiguous (instead of per segment) split of a fused projection, a per-rank rms
  of OLMo 2's whole-projection q/k norm, and a head norm whose gradient is not summed over the ranks;
* the streaming loader cuts each rank's shard from a single-process checkpoint (the same tensors as the test's).
"""

import numpy as np
import paddle
import pytest

transformers = pytest.importorskip("transformers")

from test_decoder_parity import BASE, KNOBS  # noqa: E402

from paddlenlp_ext.models.family_table import FAMILIES  # noqa: E402
from paddlenlp_ext.parallel import SimulatedGroup  # noqa: E402

ROWS = [k for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp == "dense"]
N, B, S, TOL = 2, 2, 8, 1e-5
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")
ROW = ("o_proj", "down_proj")


def config_dict(model_type, **over):
    kw = {**BASE, **KNOBS.get(model_type, {}), **over}
    return transformers.AutoConfig.for_model(model_type, **kw).to_dict()


def build(model_type, tp=1, rank=0, sp=False, **over):
    from paddlenlp_ext.models.decoder import classes_for

    config_cls, _, lm_cls = classes_for(model_type)
    cfg = config_cls(**config_dict(model_type, **over), tensor_parallel_degree=tp, tensor_parallel_rank=rank,
                     sequence_parallel=sp)
    return lm_cls(cfg)


def segments(name, cfg):
    """The fused output segments of a column layer (full sizes), () for an unfused one."""
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if ".qkv_proj." in name:
        return (heads * head_dim, kv * head_dim, kv * head_dim)
    if ".gate_up_proj." in name:
        return (cfg["intermediate_size"],) * 2
    return ()


def expected_split(name, cfg, model_type):
    """(axis, segments) of parameter ``name`` under tensor parallelism; axis None: replicated on every rank."""
    leaf = name.split(".")
    layer, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", leaf[-1])
    if name.endswith("embed_tokens.weight"):
        return 0, ()
    if name == "lm_head.weight":  # [hidden, vocab]; tied: the embedding table itself, [vocab, hidden]
        return (0 if cfg.get("tie_word_embeddings") else 1), ()
    if layer in COLUMN:
        return (1 if kind == "weight" else 0), segments(name, cfg)
    if layer in ROW:
        return (0 if kind == "weight" else None), ()
    if layer in ("q_norm", "k_norm") and FAMILIES[model_type].arch.qk_norm == "proj":
        return 0, ()  # OLMo 2: the norm over the whole projection is split like the projection's columns
    return None, ()


def np_take(full, axis, segs, rank, n=N):
    if not segs:
        return np.split(full, n, axis=axis)[rank]
    pieces = np.split(full, np.cumsum(segs)[:-1], axis=axis)
    return np.concatenate([np.split(p, n, axis=axis)[rank] for p in pieces], axis=axis)


def np_join(parts, axis, segs):
    if not segs:
        return np.concatenate(parts, axis=axis)
    per_rank = [np.split(p, np.cumsum([s // len(parts) for s in segs])[:-1], axis=axis) for p in parts]
    return np.concatenate([np.concatenate([r[i] for r in per_rank], axis=axis) for i in range(len(segs))], axis=axis)


def randomize(model, seed=0):
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        v = 1 + 0.3 * rng.standard_normal(p.shape) if "norm" in name else 0.15 * rng.standard_normal(p.shape)
        p.set_value(v.astype("float32"))


def load_shards(ref, tps, cfg, model_type, split=expected_split):
    full = {k: v.numpy() for k, v in ref.state_dict().items()}
    for r, m in enumerate(tps):
        for name, p in m.state_dict().items():
            axis, segs = split(name, cfg, model_type)
            value = full[name] if axis is None else np_take(full[name], axis, segs, r)
            assert list(value.shape) == list(p.shape), f"{name}: rank {r} holds {p.shape}, test slices {value.shape}"
            p.set_value(value)


def batch(seed=1, vocab=BASE["vocab_size"], shape=(B, S)):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, shape)
    mask = np.ones(shape, "int64")
    mask[-1, :3] = 0  # left padding
    labels = np.where(rng.random(shape) < 0.3, -100, rng.integers(3, vocab, shape))
    labels[-1, :3] = -100
    return dict(input_ids=paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask),
                position_ids=paddle.to_tensor(np.maximum(np.cumsum(mask, 1) - 1, 0)),
                labels=paddle.to_tensor(labels))


def rel_err(got, want):
    return float(np.max(np.abs(got - want))) / max(1.0, float(np.max(np.abs(want))))


def run_both(model_type, sp=False, lora=None, split=expected_split, over=None, shape=(B, S)):
    """(single model, its loss, the N rank models, their losses, the simulation) after one backward each."""
    over = over or {}
    cfg = config_dict(model_type, **over)
    paddle.seed(0)
    ref = build(model_type, **over)
    randomize(ref)
    sim = SimulatedGroup(N)
    tps = sim.build(lambda r: build(model_type, N, r, sp, **over))
    load_shards(ref, tps, cfg, model_type, split)
    if lora is not None:
        from paddlenlp_ext.adapters import AdapterConfig, adapter_state_dict, apply_adapters, load_adapter_state_dict

        for m in [ref] + tps:
            apply_adapters(m, AdapterConfig.from_dict(lora.to_dict()))
        rng = np.random.default_rng(5)
        state = {k: (rng.standard_normal(v.shape) * 0.1).astype("float32") for k, v in adapter_state_dict(ref).items()}
        for m in [ref] + tps:
            load_adapter_state_dict(m, state)
    inputs = batch(shape=shape)
    loss = ref(**inputs).loss
    loss.backward()
    losses = sim.run(lambda r: tps[r](**inputs).loss)
    paddle.autograd.backward(losses)
    return ref, loss, tps, losses, cfg


@pytest.mark.parametrize("sp,shape", [(False, (B, S)), (True, (B, S)), (True, (3, 5))],
                         ids=["tp2", "tp2_sp", "tp2_sp_odd_tokens"])
@pytest.mark.parametrize("model_type", ROWS)
def test_two_ranks_equal_one_process_loss_and_every_gradient(model_type, sp, shape):
    """tp2_sp_odd_tokens: 15 tokens over 2 ranks (sequence parallel pads a zero row and drops it again)."""
    ref, loss, tps, losses, cfg = run_both(model_type, sp, shape=shape)
    for r, lr in enumerate(losses):
        assert abs(float(lr) - float(loss)) <= TOL * max(1.0, abs(float(loss))), f"rank {r} loss {lr} vs {loss}"
    ref_params = dict(ref.named_parameters())
    rank_params = [dict(m.named_parameters()) for m in tps]
    assert set(rank_params[0]) == set(ref_params)
    split_seen = 0
    for name, p in ref_params.items():
        axis, segs = expected_split(name, cfg, model_type)
        grads = [rp[name].grad.numpy() for rp in rank_params]
        if axis is None:
            for r, g in enumerate(grads):
                err = rel_err(g, p.grad.numpy())
                assert err <= TOL, f"{model_type}: replicated {name} grad on rank {r}: {err:.3g}"
        else:
            split_seen += 1
            err = rel_err(np_join(grads, axis, segs), p.grad.numpy())
            assert err <= TOL, f"{model_type}: split {name} grad: {err:.3g}"
    assert split_seen >= 7 * BASE["num_hidden_layers"] // (2 if FAMILIES[model_type].arch.fused_qkv else 1)


@pytest.mark.parametrize("model_type", ROWS)
def test_lora_on_parallel_layers_equals_one_process_and_saves_the_single_device_adapter(model_type):
    from paddlenlp_ext.adapters import AdapterConfig, adapter_state_dict, iter_adapter_layers
    from paddlenlp_ext.parallel import adapter_shard_specs, adapter_split_axes, full_adapter_state_dict
    from paddlenlp_ext.parallel import unshard_adapter_states

    lora = AdapterConfig(target_modules=list(FAMILIES[model_type].targets), r=4, alpha=8)
    ref, loss, tps, losses, cfg = run_both(model_type, lora=lora)
    assert abs(float(losses[0]) - float(loss)) <= TOL * max(1.0, abs(float(loss)))

    def grads(m):
        return {f"{n}.{s}": getattr(l, s).grad for n, l in iter_adapter_layers(m) for s in l.state_suffixes}

    got = unshard_adapter_states([grads(m) for m in tps], adapter_split_axes(tps[0]), adapter_shard_specs(tps[0]))
    want = grads(ref)
    assert set(got) == set(want) and want
    for k in want:
        assert rel_err(got[k], want[k].numpy()) <= TOL, k
    sim = next(l.collectives.simulation for _, l in iter_adapter_layers(tps[0]))  # the ranks' group
    states = sim.run(lambda r: {k: v.numpy() for k, v in full_adapter_state_dict(tps[r]).items()})
    single = {k: v.numpy() for k, v in adapter_state_dict(ref).items()}
    assert set(states[0]) == set(single)
    for k in single:
        np.testing.assert_array_equal(states[0][k], single[k], err_msg=k)


def _fused_row(kind):
    rows = [r for r in ROWS if getattr(FAMILIES[r].arch, kind)]
    if not rows:
        pytest.skip(f"no dense decoder row with {kind}")
    return rows[0]


def test_negative_control_contiguous_split_of_a_fused_projection_fails():
    model_type = _fused_row("fused_gate_up")

    def wrong(name, cfg, mt):
        axis, _ = expected_split(name, cfg, mt)
        return axis, ()  # the fused output cut in N contiguous blocks: rank 0 would hold gate only

    ref, loss, tps, losses, cfg = run_both(model_type, split=wrong)
    assert abs(float(losses[0]) - float(loss)) > 1e-3


def test_negative_control_per_rank_rms_of_a_whole_projection_norm_fails(monkeypatch):
    rows = [r for r in ROWS if FAMILIES[r].arch.qk_norm == "proj"]
    if not rows:
        pytest.skip("no row with a whole-projection q/k norm")
    from paddlenlp_ext.models.decoder import layers

    real = layers.Norm.forward

    def local_rms(self, x):  # what a per-rank norm over a split projection would compute
        if not self.split:
            return real(self, x)
        x32 = x.astype("float32")
        return self.weight * (x32 * paddle.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))

    monkeypatch.setattr(layers.Norm, "forward", local_rms)
    ref, loss, tps, losses, cfg = run_both(rows[0])
    assert abs(float(losses[0]) - float(loss)) > 1e-3


def test_negative_control_head_norm_gradient_not_summed_over_ranks_fails(monkeypatch):
    rows = [r for r in ROWS if FAMILIES[r].arch.qk_norm == "head"]
    if not rows:
        pytest.skip("no row with a per-head q/k norm")
    from paddlenlp_ext.models.decoder import layers

    monkeypatch.setattr(layers.Norm, "_shared", lambda self, p: p)
    ref, loss, tps, losses, cfg = run_both(rows[0])
    name = next(n for n, _ in ref.named_parameters() if n.endswith("self_attn.q_norm.weight"))
    got = dict(tps[0].named_parameters())[name].grad.numpy()
    assert rel_err(got, dict(ref.named_parameters())[name].grad.numpy()) > 1e-3


def test_heads_that_do_not_divide_the_degree_are_refused():
    sim = SimulatedGroup(N)
    with pytest.raises(ValueError, match="multiples of tensor_parallel_degree=2"):
        sim.build(lambda r: build(ROWS[0], N, r, num_key_value_heads=1))


@pytest.mark.parametrize("model_type", [r for r in ROWS if FAMILIES[r].arch.fused_qkv or
                                        FAMILIES[r].arch.fused_gate_up][:1] or ROWS[:1])
def test_streaming_loader_cuts_each_rank_from_a_single_process_checkpoint(model_type, tmp_path):
    from paddlenlp_ext.models.decoder import classes_for
    from paddlenlp_ext.models.loading import load_model_streaming

    cfg = config_dict(model_type)
    ref = build(model_type)
    randomize(ref, seed=3)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    config_cls, _, lm_cls = classes_for(model_type)
    sim = SimulatedGroup(N)

    def load(r):
        config = config_cls.from_pretrained(str(tmp_path))
        config.tensor_parallel_degree, config.tensor_parallel_rank = N, r
        return load_model_streaming(str(tmp_path), config, "float32", model_class=lm_cls)[0]

    tps = sim.build(load)
    full = {k: v.numpy() for k, v in ref.state_dict().items()}
    for r, m in enumerate(tps):
        for name, p in m.state_dict().items():
            axis, segs = expected_split(name, cfg, model_type)
            want = full[name] if axis is None else np_take(full[name], axis, segs, r)
            np.testing.assert_array_equal(p.numpy(), want, err_msg=f"rank {r} {name}")
