"""Decode speed of the server's loop on a ~0.5B model: tokens/s at batch 1 and 32, as a fraction of this machine's
memory-bandwidth limit, side by side with transformers' ``generate`` on torch CPU for the same weights.

    .venv/bin/python -m bench.serve --decode [--new_tokens 24] [--repeats 2]

1. Builds once (``build/llama-0.5b``, PaddleNLP layout, random normal(0, 0.02) weights as ``bench/big_model.py``
   writes them) a Llama of Qwen2.5-0.5B's size class: hidden 1024, intermediate 4864, 24 layers, 16 heads / 4 KV
   heads, vocab 32000, untied head = 487,606,272 parameters (1.95 GB in fp32); exports it with
   ``paddlenlp_ext.export.export_hf_model`` to ``build/llama-0.5b-hf`` (transformers layout), so both sides decode
   the very same weights.
2. Measures the copy bandwidth before every run: ``np.copyto`` of a 512 MiB float32 array into another, best of 5,
   counted as bytes read + bytes written (STREAM's "copy" convention); the limit uses their median.
3. In child processes (Paddle and torch never share one), interleaved ours, theirs, ours, theirs, ... for
   ``--repeats`` rounds: ``--prompt_len`` random token ids per row (the same ids on both sides), ``--new_tokens``
   greedy tokens, batch 1 then 32.  Ours: the model as the server loads it (``predict.session.load_base_model``)
   decoded by the server's loop (``serve.decode.decode``, the ``--batching static`` path).  Theirs:
   ``LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=float32).generate(do_sample=False,
   min_new_tokens=max_new_tokens)``.  Decode time is from the first generated token to the last (the prefill
   excluded), read off a per-step callback on both sides; tokens/s = batch x (new_tokens - 1) / that time.
4. Bandwidth limit: a decode step reads every weight once (the embedding only one row per token: left out) =
   ``bytes_per_step``; limit tokens/s = batch x bandwidth / bytes_per_step.  Reported: the median tokens/s of each
   side, its fraction of the limit, ours / theirs, the greedy tokens of batch row 0 compared, the load average.
   Since a batch-32 step is bound by compute rather than by reading the weights, each child also measures its
   framework's matmul rate at each batch size over a weight larger than the caches ([b, 1024] x [1024, 38912]);
   the "matmul limit" is the tokens/s of a step that were nothing but matmuls at that rate (2 FLOP per weight).
"""

import argparse
import json
import os
import sys
import time

import numpy as np

if __package__ in (None, ""):
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402

ROOT = h.ROOT
SHAPE = h.llama_shape(
    1024,
    4864,
    24,
    16,
    4,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def ensure_model(model_dir: str, hf_dir: str) -> dict:
    """Build the PaddleNLP-layout model and its transformers export once; {"params", "bytes_per_step"}."""
    from bench import big_model

    marker = os.path.join(model_dir, big_model.MARKER)
    if not os.path.isfile(marker):
        from paddlenlp.transformers import LlamaConfig

        os.makedirs(model_dir, exist_ok=True)
        cfg = LlamaConfig(architectures=["LlamaForCausalLM"], **SHAPE)
        shapes = big_model.lazy_shapes(cfg)
        n_shards, total = big_model.write_shards(model_dir, shapes, seed=0)
        cfg.save_pretrained(model_dir)
        with open(marker, "w") as f:
            json.dump(
                {
                    "params": sum(int(np.prod(s)) for s in shapes.values()),
                    "total_bytes": total,
                    "embedding": int(np.prod(shapes["llama.embed_tokens.weight"])),
                },
                f,
            )
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        from paddlenlp_ext.export.hf_model import export_hf_model

        export_hf_model(model_dir, hf_dir, overwrite=True, log=lambda *a: None)
    with open(marker) as f:
        info = json.load(f)
    return {"params": info["params"], "bytes_per_step": info["total_bytes"] - 4 * info["embedding"]}


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large float32 copy (read + write counted), best of ``repeats``."""
    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best


GEMM_COLS = 8 * SHAPE["intermediate_size"]  # a [1024, 38912] fp32 weight = 159 MB: larger than any cache


def gemm_rate(matmul, x, repeats: int = 10) -> float:
    """FLOP/s of ``matmul(x)``: x [rows, hidden] x [hidden, GEMM_COLS] (weights read from memory, as a decode step
    reads them), median of ``repeats``: the rate a batch-``rows`` step would run at if it were only matmuls."""
    matmul(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(x)
        times.append(time.perf_counter() - t0)
    return 2 * x.shape[0] * SHAPE["hidden_size"] * GEMM_COLS / h.median(times)


def prompts(batch: int, length: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(3, vocab, size=(batch, length)).astype("int64")  # [B, P]


def ours(a) -> list:
    """The server's loop on the model as the server loads it; [{"batch", "decode_s", "tokens"}]."""
    from paddlenlp_ext.runtime.cpu_env import setup_cpu

    cpu = setup_cpu()  # the server's CPU set-up (threads, MKL's code path), before paddle loads
    import paddle

    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.predict.session import load_base_model
    from paddlenlp_ext.serve.decode import Row, decode

    model = load_base_model(PredictOptions(model_name_or_path=a.model_dir, max_length=256), None)
    model.eval()

    def run(batch, new):
        ids = prompts(batch, a.prompt_len, SHAPE["vocab_size"])
        rows = [Row(prompt=[int(t) for t in ids[i]]) for i in range(batch)]
        stamps, row0 = [], []

        def on_token(i, t, info):
            if i == 0:
                stamps.append(time.perf_counter())
                row0.append(t)
            return False  # no EOS: every row decodes ``new`` tokens

        decode(model, rows, [], 0, new, on_token)
        return {"batch": batch, "decode_s": stamps[-1] - stamps[0], "steps": len(stamps) - 1, "tokens": row0}

    run(2, 3)  # warm-up
    out = [run(b, a.new_tokens) for b in a.batches]
    w = paddle.randn([SHAPE["hidden_size"], GEMM_COLS])
    rates = {b: gemm_rate(lambda x: paddle.matmul(x, w), paddle.randn([b, SHAPE["hidden_size"]])) for b in a.batches}
    out.append({"device": paddle.get_device(), "cpu": cpu.text, "gemm_flops": rates})
    return out


def theirs(a) -> list:
    """transformers' generate on torch CPU for the exported weights."""
    import torch
    from transformers import LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(a.hf_dir, torch_dtype=torch.float32).eval()

    class Stamp(StoppingCriteria):  # called once after every generated token (prefill's included)
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores, **kw):
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def run(batch, new):
        ids = torch.from_numpy(prompts(batch, a.prompt_len, SHAPE["vocab_size"]))
        st = Stamp()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([st]),
            )
        return {
            "batch": batch,
            "decode_s": st.stamps[-1] - st.stamps[0],
            "steps": len(st.stamps) - 1,
            "tokens": out[0, a.prompt_len :].tolist(),
        }

    run(2, 3)
    out = [run(b, a.new_tokens) for b in a.batches]
    w = torch.randn(SHAPE["hidden_size"], GEMM_COLS)
    with torch.inference_mode():
        rates = {b: gemm_rate(lambda x: torch.matmul(x, w), torch.randn(b, SHAPE["hidden_size"])) for b in a.batches}
    out.append({"threads": torch.get_num_threads(), "gemm_flops": rates})
    return out


def child(side: str, a) -> list:
    cmd = [
        sys.executable,
        "-m",
        "bench.serve_decode",
        "--child",
        side,
        "--model_dir",
        a.model_dir,
        "--hf_dir",
        a.hf_dir,
        "--new_tokens",
        str(a.new_tokens),
        "--prompt_len",
        str(a.prompt_len),
        "--batches",
        ",".join(map(str, a.batches)),
    ]
    # no thread variables inherited (paddle's import in this process set OMP_NUM_THREADS=1): each side picks its own
    env = h.clean_env(drop=("OMP_NUM_THREADS", "MKL_NUM_THREADS"), PYTHONPATH=ROOT)
    r = h.run(cmd, name=side, cwd=ROOT, env=env, mark=None, check=False)
    if not r.ok:
        raise RuntimeError(f"{side} failed:\n{r.tail()}")
    # the child prints its result as the last JSON line (stderr is interleaved: skip its warnings)
    for line in reversed(r.output.strip().splitlines()):
        if line.startswith("["):
            return json.loads(line)
    raise RuntimeError(f"{side} printed no result:\n{r.tail()}")


def compare(a) -> int:
    info = ensure_model(a.model_dir, a.hf_dir)
    print(
        f"model: {info['params']:,} parameters; weights read per decode step: {info['bytes_per_step'] / 1e9:.3f} GB"
        " (fp32, embedding left out)",
        flush=True,
    )
    res, bws = {"ours": [], "theirs": []}, []
    for r in range(a.repeats):
        for side in ("ours", "theirs"):
            load = os.getloadavg()
            bws.append(copy_bandwidth())  # measured next to each run: the machine is shared
            out = child(side, a)
            res[side].append(out)
            print(
                f"round {r + 1} {side:<6} load average {load[0]:.1f} {load[1]:.1f}: "
                + ", ".join(
                    f"batch {x['batch']}: {x['batch'] * x['steps'] / x['decode_s']:.1f} tok/s" for x in out[:-1]
                )
                + f"  ({out[-1]}); copy bandwidth before it {bws[-1] / 1e9:.1f} GB/s",
                flush=True,
            )
    bw = h.median(bws)
    print(
        f"copy bandwidth (median of {len(bws)}): {bw / 1e9:.2f} GB/s -> limit {bw / info['bytes_per_step']:.2f} "
        "decode steps/s"
    )
    flops_per_token = 2 * info["bytes_per_step"] / 4  # a multiply-add per weight (fp32: 4 bytes)
    rows = []
    for k, b in enumerate(a.batches):
        flops = h.median([rr[-1]["gemm_flops"][str(b)] for rr in res["ours"]])  # JSON keys are strings
        print(
            f"batch {b}: Paddle's matmul over weights larger than the caches {flops / 1e9:.1f} GFLOP/s (torch's "
            f"{h.median([rr[-1]['gemm_flops'][str(b)] for rr in res['theirs']]) / 1e9:.1f}) -> matmul limit "
            f"{flops / flops_per_token:.1f} tok/s"
        )
        tps = {s: h.median([rr[k]["batch"] * rr[k]["steps"] / rr[k]["decode_s"] for rr in res[s]]) for s in res}
        limit = b * bw / info["bytes_per_step"]
        same = sum(x == y for x, y in zip(res["ours"][0][k]["tokens"], res["theirs"][0][k]["tokens"]))
        rows.append(
            [
                b,
                f"{tps['ours']:.1f}",
                f"{tps['ours'] / limit:.0%}",
                f"{tps['theirs']:.1f}",
                f"{tps['theirs'] / limit:.0%}",
                f"{limit:.1f}",
                f"{tps['ours'] / tps['theirs']:.2f}x",
                f"{same}/{a.new_tokens}",
                f"{flops / flops_per_token:.1f}",
                f"{tps['ours'] / (flops / flops_per_token):.0%}",
            ]
        )
    print(
        h.table(
            [
                "batch",
                "ours tok/s",
                "ours / limit",
                "transformers tok/s",
                "transformers / limit",
                "bandwidth limit tok/s",
                "ours / transformers",
                "row 0 greedy tokens equal",
                "Paddle matmul limit tok/s",
                "ours / matmul limit",
            ],
            rows,
        )
    )
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_dir", default=os.path.join(ROOT, "build", "llama-0.5b"))
    p.add_argument("--hf_dir", default=os.path.join(ROOT, "build", "llama-0.5b-hf"))
    p.add_argument("--new_tokens", type=int, default=24)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", choices=["ours", "theirs"])
    a = p.parse_args(argv)
    a.batches = [int(x) for x in str(a.batches).split(",")]
    if a.child:
        print(json.dumps(ours(a) if a.child == "ours" else theirs(a)))
        return 0
    return compare(a)


if __name__ == "__main__":
    sys.exit(main())
