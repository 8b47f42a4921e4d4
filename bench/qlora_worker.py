"""The worker side of ``bench/qlora.py``: part 0's kernel timings, and one part 1 configuration (build the
~106M Llama layer by layer or the naive way, quantize, train LoRA steps), run in its own process by
``python -m bench.qlora --worker NAME``.  How each number is measured: ``bench/qlora.py``'s docstring.
"""

from __future__ import annotations

import os
import time

from bench import harness as h
from bench.harness import reset_peak, rss_now, rss_peak

MODEL_SHAPE = h.llama_shape(768, 2048, 8, 12, 12, vocab_size=32000, max_position_embeddings=2048)
# the order bench/qlora.py names the shape in (docs/qlora_benchmark.md)
SHOWN_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
)


def shape_text(sep: str) -> str:
    """The shape as bench/qlora.py prints it: ``shape_text("=")`` -> ``"vocab_size=32000, hidden_size=768, ...,
    num_key_value_heads=12"`` (max_position_embeddings left out)."""
    return ", ".join(f"{k}{sep}{MODEL_SHAPE[k]}" for k in SHOWN_KEYS)


# name -> (algo or None, double_quant); block size is --block-size (64) for nf4/fp4
CONFIGS = {
    "fp32": (None, False),
    "weight_only_int8": ("weight_only_int8", False),
    "weight_only_int4": ("weight_only_int4", False),
    "nf4": ("nf4", False),
    "nf4 + double quant": ("nf4", True),
    "fp4": ("fp4", False),
}


# =============================================================== worker (one configuration)
def linear_weight_bytes(model) -> tuple:
    """(params, bytes) of the decoder nn.Linear weights still in float (fp32 configuration)."""
    import numpy as np
    import paddle.nn as nn

    params = nbytes = count = 0
    for name, layer in model.named_sublayers():
        if type(layer) is nn.Linear and ".layers." in f".{name}" and "lm_head" not in name:
            n = int(np.prod(layer.weight.shape))
            params += n
            nbytes += n * layer.weight.element_size()
            count += 1
    return params, nbytes, count


def build_layer_by_layer(cfg, algo, block_size, double_quant):
    """Construct lazily, then materialise + quantize one decoder layer at a time.

    Initialisation is PaddleNLP's (``LlamaPretrainedModel._init_weights``): every Linear / Embedding /
    lm_head weight ~ normal(0, initializer_range), o_proj and down_proj then scaled by
    1/sqrt(2 * num_hidden_layers), norms = 1.  It is applied through the initializer directly on the
    not-yet-materialised parameter (PaddleNLP's ``set_value(normal(...))`` would hold a second full-size
    copy of each weight -- 94 MiB for the embedding -- for a moment).
    """
    import math

    import paddle
    import paddle.nn as nn
    from paddlenlp.transformers import LlamaForCausalLM
    from paddlenlp.transformers.model_utils import no_init_weights

    from paddlenlp_ext.models.quantize import quantize_model

    with no_init_weights(), paddle.LazyGuard():
        model = LlamaForCausalLM(cfg)
    after_lazy = rss_now()
    normal = nn.initializer.Normal(0.0, cfg.initializer_range)
    residual_scale = 1 / math.sqrt(2 * cfg.num_hidden_layers)

    def materialise(layer):
        for sub in layer.sublayers(include_self=True):
            is_weight = type(sub) in (nn.Linear, nn.Embedding) or type(sub).__name__ == "LlamaLMHead"
            for pname, p in sub.named_parameters(include_sublayers=False):
                if p._is_initialized():
                    continue
                if is_weight and pname == "weight":
                    normal(p)
                else:
                    p.initialize()  # the parameter's own initializer (norm weights: 1, biases: 0)

    agg = {"layers_replaced": 0, "params": 0, "bytes_before": 0, "bytes_after": 0, "path": set()}
    for dec in model.llama.layers:
        materialise(dec)
        with paddle.no_grad():
            dec.self_attn.o_proj.weight.scale_(residual_scale)
            dec.mlp.down_proj.weight.scale_(residual_scale)
        if algo:  # quantize this layer's 7 linears before the next layer exists
            st = quantize_model(dec, algo, block_size=block_size, double_quant=double_quant, target_modules=[r".*"])
            for k in ("layers_replaced", "params", "bytes_before", "bytes_after"):
                agg[k] += st[k]
            agg["path"].update(st["path"])
    materialise(model)  # embeddings, final norm, lm_head
    missing = [n for n, p in model.named_parameters() if not p._is_initialized()]
    if missing:
        raise RuntimeError(f"not materialised: {missing[:5]}")
    agg["path"] = sorted(agg["path"])
    return model, (agg if algo else None), after_lazy


def dequant_ms_per_step(model, repeats: int = 3):
    """Time the weight dequantization alone: every QuantizedLinear dequantizes once in forward and once
    in backward per step (``portable_dequant_matmul``), so 2 x (one pass over all layers); median of repeats."""
    import statistics

    from paddlenlp_ext.quant import QuantizedLinear
    from paddlenlp_ext.quant.dispatch import PATH_PORTABLE

    layers = [l for l in model.sublayers() if isinstance(l, QuantizedLinear)]
    if not layers:
        return None
    runs = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for l in layers:
            l._dequant(PATH_PORTABLE)
        runs.append(time.perf_counter() - t0)
    return 2000 * statistics.median(runs[1:])


def build_naive(cfg, algo, block_size, double_quant):
    from paddlenlp.transformers import LlamaForCausalLM

    from paddlenlp_ext.models.quantize import quantize_model

    model = LlamaForCausalLM(cfg)
    after_fp32 = rss_now()
    st = quantize_model(model, algo, block_size=block_size, double_quant=double_quant) if algo else None
    return model, st, after_fp32


def worker(args) -> dict:
    import gc
    import statistics

    t_start = time.time()
    import numpy as np
    import paddle
    from paddlenlp.transformers import LlamaConfig

    from paddlenlp_ext.adapters import AdapterConfig, apply_adapters
    from paddlenlp_ext.models.quantize import quantized_state_bytes

    paddle.set_device("cpu")
    paddle.seed(args.seed)
    res = {"config": args.worker, "mode": args.mode, "rss_imports": rss_now()}
    algo, dq = CONFIGS[args.worker]
    cfg = LlamaConfig(**MODEL_SHAPE, dtype="float32")

    t0 = time.time()
    if args.mode == "lazy":
        model, st, res["rss_before_layers"] = build_layer_by_layer(cfg, algo, args.block_size, dq)
    else:
        model, st, res["rss_fp32_model"] = build_naive(cfg, algo, args.block_size, dq)
    gc.collect()
    res["build_s"] = time.time() - t0
    res["rss_after_build"] = rss_now()
    res["peak_build"] = rss_peak()
    res["total_params"] = int(sum(int(np.prod(p.shape)) for p in model.parameters()))
    if st is not None:
        qbytes = quantized_state_bytes(model)
        if qbytes != st["bytes_after"]:
            raise RuntimeError(f"quantized_state_bytes {qbytes} != stats bytes_after {st['bytes_after']}")
        res.update(
            linear_params=st["params"],
            linear_bytes=qbytes,
            bytes_before=st["bytes_before"],
            layers=st["layers_replaced"],
            path=st["path"],
        )
    else:
        p, b, c = linear_weight_bytes(model)
        res.update(linear_params=p, linear_bytes=b, bytes_before=b, layers=c, path=["dense fp32 matmul"])
    res["bytes_per_param"] = res["linear_bytes"] / res["linear_params"]
    # parameters outside the quantized linears (embeddings, lm_head, norms): quantized layers hold buffers only
    res["other_params"] = res["total_params"] - (res["linear_params"] if st is None else 0)

    if args.mode == "naive" or args.steps <= 0:
        res["wall_s"] = time.time() - t_start
        return res

    info = apply_adapters(model, AdapterConfig(method="lora", r=args.rank, alpha=2 * args.rank))
    res["trainable"] = info["trainable_params"]
    params = [p for p in model.parameters() if not p.stop_gradient]
    opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=params)
    model.train()
    rng = np.random.default_rng(args.seed)
    ids = paddle.to_tensor(rng.integers(3, cfg.vocab_size, size=(args.batch, args.seq + 1)), dtype="int64")
    x, y = ids[:, :-1], ids[:, 1:]
    gc.collect()
    res["rss_before_train"] = rss_now()

    def step():
        out = model(input_ids=x, labels=y, return_dict=True)
        out.loss.backward()
        opt.step()
        opt.clear_grad()
        return float(out.loss)

    times, rss_steps, losses = [], [], []
    res["load_before"] = os.getloadavg()[0]
    use_clear = reset_peak()
    cpu_times = []
    for i in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i >= args.warmup:
            times.append(dt)
            cpu_times.append(dc)
        rss_steps.append(rss_now())
    res["peak_train"] = rss_peak() if use_clear else None
    res["peak_train_how"] = "VmHWM reset" if use_clear else "VmHWM not resettable"
    res["rss_steady"] = rss_steps[-1]
    res["load_after"] = os.getloadavg()[0]
    res["dequant_ms"] = dequant_ms_per_step(model)
    res["step_ms"] = 1000 * statistics.median(times)
    res["step_ms_all"] = [round(1000 * t, 1) for t in times]
    res["step_cpu_ms"] = 1000 * statistics.median(cpu_times)  # user + sys of all threads
    res["losses"] = [round(v, 4) for v in losses]
    res["wall_s"] = time.time() - t_start
    return res


# =============================================================== part 0: kernels
PART0_ALGOS = [("nf4", False), ("nf4", True), ("fp4", False), ("weight_only_int8", False), ("weight_only_int4", False)]


def part0(shape=(2048, 5504), tokens=256, repeats=5, seed=0):
    """Quantize throughput per format and the layer's forward + backward against a plain fp32 matmul.

    Every measurement is the best of ``repeats`` (the machine is shared: the minimum is the least disturbed
    run), timed both as CPU time of this process (all threads) and as wall time."""
    import numpy as np
    import paddle

    from paddlenlp_ext.quant import QuantizedLinear, quantize
    from paddlenlp_ext.quant.dequant import decode_portable

    paddle.set_device("cpu")
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32)  # [in, out]

    def best(fn):
        wall, cpu = h.time_calls(fn, repeats)  # after a warm-up call (tables, allocator)
        return min(wall), min(cpu)

    quant_rows = []
    for algo, dq in PART0_ALGOS:
        wall, cpu = best(lambda: quantize(w, algo, 64, dq))
        quant_rows.append((algo + (" + dq" if dq else ""), w.size / cpu / 1e6, w.size / wall / 1e6))

    x = paddle.to_tensor(rng.standard_normal((tokens, shape[0])).astype(np.float32))  # [tokens, in]
    x.stop_gradient = False
    dy = paddle.to_tensor(rng.standard_normal((tokens, shape[1])).astype(np.float32))  # [tokens, out]
    wt = paddle.to_tensor(w)  # frozen: no weight gradient, as the base of LoRA

    def fwd_bwd(layer_fn):
        def run():
            (layer_fn(x) * dy).sum().backward()
            x.clear_gradient()

        return run

    base_wall, base_cpu = best(fwd_bwd(lambda t: paddle.matmul(t, wt)))
    step_rows = []
    for algo, dq in PART0_ALGOS:
        q = QuantizedLinear.from_weight(w, None, algo, 64, dq)
        wall, cpu = best(fwd_bwd(q))
        dwall, dcpu = best(lambda: decode_portable(q))
        step_rows.append(
            (algo + (" + dq" if dq else ""), wall * 1e3, cpu * 1e3, wall / base_wall, cpu / base_cpu, dwall * 1e3)
        )
    return quant_rows, step_rows, (base_wall * 1e3, base_cpu * 1e3)
