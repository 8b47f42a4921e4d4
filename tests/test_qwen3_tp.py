"""Qwen3 decoder layers under tensor (and sequence) parallelism, on the N-rank CPU simulation.

As tests/test_tp_sim.py does for Llama: two Qwen3DecoderLayers built with tensor_parallel_degree=n (Paddle's
Column/RowParallelLinear, heads split across ranks, head_dim 32 != hidden / heads), LoRA applied by
apply_adapters, the single-device weights sliced in by the test's own numpy code.  Outputs, input gradients and
adapter gradients equal the single-device model's.  The per-head q/k norms are replicated while each rank holds
different heads, so their weight gradient is a partial sum per rank: with the norms trained, every rank's
gradient must equal the single-device one (the model-parallel identity sums it), and without that identity it
does not (negative control).
"""

import numpy as np
import paddle
import pytest

from test_tp_sim import assert_close, load_full_weights, np_shard, rel_err

from paddlenlp_ext.adapters import (
    AdapterConfig,
    adapter_state_dict,
    apply_adapters,
    iter_adapter_layers,
    load_adapter_state_dict,
)  # noqa: I001
from paddlenlp_ext.adapters.tp_checkpoint import adapter_split_axes, unshard_adapter_states
from paddlenlp_ext.parallel import SimulatedGroup


B, S = 2, 6


def qwen3_config(tp, rank, sequence_parallel=False):
    from paddlenlp_ext.models.qwen3 import Qwen3Config

    return Qwen3Config(
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=2,
        vocab_size=64,
        tensor_parallel_degree=tp,
        tensor_parallel_rank=rank,
        sequence_parallel=sequence_parallel and tp > 1,
        seq_length=S,
    )


class TwoLayers(paddle.nn.Layer):
    def __init__(self, config):
        super().__init__()
        from paddlenlp_ext.models.qwen3.modeling import Qwen3DecoderLayer

        self.layers = paddle.nn.LayerList([Qwen3DecoderLayer(config) for _ in range(2)])

    def forward(self, h, mask):
        for layer in self.layers:
            h = layer(h, attention_mask=mask)
            h = h[0] if isinstance(h, tuple) else h
        return h


def norm_params(m):
    return {n: p for n, p in m.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))}


@pytest.mark.parametrize("n,sp", [(2, False), (2, True)])
def test_qwen3_decoder_layers_match_single_device_with_lora_and_trained_head_norms(n, sp):
    """sp: sequence parallel -- rank i takes and returns rows [i*B*S/n, (i+1)*B*S/n) of the [B*S, hidden]
    activations (PaddleNLP's layout after its ScatterOp), and Paddle's sequence-parallel linears gather them."""
    from paddlenlp.transformers.qwen2.modeling import Qwen2Model

    paddle.seed(0)
    ref = TwoLayers(qwen3_config(1, 0))
    rng = np.random.default_rng(1)
    for p in norm_params(ref).values():  # not all ones: the norms' scale matters
        p.set_value((1 + 0.3 * rng.standard_normal(p.shape)).astype("float32"))
    sim = SimulatedGroup(n)
    tps = sim.build(lambda r: TwoLayers(qwen3_config(n, r, sp)))
    full = ref.state_dict()
    for r, m in enumerate(tps):
        load_full_weights(m, full, r, n)
        assert list(m.layers[0].self_attn.q_proj.weight.shape) == [64, 4 * 32 // n]  # heads split, not hidden
        kinds = {type(m.layers[0].self_attn.q_proj).__name__, type(m.layers[1].mlp.down_proj).__name__}
        assert kinds == (
            {"ColumnSequenceParallelLinear", "RowSequenceParallelLinear"}
            if sp
            else {"ColumnParallelLinear", "RowParallelLinear"}
        )
    cfg = AdapterConfig(target_modules=[r".*_proj"], r=4, alpha=8)
    apply_adapters(ref, cfg)
    for m in tps:
        apply_adapters(m, AdapterConfig.from_dict(cfg.to_dict()))
    state = {k: (rng.standard_normal(v.shape) * 0.1).astype("float32") for k, v in adapter_state_dict(ref).items()}
    load_adapter_state_dict(ref, state)
    for m in tps:
        load_adapter_state_dict(m, state)
    for m in [ref] + tps:  # train the head norms too (full fine-tuning would)
        for p in norm_params(m).values():
            p.stop_gradient = False

    mask = Qwen2Model._prepare_decoder_attention_mask(None, (B, S), 0, "float32")
    x = rng.standard_normal((B, S, 64)).astype("float32")
    g_np = rng.standard_normal((B, S, 64)).astype("float32")
    g = paddle.to_tensor(g_np)

    def rank_part(a, r):  # what rank r holds of a [B, S, ...] activation
        return np_shard(a.reshape([B * S, -1]), 0, r, n) if sp else a

    def run_tp():
        for m in tps:
            m.clear_gradients()
        xs = [paddle.to_tensor(rank_part(x, r), stop_gradient=False) for r in range(n)]
        ys = sim.run(lambda r: tps[r](xs[r], mask))
        paddle.autograd.backward([(y * paddle.to_tensor(rank_part(g_np, r))).sum() for r, y in enumerate(ys)])
        return ys, xs

    xr = paddle.to_tensor(x, stop_gradient=False)
    y_ref = ref(xr, mask)
    (y_ref * g).sum().backward()
    ys, xs = run_tp()
    assert list(ys[0].shape) == ([B * S // n, 64] if sp else [B, S, 64])
    for r in range(n):
        assert_close(ys[r].numpy(), rank_part(y_ref.numpy(), r), f"rank {r} output")
        assert_close(xs[r].grad.numpy(), rank_part(xr.grad.numpy(), r), f"rank {r} input grad")
        for name, p in norm_params(tps[r]).items():
            assert_close(p.grad.numpy(), norm_params(ref)[name].grad.numpy(), f"rank {r} grad {name}")

    def grads(m):
        return {f"{name}.{suffix}": getattr(l, suffix).grad for name, l in iter_adapter_layers(m)
                for suffix in l.state_suffixes}  # fmt: skip

    axes = adapter_split_axes(tps[0])
    got = unshard_adapter_states([grads(m) for m in tps], axes)
    want = grads(ref)
    assert set(got) == set(want) and len(got) == 28
    for k in want:
        assert_close(got[k], want[k].numpy(), f"grad {k}")
    for k, v in adapter_state_dict(tps[1]).items():
        np.testing.assert_array_equal(v.numpy(), state[k] if axes[k] is None else np_shard(state[k], axes[k], 1, n))

    # negative control: without the model-parallel identity each rank has only its heads' share
    for m in tps:
        for layer in m.layers:
            layer.self_attn.q_norm.mp_group = None
    run_tp()
    name = "layers.0.self_attn.q_norm.weight"
    assert rel_err(norm_params(tps[0])[name].grad.numpy(), norm_params(ref)[name].grad.numpy()) > 1e-3
