"""Sequence-parallel adapters (sequence_parallel=true), verified by simulating N ranks on one CPU process.

The same ParallelLoRALinear / ParallelVeRALinear as under fleet, on Paddle's own
ColumnSequenceParallelLinear / RowSequenceParallelLinear built for simulated ranks, with the
simulated AllGatherOp / ReduceScatterOp / ScatterOp.  Rank i's column input and row output are
rows [i*S/N, (i+1)*S/N) of the sequence (axis 0); the row input is the full sequence with this
rank's slice of the hidden axis.  Outputs and every gradient, joined with the test's own numpy
code, must equal the single-device layer (1e-5); negative controls drop the row branch's scatter
(the rows of another rank would be added) and the column branch's identity (A's gradient
becomes partial).
"""

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils.sequence_parallel_utils import (
    ColumnSequenceParallelLinear,
    RowSequenceParallelLinear,
)

from paddlenlp_ext.adapters import AdapterConfig, LoRALinear, VeRALinear
from paddlenlp_ext.adapters.tp_layers import ParallelLoRALinear, ParallelVeRALinear
from paddlenlp_ext.parallel import SimulatedGroup
from paddlenlp_ext.parallel.simulate import SimulatedCollectives
from test_tp_sim import EXPECTED_AXES, IN, OUT, R, assert_close, build_tp_bases, np_gather, np_shard

SEQ, BATCH = 8, 3

VARIANTS = {
    "lora": dict(method="lora", cfg=dict(r=R, alpha=16)),
    "rslora": dict(method="lora", cfg=dict(r=R, alpha=16, rslora=True, lora_plus_scale=4.0)),
    "vera": dict(method="vera", cfg=dict(method="vera", r=R)),
}


def tensors(method, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    t = dict(W=f(IN, OUT) / np.sqrt(IN), bias=f(OUT) * 0.1, x=f(SEQ, BATCH, IN), G=f(SEQ, BATCH, OUT))
    t["adapter"] = ({"lora_A": f(IN, R) * 0.2, "lora_B": f(R, OUT) * 0.2} if method == "lora"
                    else {"vera_d": f(R), "vera_b": f(OUT)})  # fmt: skip
    return t


def run_case(kind, n, variant, collectives_cls=None):
    v = VARIANTS[variant]
    method, t = v["method"], tensors(v["method"])
    # gather_output=False / input_is_parallel=True: what Paddle's sequence-parallel linears require
    sim, bases = build_tp_bases(kind, n, t, kind == "row", sequence_parallel=True)
    assert type(bases[0]) is (ColumnSequenceParallelLinear if kind == "column" else RowSequenceParallelLinear)
    cfg = AdapterConfig(**v["cfg"])
    ref_base = paddle.nn.Linear(IN, OUT)
    ref_base.weight.set_value(t["W"])
    ref_base.bias.set_value(t["bias"])
    shared = VeRALinear.build_shared(cfg, [ref_base]) if method == "vera" else None
    ref = (VeRALinear if method == "vera" else LoRALinear)(ref_base, cfg, shared=shared)
    ref.load_adapter_state_dict(t["adapter"])
    cls = ParallelVeRALinear if method == "vera" else ParallelLoRALinear
    axes = EXPECTED_AXES[method, kind]
    layers = []
    for r, b in enumerate(bases):
        layer = cls(b, cfg, shared=shared, collectives=collectives_cls(sim, r) if collectives_cls else None)
        assert layer.shard.sequence_parallel and layer.split_axes() == axes
        layer.load_adapter_state_dict({k: (a if axes[k] is None else np_shard(a, axes[k], r, n))
                                       for k, a in t["adapter"].items()})  # fmt: skip
        layers.append(layer)

    xr = paddle.to_tensor(t["x"], stop_gradient=False)
    y_ref = ref(xr)
    (y_ref * paddle.to_tensor(t["G"])).sum().backward()

    # column: rank i gets its rows of the sequence; row: the whole sequence, its slice of the hidden axis
    x_axis = 0 if kind == "column" else -1
    xs = [paddle.to_tensor(np_shard(t["x"], x_axis, r, n), stop_gradient=False) for r in range(n)]
    ys = sim.run(lambda r: layers[r](xs[r]))
    # column output: all rows, this rank's columns; row output: this rank's rows, all columns
    y_axis = -1 if kind == "column" else 0
    paddle.autograd.backward([(y * paddle.to_tensor(np_shard(t["G"], y_axis, r, n))).sum()
                              for r, y in enumerate(ys)])  # fmt: skip
    got = {
        "y": np.concatenate([y.numpy() for y in ys], y_axis),
        "x.grad": np.concatenate([x.grad.numpy() for x in xs], x_axis),
    }
    for s, a in axes.items():
        got[f"{s}.grad"] = np_gather([getattr(l, s).grad.numpy() for l in layers], a, f"{s}.grad")
    want = {"y": y_ref.numpy(), "x.grad": xr.grad.numpy()}
    want.update({f"{s}.grad": getattr(ref, s).grad.numpy() for s in axes})
    return got, want


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sequence_parallel_layer_matches_single_device(n, kind, variant):
    got, want = run_case(kind, n, variant)
    for key in want:
        assert_close(got[key], want[key], f"{variant} {kind} N={n} {key}")
    assert np.abs(want["x.grad"]).max() > 0.1


class NoScatter(SimulatedCollectives):
    """Row branch added on every rank's rows without taking this rank's part (shape kept by a local slice)."""

    def seq_scatter(self, x):
        s = x.shape[0] // self.world_size
        return x[:s]  # always rank 0's rows


class IdentityWithoutAllReduce(SimulatedCollectives):
    def identity(self, x):
        return x


@pytest.mark.parametrize("kind,cls,key", [("row", NoScatter, "y"), ("column", IdentityWithoutAllReduce, "lora_A.grad")])
def test_negative_controls(kind, cls, key):
    with pytest.raises(AssertionError):
        got, want = run_case(kind, 2, "lora", collectives_cls=cls)
        assert_close(got[key], want[key], key)


def test_simulated_sequence_ops_gradients():
    """The three simulated ops against their definitions, on 2 ranks."""
    sim = SimulatedGroup(2)
    xs = [paddle.to_tensor(np.arange(8, dtype="float32").reshape(4, 2) + 10 * r, stop_gradient=False)
          for r in range(2)]  # fmt: skip
    for op, out_rows in (("seq_all_gather", 8), ("seq_reduce_scatter", 2), ("seq_scatter", 2)):
        for x in xs:
            x.clear_gradient()
        ys = sim.run(lambda r: getattr(sim.collectives(r), op)(xs[r]))
        assert [int(y.shape[0]) for y in ys] == [out_rows, out_rows]
        paddle.autograd.backward([(y * (r + 1)).sum() for r, y in enumerate(ys)])
        g = [x.grad.numpy() for x in xs]
        if op == "seq_all_gather":  # rows of x_i appear in every output: grad = sum_j (j + 1) on its rows
            np.testing.assert_array_equal(np.concatenate([xs[0].numpy(), xs[1].numpy()]), ys[0].numpy())
            assert (g[0] == 3).all() and (g[1] == 3).all()
        elif op == "seq_reduce_scatter":  # out_i = rows i of x_0 + x_1; grad x_j = concat_i (i + 1)
            np.testing.assert_array_equal(ys[1].numpy(), (xs[0] + xs[1]).numpy()[2:])
            assert (g[0][:2] == 1).all() and (g[0][2:] == 2).all() and (g[1] == g[0]).all()
        else:  # out_i = rows i of x_i; grad x_j = concat_i (i + 1) (the all-gather of the row gradients)
            np.testing.assert_array_equal(ys[1].numpy(), xs[1].numpy()[2:])
            assert (g[0][:2] == 1).all() and (g[0][2:] == 2).all()
