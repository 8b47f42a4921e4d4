"""Tensor-parallel adapters (paddlenlp_ext.parallel), verified by simulating N ranks on one CPU process.

Paddle's CPU build cannot run fleet's tensor parallelism, so every check here runs the layer classes
used under fleet (ParallelLoRALinear / ParallelVeRALinear on Paddle's ColumnParallelLinear /
RowParallelLinear, QuantizedParallelLinear) with SimulatedCollectives, and compares forward outputs and
gradients with the single-device layers.  The test slices and gathers shards with its own numpy code
(EXPECTED_AXES), not the library's, and has negative controls (a collective without its backward
all-reduce, swapped shards, an all-reduce after B) that must make the comparison fail.

Tolerance: max |tp - single| <= 1e-5 * max(1, max |single|).
"""

import json
import math
import os

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear

from paddlenlp_ext.adapters import (
    AdapterConfig,
    AdapterError,
    LoRALinear,
    VeRALinear,
    adapter_state_dict,
    apply_adapters,
    iter_adapter_layers,
    load_adapter,
    load_adapter_state_dict,
    save_adapter,
)
from paddlenlp_ext.adapters.tp_checkpoint import adapter_split_axes, full_adapter_state_dict, unshard_adapter_states
from paddlenlp_ext.adapters.tp_layers import ParallelLoRALinear, ParallelVeRALinear
from paddlenlp_ext.parallel import SimulatedGroup, SimulationError
from paddlenlp_ext.quant.parallel_linear import QuantizedParallelLinear
from paddlenlp_ext.parallel.simulate import SimulatedCollectives

TOL = 1e-5
IN, OUT, R = 128, 64, 8
EXPECTED_AXES = {  # how each adapter tensor is split, per base kind (None: replicated on every rank)
    ("lora", "column"): {"lora_A": None, "lora_B": 1},
    ("lora", "row"): {"lora_A": 0, "lora_B": None},
    ("vera", "column"): {"vera_d": None, "vera_b": 0},
    ("vera", "row"): {"vera_d": None, "vera_b": None},
}


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    return float(np.max(np.abs(got - want))) / max(1.0, float(np.max(np.abs(want))))


def assert_close(got, want, what):
    err = rel_err(got, want)
    assert err <= TOL, f"{what}: relative max error {err:.3g} > {TOL}"


def np_shard(full, axis, rank, n):
    return np.split(np.asarray(full), n, axis=axis)[rank]


def np_shards(full_state, axes, rank, n):
    return {k: (v if axes[k] is None else np_shard(v, axes[k], rank, n)) for k, v in full_state.items()}


def np_gather(rank_values, axis, what):
    """Complete tensor from per-rank values: concat along axis, or (replicated) all equal."""
    if axis is not None:
        return np.concatenate(rank_values, axis=axis)
    for r, v in enumerate(rank_values[1:], start=1):
        assert np.array_equal(v, rank_values[0]), f"{what}: replicated value differs on rank {r}"
    return rank_values[0]


# ---------------------------------------------------------------- layer cases
VARIANTS = {
    "lora": dict(method="lora", cfg=dict(r=R, alpha=16)),
    "rslora": dict(method="lora", cfg=dict(r=R, alpha=16, rslora=True, lora_plus_scale=4.0)),
    "vera": dict(method="vera", cfg=dict(method="vera", r=R)),
    "qlora_nf4": dict(method="lora", cfg=dict(r=R, alpha=16), quant=("nf4", 64)),
    "qlora_int8": dict(method="lora", cfg=dict(r=R, alpha=16), quant=("weight_only_int8", 64)),
}


def case_tensors(method, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    t = dict(W=f(IN, OUT) / math.sqrt(IN), bias=f(OUT) * 0.1, x=f(2, 3, IN), G=f(2, 3, OUT))
    if method == "lora":
        t["adapter"] = {"lora_A": f(IN, R) * 0.2, "lora_B": f(R, OUT) * 0.2}
    else:
        t["adapter"] = {"vera_d": f(R), "vera_b": f(OUT)}
    return t


def build_tp_bases(kind, n, t, opt, quant=None, seed=7, sequence_parallel=False):
    """Paddle's Column/RowParallelLinear (or, ``sequence_parallel``, their sequence-parallel versions) on n
    simulated ranks, holding the test's shards of W and bias."""
    sim = SimulatedGroup(n)
    column, row = ColumnParallelLinear, RowParallelLinear
    if sequence_parallel:
        from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

        column, row = spu.ColumnSequenceParallelLinear, spu.RowSequenceParallelLinear

    def make(r):
        g = sim.process_group(r)
        if kind == "column":
            return column(IN, OUT, has_bias=True, gather_output=opt, mp_group=g)
        return row(IN, OUT, has_bias=True, input_is_parallel=opt, mp_group=g)

    bases = sim.build(make, seed=seed)
    axis = 1 if kind == "column" else 0
    for r, b in enumerate(bases):
        b.weight.set_value(np_shard(t["W"], axis, r, n))
        b.bias.set_value(np_shard(t["bias"], 0, r, n) if kind == "column" else t["bias"])
    if quant:
        algo, bs = quant
        bases = [QuantizedParallelLinear.from_parallel_linear(b, algo, block_size=bs, backend="portable")
                 for b in bases]  # fmt: skip
    return sim, bases


def reference_base(kind, n, t, bases, quant):
    """The single-device base: the float weight, or for QLoRA the shards' dequantized weights joined."""
    lin = paddle.nn.Linear(IN, OUT)
    w = t["W"]
    if quant:
        axis = 1 if kind == "column" else 0
        w = np.concatenate([b.dequantize_weight("float32").numpy() for b in bases], axis=axis)
    lin.weight.set_value(w)
    lin.bias.set_value(t["bias"])
    return lin


def run_layer_case(kind, n, variant, opt, *, collectives_cls=None, shard_perm=None, layer_cls=None):
    v = VARIANTS[variant]
    method = v["method"]
    t = case_tensors(method)
    sim, bases = build_tp_bases(kind, n, t, opt, v.get("quant"))
    cfg = AdapterConfig(**v["cfg"])
    ref_base = reference_base(kind, n, t, bases, v.get("quant"))
    shared = VeRALinear.build_shared(cfg, [ref_base]) if method == "vera" else None
    ref = (VeRALinear if method == "vera" else LoRALinear)(ref_base, cfg, shared=shared)
    ref.load_adapter_state_dict(t["adapter"])
    cls = layer_cls or (ParallelVeRALinear if method == "vera" else ParallelLoRALinear)
    axes = EXPECTED_AXES[method, kind]
    layers = []
    for r, b in enumerate(bases):
        comm = collectives_cls(sim, r) if collectives_cls else None
        layer = cls(b, cfg, shared=shared, collectives=comm)
        assert layer.split_axes() == axes
        src = shard_perm[r] if shard_perm else r
        layer.load_adapter_state_dict(np_shards(t["adapter"], axes, src, n))
        layers.append(layer)

    xr = paddle.to_tensor(t["x"], stop_gradient=False)
    y_ref = ref(xr)
    (y_ref * paddle.to_tensor(t["G"])).sum().backward()

    split_input = kind == "row" and opt  # input_is_parallel: each rank gets its slice of x
    xs = [paddle.to_tensor(np_shard(t["x"], -1, r, n) if split_input else t["x"], stop_gradient=False)
          for r in range(n)]  # fmt: skip
    ys = sim.run(lambda r: layers[r](xs[r]))
    split_output = kind == "column" and not opt  # no gather_output: each rank holds its slice of y
    grads_out = [np_shard(t["G"], -1, r, n) if split_output else t["G"] for r in range(n)]
    paddle.autograd.backward([(y * paddle.to_tensor(g)).sum() for y, g in zip(ys, grads_out)])

    out = {
        "y": (np.concatenate([y.numpy() for y in ys], -1) if split_output
              else np_gather([y.numpy() for y in ys], None, "output")),
        "x.grad": (np.concatenate([x.grad.numpy() for x in xs], -1) if split_input
                   else np_gather([x.grad.numpy() for x in xs], None, "input grad")),
    }  # fmt: skip
    for s, axis in axes.items():
        out[f"{s}.grad"] = np_gather([getattr(l, s).grad.numpy() for l in layers], axis, f"{s}.grad")
    want = {"y": y_ref.numpy(), "x.grad": xr.grad.numpy()}
    want.update({f"{s}.grad": getattr(ref, s).grad.numpy() for s in axes})
    return out, want, dict(sim=sim, layers=layers, ref=ref, t=t, xs=xs)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("opt", [True, False], ids=["gather_or_parallel_input", "local_output_or_split"])
def test_tp_layer_matches_single_device(n, kind, variant, opt):
    """Forward output, input gradient and adapter gradients (gathered) equal the unsharded layer's."""
    got, want, _ = run_layer_case(kind, n, variant, opt)
    for key in want:
        assert_close(got[key], want[key], f"{variant} {kind} N={n} {key}")
    assert np.abs(want["x.grad"]).max() > 0.1  # the gradients compared are not trivially zero


def test_negative_control_identity_without_backward_all_reduce():
    """A column collective that forgets c_identity's backward all-reduce (the forward is unchanged):
    the ranks' A gradients, or input gradients, become partial sums that disagree."""

    class NoReduce(SimulatedCollectives):
        def identity(self, x):
            return x

    with pytest.raises(AssertionError, match="replicated value differs"):  # A's grads: rank partials
        run_layer_case("column", 2, "lora", True, collectives_cls=NoReduce)

    class NoReduceOnInput(SimulatedCollectives):  # only the base path's identity (1st call) loses it
        calls = 0

        def identity(self, x):
            self.calls += 1
            return x if self.calls == 1 else super().identity(x)

    with pytest.raises(AssertionError, match="input grad: replicated value differs"):  # each rank: a partial
        run_layer_case("column", 2, "lora", True, collectives_cls=NoReduceOnInput)


def test_negative_control_wrong_shards():
    got, want, _ = run_layer_case("row", 2, "lora", False, shard_perm=[1, 0])
    assert rel_err(got["y"], want["y"]) > 1e-2


def test_negative_control_all_reduce_after_B():
    """Reducing after multiplying by B gives the same output, but B's gradient on each rank is a partial
    sum: ranks disagree and none has the complete gradient (why the all-reduce comes before B)."""
    from paddlenlp_ext.parallel.shard import local_product, output_bias

    class ReduceAfterB(ParallelLoRALinear):
        def forward(self, x):
            comm, base = self.collectives, self.base_layer
            out = comm.all_reduce(local_product(base, x))
            out = out + comm.all_reduce(self._branch_out(self._branch_in(x)))
            return out + output_bias(base)

    with pytest.raises(AssertionError, match="lora_B.grad: replicated value differs"):
        run_layer_case("row", 2, "lora", True, layer_cls=ReduceAfterB)


def test_shard_quantization_equals_whole_weight_quantization_when_groups_align():
    """Column parallel (any algo) and row parallel nf4 with block | in/N quantize exactly as the whole
    weight does; row-parallel int8 uses per-shard channel scales (close, not equal)."""
    from paddlenlp_ext.quant import QuantizedLinear

    t = case_tensors("lora")
    for kind, algo, n, exact in [("column", "nf4", 4, True), ("column", "weight_only_int8", 2, True),
                                 ("row", "nf4", 2, True), ("row", "weight_only_int8", 2, False)]:  # fmt: skip
        _, bases = build_tp_bases(kind, n, t, True, (algo, 64))
        joined = np.concatenate([b.dequantize_weight("float32").numpy() for b in bases], 1 if kind == "column" else 0)
        whole = QuantizedLinear.from_weight(t["W"], None, algo, 64, backend="portable").dequantize_weight("float32")
        err = np.abs(joined - whole.numpy()).max()
        assert (err == 0) if exact else (0 < err < 0.05), (kind, algo, err)


def test_column_dropout_masks_agree_like_fleet():
    """With dropout, every simulated rank draws the replicated input's mask from the same generator state
    (fleet seeds the global generator alike on all model-parallel ranks): equal to the single-device run."""
    t = case_tensors("lora")
    sim, bases = build_tp_bases("column", 2, t, True)
    cfg = AdapterConfig(r=R, alpha=16, dropout=0.5)
    ref = LoRALinear(reference_base("column", 2, t, bases, None), cfg)
    ref.load_adapter_state_dict(t["adapter"])
    layers = [ParallelLoRALinear(b, cfg) for b in bases]
    for r, layer in enumerate(layers):
        layer.load_adapter_state_dict(np_shards(t["adapter"], EXPECTED_AXES["lora", "column"], r, 2))
    x = paddle.to_tensor(t["x"])
    paddle.seed(11)
    y_ref = ref(x).numpy()
    paddle.seed(11)
    ys = sim.run(lambda r: layers[r](x))
    for y in ys:
        assert_close(y.numpy(), y_ref, "dropout output")
    assert rel_err(y_ref, ref.base_layer(x).numpy()) > 1e-3  # the adapter branch (with dropout) contributed


def test_loading_complete_tensors_slices_each_rank():
    t = case_tensors("lora")
    for kind in ("column", "row"):
        _, bases = build_tp_bases(kind, 4, t, True)
        axes = EXPECTED_AXES["lora", kind]
        for r, b in enumerate(bases):
            layer = ParallelLoRALinear(b, AdapterConfig(r=R))
            layer.load_adapter_state_dict(t["adapter"])  # complete tensors
            for s, want in np_shards(t["adapter"], axes, r, 4).items():
                np.testing.assert_array_equal(getattr(layer, s).numpy(), want)
            assert layer.saved_shapes() == {s: list(v.shape) for s, v in t["adapter"].items()}
            with pytest.raises(AdapterError, match="neither the complete"):
                layer.load_adapter_state_dict({"lora_A": t["adapter"]["lora_A"][:3], "lora_B": t["adapter"]["lora_B"]})


def test_init_row_A_is_the_single_device_draw_and_lora_plus_lr():
    t = case_tensors("lora")
    cfg = AdapterConfig(r=R, lora_plus_scale=4.0)
    base = paddle.nn.Linear(IN, OUT)
    paddle.seed(3)
    single = LoRALinear(base, cfg)
    for kind in ("column", "row"):
        sim, bases = build_tp_bases(kind, 2, t, True)
        paddle.seed(3)  # build: every rank starts from this global generator state, as under fleet
        layers = sim.build(lambda r: ParallelLoRALinear(bases[r], cfg))
        axis = EXPECTED_AXES["lora", kind]["lora_A"]
        joined = np_gather([l.lora_A.numpy() for l in layers], axis, "lora_A")
        np.testing.assert_array_equal(joined, single.lora_A.numpy())
        for layer in layers:
            assert float(np.abs(layer.lora_B.numpy()).max()) == 0.0
            assert layer.lora_B.optimize_attr["learning_rate"] == 4.0
            assert layer.lora_A.optimize_attr["learning_rate"] == 1.0
            split = {s: getattr(layer, s).is_distributed for s in ("lora_A", "lora_B")}
            assert split == {s: a is not None for s, a in EXPECTED_AXES["lora", kind].items()}


# ------------------------------------------------------------------ simulation
def test_simulation_reports_divergence_and_failures_without_hanging():
    sim = SimulatedGroup(3)
    comms = [sim.collectives(r) for r in range(3)]
    x = paddle.ones([2, 6])
    with pytest.raises(SimulationError, match="diverged.*rank 1: \\('all_reduce'"):
        sim.run(lambda r: comms[r].all_reduce(x) if r == 1 else comms[r].identity(x))

    def fail_on_rank_1(r):
        y = comms[r].identity(x)
        if r == 1:
            raise ValueError("boom on rank 1")
        return comms[r].all_reduce(y)

    with pytest.raises(ValueError, match="boom on rank 1"):
        sim.run(fail_on_rank_1)
    with pytest.raises(SimulationError, match="only work inside"):
        comms[0].identity(x)
    sums = sim.run(lambda r: comms[r].all_reduce(x * (r + 1)))  # the group is usable again
    assert all(float(s.numpy()[0, 0]) == 6.0 for s in sums)


def test_simulated_ranks_share_the_generator_and_grad_mode():
    sim = SimulatedGroup(2)
    paddle.seed(5)
    a, b = paddle.rand([4]).numpy(), paddle.rand([4]).numpy()
    paddle.seed(5)
    firsts = sim.run(lambda r: paddle.rand([4]).numpy())
    assert all(np.array_equal(f, a) for f in firsts)
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), b)  # continues where rank 0 stopped
    w = paddle.ones([3])
    w.stop_gradient = False
    with paddle.no_grad():
        outs = sim.run(lambda r: w * 2)
    assert all(o.stop_gradient for o in outs)


def test_simulated_split_and_gather_gradients():
    """split: backward gathers every rank's gradient; all_gather: backward keeps the own slice."""
    sim = SimulatedGroup(2)
    comms = [sim.collectives(r) for r in range(2)]
    xs = [paddle.arange(8, dtype="float32").reshape([2, 4]) for _ in range(2)]
    for x in xs:
        x.stop_gradient = False
    parts = sim.run(lambda r: comms[r].split(xs[r]))
    np.testing.assert_array_equal(parts[1].numpy(), xs[1].numpy()[:, 2:])
    paddle.autograd.backward([(p * (r + 1)).sum() for r, p in enumerate(parts)])
    np.testing.assert_array_equal(xs[0].grad.numpy(), np.array([[1, 1, 2, 2]] * 2, np.float32))
    ys = [paddle.ones([2, 3]) * (r + 1) for r in range(2)]
    for y in ys:
        y.stop_gradient = False
    full = sim.run(lambda r: comms[r].all_gather(ys[r]))
    assert full[0].shape == [2, 6]
    paddle.autograd.backward([(f * paddle.arange(6, dtype="float32")).sum() for f in full])
    np.testing.assert_array_equal(ys[1].grad.numpy(), np.array([[3, 4, 5]] * 2, np.float32))


# ------------------------------------------------------------ decoder layers
def llama_config(tp, rank, kv_heads):
    from paddlenlp.transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        num_hidden_layers=2,
        vocab_size=64,
        tensor_parallel_degree=tp,
        tensor_parallel_rank=rank,
    )


class TwoLayers(paddle.nn.Layer):
    """Two Llama decoder layers in a row (row-parallel output feeding column-parallel input)."""

    def __init__(self, config):
        super().__init__()
        from paddlenlp.transformers.llama.modeling import LlamaDecoderLayer

        self.layers = paddle.nn.LayerList([LlamaDecoderLayer(config) for _ in range(2)])

    def forward(self, h, mask):
        for layer in self.layers:
            h = layer(h, attention_mask=mask)
            h = h[0] if isinstance(h, tuple) else h
        return h


def load_full_weights(model, full, rank, n):
    """The single-device weights into rank's model: Paddle marks split weights is_distributed/split_axis."""
    for name, p in model.named_parameters():
        value = full[name].numpy()
        if getattr(p, "is_distributed", False):
            value = np_shard(value, p.split_axis, rank, n)
        p.set_value(value)


DECODER_CASES = {
    "lora": dict(cfg=dict(r=4, alpha=8, rslora=True, lora_plus_scale=4.0)),
    "vera": dict(cfg=dict(method="vera", r=4)),
    "qlora_nf4": dict(cfg=dict(r=4, alpha=8), quant="nf4"),
}


@pytest.mark.parametrize("n,kv_heads", [(2, 2), (4, 4)])
@pytest.mark.parametrize("case", list(DECODER_CASES))
def test_llama_decoder_layers_match_single_device(n, kv_heads, case):
    """Two PaddleNLP LlamaDecoderLayers built with tensor_parallel_degree=n (their own TP attention/MLP
    code), adapters applied by apply_adapters: output, input gradient and every adapter gradient equal the
    single-device model's; one SGD step (LoRA+ learning rates) leaves the same complete adapter."""
    from paddlenlp.transformers.llama.modeling import LlamaModel

    from paddlenlp_ext.models.quantize import quantize_model

    spec = DECODER_CASES[case]
    targets = [r".*_proj"]
    paddle.seed(0)
    ref = TwoLayers(llama_config(1, 0, kv_heads))
    sim = SimulatedGroup(n)
    tps = sim.build(lambda r: TwoLayers(llama_config(n, r, kv_heads)))
    full = ref.state_dict()
    for r, m in enumerate(tps):
        load_full_weights(m, full, r, n)
    if spec.get("quant"):  # block 4 divides every row-parallel shard's in (64/N, 176/N): same codes as whole
        quantize_model(ref, spec["quant"], block_size=4, target_modules=targets)
        for m in tps:
            stats = quantize_model(m, spec["quant"], block_size=4, target_modules=targets)
            assert stats["layers_replaced"] == 14
            assert isinstance(m.layers[0].mlp.down_proj, QuantizedParallelLinear)
    cfg = AdapterConfig(target_modules=targets, **spec["cfg"])
    apply_adapters(ref, cfg)
    for m in tps:
        apply_adapters(m, AdapterConfig.from_dict(cfg.to_dict()))
    assert all(type(l).__name__.startswith("Parallel") for _, l in iter_adapter_layers(tps[0]))
    rng = np.random.default_rng(1)
    state = {k: (rng.standard_normal(v.shape) * 0.1).astype("float32") for k, v in adapter_state_dict(ref).items()}
    load_adapter_state_dict(ref, state)
    axes = adapter_split_axes(tps[0])
    for r, m in enumerate(tps):
        load_adapter_state_dict(m, state)  # complete tensors: each rank keeps its part
        for k, v in adapter_state_dict(m).items():
            np.testing.assert_array_equal(v.numpy(), state[k] if axes[k] is None else np_shard(state[k], axes[k], r, n))

    b, s = 2, 5
    mask = LlamaModel._prepare_decoder_attention_mask(None, (b, s), 0, "float32")
    x = rng.standard_normal((b, s, 64)).astype("float32")
    g = paddle.to_tensor(rng.standard_normal((b, s, 64)).astype("float32"))
    xr = paddle.to_tensor(x, stop_gradient=False)
    y_ref = ref(xr, mask)
    (y_ref * g).sum().backward()
    xs = [paddle.to_tensor(x, stop_gradient=False) for _ in range(n)]
    ys = sim.run(lambda r: tps[r](xs[r], mask))
    paddle.autograd.backward([(y * g).sum() for y in ys])
    for r in range(n):
        assert_close(ys[r].numpy(), y_ref.numpy(), f"rank {r} output")
        assert_close(xs[r].grad.numpy(), xr.grad.numpy(), f"rank {r} input grad")

    def grads(m):
        return {f"{name}.{suffix}": getattr(l, suffix).grad for name, l in iter_adapter_layers(m)
                for suffix in l.state_suffixes}  # fmt: skip

    got = unshard_adapter_states([grads(m) for m in tps], axes)  # replicated grads must agree bitwise
    want = grads(ref)
    assert set(got) == set(want) and len(got) == 28
    for k in want:
        assert_close(got[k], want[k].numpy(), f"grad {k}")

    opt_ref = paddle.optimizer.SGD(0.5, parameters=[p for p in ref.parameters() if not p.stop_gradient])
    opt_ref.step()
    for m in tps:
        paddle.optimizer.SGD(0.5, parameters=[p for p in m.parameters() if not p.stop_gradient]).step()
    stepped = sim.run(lambda r: {k: v.numpy() for k, v in full_adapter_state_dict(tps[r]).items()})
    for k, v in adapter_state_dict(ref).items():
        assert_close(stepped[0][k], v.numpy(), f"after a step {k}")
    assert all(rel_err(v.numpy(), state[k]) > 0 for k, v in adapter_state_dict(ref).items())  # all trained


def test_neftune_noise_agrees_across_ranks():
    """NEFTune on the (replicated) embedding output of a TP-LoRA model: every simulated rank draws the same
    noise (as under fleet, where the global generator is seeded alike on the model-parallel ranks), so the
    TP model equals the single-device one with the same seed."""
    from paddlenlp.transformers.llama.modeling import LlamaModel

    from paddlenlp_ext.adapters import attach_neftune

    class Model(paddle.nn.Layer):
        def __init__(self, config):
            super().__init__()
            self.embed = paddle.nn.Embedding(64, 64)
            self.body = TwoLayers(config)

        def forward(self, ids, mask):
            return self.body(self.embed(ids), mask)

    paddle.seed(0)
    ref = Model(llama_config(1, 0, 2))
    sim = SimulatedGroup(2)
    tps = sim.build(lambda r: Model(llama_config(2, r, 2)))
    for r, m in enumerate(tps):
        load_full_weights(m, ref.state_dict(), r, 2)
    cfg = dict(r=4, alpha=8, target_modules=[r".*_proj"])
    for m in [ref] + tps:
        apply_adapters(m, AdapterConfig(**cfg))
        m.train()
    hooks = [attach_neftune(m, 5.0, embedding=m.embed) for m in [ref] + tps]
    ids = paddle.to_tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    lengths = np.array([[5] * 5, [3, 3, 3, 0, 0]], np.float32)
    mask = LlamaModel._prepare_decoder_attention_mask(None, (2, 5), 0, "float32")
    for h in hooks:
        h.set_token_lengths(lengths)
    paddle.seed(9)
    y_ref = ref(ids, mask).numpy()
    paddle.seed(9)
    ys = sim.run(lambda r: tps[r](ids, mask).numpy())
    for y in ys:
        assert_close(y, y_ref, "NEFTune + TP LoRA output")
    for h in hooks[1:]:
        h.set_token_lengths(lengths)
    ys_other_seed = sim.run(lambda r: tps[r](ids, mask).numpy())  # the generator moved on: other noise
    assert rel_err(ys_other_seed[0], y_ref) > 1e-4
    for h in hooks:
        h.remove()


def test_merge_in_place_and_disable_under_tp():
    t = case_tensors("lora")
    sim, bases = build_tp_bases("row", 2, t, True)
    layers = [ParallelLoRALinear(b, AdapterConfig(r=R, alpha=16)) for b in bases]
    for r, layer in enumerate(layers):
        layer.load_adapter_state_dict(t["adapter"])
    xs = [paddle.to_tensor(np_shard(t["x"], -1, r, 2)) for r in range(2)]
    before = sim.run(lambda r: layers[r](xs[r]).numpy())
    for layer in layers:
        layer.merge()
    merged = sim.run(lambda r: layers[r](xs[r]).numpy())
    assert_close(merged[0], before[0], "merged forward")
    for layer in layers:
        layer.unmerge()
        layer.disabled = True
    base_only = sim.run(lambda r: layers[r](xs[r]).numpy())
    assert rel_err(base_only[0], before[0]) > 1e-3


# --------------------------------------------------------------- checkpoints
def build_tp_models(model_dir, n):
    from paddlenlp.transformers import AutoConfig, LlamaForCausalLM

    def build(r):
        c = AutoConfig.from_pretrained(model_dir)
        c.tensor_parallel_degree, c.tensor_parallel_rank = n, r
        return LlamaForCausalLM(c)

    sim = SimulatedGroup(n)
    return sim, sim.build(build)


@pytest.mark.parametrize("method", ["lora", "vera"])
def test_sharded_adapter_checkpoint_merges_like_the_unsharded_one(tiny_model_dir, tmp_path, method):
    """Rank shards (made by the test's own slicing) saved from a simulated TP model: rank 0 writes the
    complete adapter, equal to the single-device save, and merging either gives the same weights."""
    from paddlenlp.transformers import AutoConfig, LlamaForCausalLM
    from safetensors.numpy import load_file

    from paddlenlp_ext.merge import merge_adapter_checkpoint

    n = 2
    cfg = AdapterConfig(r=4, alpha=8) if method == "lora" else AdapterConfig(method="vera", r=4)
    ref = LlamaForCausalLM(AutoConfig.from_pretrained(tiny_model_dir))
    apply_adapters(ref, AdapterConfig.from_dict(cfg.to_dict()))
    rng = np.random.default_rng(2)
    full = {k: (rng.standard_normal(v.shape) * 0.05).astype("float32") for k, v in adapter_state_dict(ref).items()}
    load_adapter_state_dict(ref, full)
    save_adapter(ref, None, str(tmp_path / "ref"))

    sim, tps = build_tp_models(tiny_model_dir, n)
    for r, m in enumerate(tps):
        apply_adapters(m, AdapterConfig.from_dict(cfg.to_dict()))
        for name, layer in iter_adapter_layers(m):
            kind = "column" if layer.shard.kind == "column" else "row"
            own = np_shards({s: full[f"{name}.{s}"] for s in layer.state_suffixes}, EXPECTED_AXES[method, kind], r, n)
            layer.load_adapter_state_dict(own)
    paths = sim.run(lambda r: save_adapter(tps[r], None, str(tmp_path / "tp")))
    assert paths[0] == paths[1]
    assert sorted(os.listdir(tmp_path / "tp")) == sorted(os.listdir(tmp_path / "ref"))
    got, want = (
        load_file(str(tmp_path / "tp" / "adapter_model.safetensors")),
        load_file(str(tmp_path / "ref" / "adapter_model.safetensors")),
    )
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    with open(tmp_path / "tp" / "adapter_config.json") as f1, open(tmp_path / "ref" / "adapter_config.json") as f2:
        assert json.load(f1) == json.load(f2)

    for which in ("ref", "tp"):
        merge_adapter_checkpoint(tiny_model_dir, str(tmp_path / which), str(tmp_path / f"merged_{which}"),
                                 verify=False, log=lambda *a: None)  # fmt: skip
    m_ref = load_file(str(tmp_path / "merged_ref" / "model.safetensors"))
    m_tp = load_file(str(tmp_path / "merged_tp" / "model.safetensors"))
    base = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert set(m_ref) == set(m_tp)
    for k in m_ref:
        np.testing.assert_array_equal(m_tp[k], m_ref[k])
    assert not np.array_equal(m_tp["llama.layers.0.mlp.down_proj.weight"], base["llama.layers.0.mlp.down_proj.weight"])

    # the complete adapter loads into a fresh tensor-parallel model by slicing
    _, fresh = build_tp_models(tiny_model_dir, n)
    for r, m in enumerate(fresh):
        load_adapter(m, str(tmp_path / "tp"))
        axes = adapter_split_axes(m)
        for k, v in adapter_state_dict(m).items():
            np.testing.assert_array_equal(v.numpy(), full[k] if axes[k] is None else np_shard(full[k], axes[k], r, n))


def test_unshard_adapter_states_offline():
    t = case_tensors("lora")
    _, bases = build_tp_bases("column", 2, t, True)
    layers = [ParallelLoRALinear(b, AdapterConfig(r=R)) for b in bases]
    for layer in layers:
        layer.load_adapter_state_dict(t["adapter"])
    states = [layer.adapter_state_dict() for layer in layers]
    full = unshard_adapter_states(states, layers[0].split_axes())
    for s in full:
        np.testing.assert_array_equal(full[s], t["adapter"][s])
    wrong = unshard_adapter_states(states, {"lora_A": None, "lora_B": 0})  # negative control: wrong axis
    assert wrong["lora_B"].shape != t["adapter"]["lora_B"].shape
    states[1] = {**states[1], "lora_A": states[1]["lora_A"] * 2}
    with pytest.raises(AdapterError, match="replicated adapter tensor 'lora_A' differs"):
        unshard_adapter_states(states, layers[0].split_axes())


# ------------------------------------------------------------------ refusals
def test_refused_methods_and_layers_have_clear_errors(tiny_model_dir):
    import importlib

    _, tps = build_tp_models(tiny_model_dir, 2)
    m = tps[0]
    with pytest.raises(NotImplementedError, match="PiSSA is not supported with tensor parallelism"):
        apply_adapters(m, AdapterConfig(r=4, pissa=True))
    with pytest.raises(NotImplementedError, match="LoKr is not supported with tensor parallelism"):
        apply_adapters(m, AdapterConfig(method="lokr", r=4))
    assert not iter_adapter_layers(m)  # refused before anything was replaced
    with pytest.raises(ValueError, match="no target module is tensor parallel"):
        apply_adapters(
            paddle.nn.Sequential(("layers", paddle.nn.LayerList([paddle.nn.Linear(4, 4)]))),
            AdapterConfig(r=2, target_modules=[r".*"]),
            collectives=SimulatedGroup(1).collectives(0),
        )
    q = m.llama.layers[0].self_attn.q_proj
    with pytest.raises(NotImplementedError, match="PiSSA"):
        ParallelLoRALinear(q, AdapterConfig(r=4, pissa=True))
    with pytest.raises(NotImplementedError, match="tensor parallel: LoRALinear wraps single-device"):
        LoRALinear(q, AdapterConfig(r=4))

    from paddlenlp.transformers import AutoConfig, LlamaForCausalLM

    def fused(r):
        c = AutoConfig.from_pretrained(tiny_model_dir)
        c.tensor_parallel_degree, c.tensor_parallel_rank, c.fuse_attention_qkv = 2, r, True
        return LlamaForCausalLM(c)

    fused_model = SimulatedGroup(2).build(fused)[0]
    with pytest.raises(NotImplementedError, match=r"layers\.0\.self_attn\.qkv_proj.*set fuse_attention_qkv=false"):
        apply_adapters(fused_model, AdapterConfig(r=4))

    mod = importlib.import_module("paddle.distributed.fleet.utils.sequence_parallel_utils")

    class MC2ColumnSeqParallelLinear(mod.ColumnSequenceParallelLinear):  # a vendor subclass: communicates otherwise
        pass

    seq = MC2ColumnSeqParallelLinear.__new__(MC2ColumnSeqParallelLinear)
    paddle.nn.Layer.__init__(seq)
    seq.weight = seq.create_parameter([64, 32])
    m.llama.layers[1].self_attn.q_proj = seq
    with pytest.raises(
        NotImplementedError,
        match=r"llama\.layers\.1\.self_attn\.q_proj.*only Paddle's "
        r"ColumnParallelLinear",
    ):
        apply_adapters(m, AdapterConfig(r=4))


def test_mp_ops_integration_relied_on_and_construction_is_removed():
    """integrations.mp_ops: the fleet symbols it relies on exist, and the construction context leaves
    nothing behind."""
    import importlib
    import inspect

    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

    from paddlenlp_ext.integrations import mp_ops
    from paddlenlp_ext.parallel import FleetCollectives, collectives_for

    for owner_path, attr, params in mp_ops.RELIED_ON:
        parts = owner_path.split(".")
        for i in range(len(parts), 0, -1):
            try:
                owner = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        for a in parts[i:]:
            owner = getattr(owner, a)
        assert hasattr(owner, attr), f"{owner_path}.{attr}"
        if params is not None:
            assert tuple(inspect.signature(getattr(owner, attr)).parameters) == params, f"{owner_path}.{attr}"
    sim = SimulatedGroup(2)
    layers = sim.build(lambda r: ColumnParallelLinear(8, 8, has_bias=False, gather_output=False))
    assert [l.model_parallel_group.rank for l in layers] == [0, 1]  # no mp_group given: the simulated HCG
    assert not mp_ops.is_installed()
    assert not hasattr(fleet.fleet, "_user_defined_strategy")
    assert "model_parallel_rng" not in get_rng_state_tracker().states_
    with pytest.raises((AttributeError, ValueError)):  # fleet is not set up any more
        ColumnParallelLinear(8, 8, has_bias=False, mp_group=sim.process_group(0))

    class FakeFleetGroup:  # what collectives_for sees on a real run: a fleet Group
        rank, nranks = 1, 4

    comm = collectives_for(FakeFleetGroup())
    assert isinstance(comm, FleetCollectives) and (comm.rank, comm.world_size) == (1, 4)
