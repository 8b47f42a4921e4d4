"""Benchmark: streaming adapter merge of a >= 4 GiB checkpoint (peak RSS and time vs a plain copy).

    .venv/bin/python -m bench.merge [--dtype fp32|bf16] [--min-gib 4] [--rounds 3] [--workdir /tmp] [--keep]

1. Builds a synthetic Llama checkpoint of at least ``--min-gib`` GiB (default 4)
   in PaddleNLP layout: safetensors shards of at most 1 GB
   (``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``) and
   config.json.  Shards are generated and written one at a time (~1 GB of RAM).
2. Builds a LoRA adapter (r=8, alpha=16) with non-zero A and B on every
   linear layer of every decoder layer (adapter_config.json +
   adapter_model.safetensors, this project's format).
3. Times ``llm/merge_lora_params.py ... --no-verify`` as a subprocess through
   the bench harness, which takes its peak RSS from the kernel (``os.wait4``
   rusage ru_maxrss of that process, spawned from a small launcher process:
   see ``bench/harness.py``).
4. Times a baseline subprocess that only reads and writes the same checkpoint
   once with the safetensors library (``load_file`` + ``save_file`` per shard,
   same shard structure, no merge), measured the same way.
5. Spot-checks merged tensors against base + scale * A @ B.
6. Prints the figures side by side and removes everything it wrote (unless --keep).

Rounds alternate baseline / merge; the best time of each is compared (both
read a checkpoint that is in the page cache after step 1).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402

ROOT = h.ROOT

SHARD_LIMIT = 10**9  # 1 GB, PaddleNLP's convention for "1GB"
HIDDEN, INTER, HEADS, VOCAB, RANK, ALPHA = 2048, 5504, 16, 32000, 8, 16.0
LINEARS = (
    ("self_attn.q_proj", HIDDEN, HIDDEN),
    ("self_attn.k_proj", HIDDEN, HIDDEN),
    ("self_attn.v_proj", HIDDEN, HIDDEN),
    ("self_attn.o_proj", HIDDEN, HIDDEN),
    ("mlp.gate_proj", HIDDEN, INTER),
    ("mlp.up_proj", HIDDEN, INTER),
    ("mlp.down_proj", INTER, HIDDEN),
)


def gib(n):
    return n / 2**30


def tensor_specs(layers):
    """[(name, shape)] in PaddleNLP LlamaForCausalLM state-dict order ([in, out] Linear weights)."""
    specs = [("llama.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"llama.layers.{i}."
        specs += [(p + n + ".weight", (a, b)) for n, a, b in LINEARS]
        specs += [(p + "input_layernorm.weight", (HIDDEN,)), (p + "post_attention_layernorm.weight", (HIDDEN,))]
    specs += [("llama.norm.weight", (HIDDEN,)), ("lm_head.weight", (HIDDEN, VOCAB))]
    return specs


def layers_for(min_bytes, itemsize):
    per_layer = sum(a * b for _, a, b in LINEARS) * itemsize + 2 * HIDDEN * itemsize
    fixed = (2 * VOCAB * HIDDEN + HIDDEN) * itemsize
    return max(1, -(-(min_bytes - fixed) // per_layer))


def make_tensor(rng, shape, dtype, scale=0.02):
    from paddlenlp_ext.merge import f32_to_bf16_bits

    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(scale)
    return f32_to_bf16_bits(x) if dtype == "bf16" else x


def build_checkpoint(d, layers, dtype, seed=0):
    """Writes shards one at a time (each <= 1 GB held in memory); returns total tensor bytes."""
    from safetensors.numpy import save_file

    os.makedirs(d)
    itemsize = 2 if dtype == "bf16" else 4
    specs = tensor_specs(layers)
    groups, cur, size = [], [], 0
    for name, shape in specs:  # PaddleNLP's naive sharding rule
        n = int(np.prod(shape)) * itemsize
        if cur and size + n > SHARD_LIMIT:
            groups.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    groups.append(cur)
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {name: make_tensor(rng, shape, dtype, 1.0 if "norm" in name else 0.02) for name, shape in group}
        save_file(shard, os.path.join(d, fname), metadata={"format": "np"})
        total += sum(v.nbytes for v in shard.values())
        weight_map.update({name: fname for name, _ in group})
        del shard
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "dtype": "bfloat16" if dtype == "bf16" else "float32",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return total, len(groups)


def build_adapter(d, base_dir, layers, seed=1):
    from safetensors.numpy import save_file

    from paddlenlp_ext.adapters.config import AdapterConfig

    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(layers):
        for n, a, b in LINEARS:
            m = f"llama.layers.{i}.{n}"
            tensors[m + ".lora_A"] = rng.uniform(-1 / np.sqrt(a), 1 / np.sqrt(a), (a, RANK)).astype(np.float32)
            tensors[m + ".lora_B"] = (rng.standard_normal((RANK, b)) * 0.01).astype(np.float32)  # non-zero
    os.makedirs(d)
    AdapterConfig(method="lora", r=RANK, alpha=ALPHA, base_model_name_or_path=base_dir).save(d)
    save_file(
        tensors, os.path.join(d, "adapter_model.safetensors"), metadata={"format": "np", "adapter_method": "lora"}
    )
    shutil.copy(os.path.join(base_dir, "config.json"), os.path.join(d, "config.json"))
    return tensors


def baseline_copy(src, dst):
    """Read + write the checkpoint once, shard by shard, with the safetensors library (no merge)."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst)
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        index = json.load(f)
    for fname in sorted(set(index["weight_map"].values())):
        shard = load_file(os.path.join(src, fname))
        save_file(shard, os.path.join(dst, fname), metadata={"format": "np"})
        del shard
    shutil.copy(os.path.join(src, "model.safetensors.index.json"), dst)
    shutil.copy(os.path.join(src, "config.json"), dst)


def spot_check(base_dir, out_dir, tensors, names, dtype):
    from safetensors import safe_open

    from paddlenlp_ext.merge import bf16_bits_to_f32, f32_to_bf16_bits

    def read(d, name):
        index = os.path.join(d, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                fname = json.load(f)["weight_map"][name]
        else:  # a checkpoint small enough for one file (--min-gib under 1) is written unsharded
            fname = "model.safetensors"
        with safe_open(os.path.join(d, fname), framework="np") as f:
            return f.get_tensor(name)

    scale = ALPHA / RANK
    rows = []
    for name in names:
        b, m = read(base_dir, name), read(out_dir, name)
        mod = name[: -len(".weight")]
        if mod + ".lora_A" in tensors:
            delta = (tensors[mod + ".lora_A"] @ tensors[mod + ".lora_B"]) * np.float32(scale)
            if dtype == "bf16":
                want = f32_to_bf16_bits(bf16_bits_to_f32(b) + delta)
                err = float(np.abs(bf16_bits_to_f32(m) - bf16_bits_to_f32(want)).max())
            else:
                want = b + delta
                err = float(np.abs(m - want).max())
            rows.append((name, "merged", float(np.abs(delta).max()), err))
        else:
            rows.append((name, "copied", 0.0, float(np.abs(m.astype(np.float32) - b.astype(np.float32)).max())))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--min-gib", type=float, default=4.0, help="checkpoint size to reach (GiB, default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="baseline/merge rounds; best time of each is used")
    ap.add_argument("--workdir", default="/tmp")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--_baseline", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._baseline:
        baseline_copy(*args._baseline)
        return 0

    print(
        "command: "
        + " ".join(
            [os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) else sys.executable] + sys.argv
        ),
        flush=True,
    )
    tmp = tempfile.mkdtemp(prefix="merge_bench_", dir=args.workdir)
    base, adapter, out, copy = (os.path.join(tmp, n) for n in ("base", "adapter", "merged", "copy"))
    itemsize = 2 if args.dtype == "bf16" else 4
    layers = layers_for(int(args.min_gib * 2**30), itemsize)
    try:
        t0 = time.perf_counter()
        total, nshards = build_checkpoint(base, layers, args.dtype)
        tensors = build_adapter(adapter, base, layers)
        print(
            f"built {args.dtype} Llama checkpoint: {layers} layers, {total / 1e9:.2f} GB ({gib(total):.2f} GiB) "
            f"in {nshards} shards <= 1 GB, adapter {len(tensors) // 2} LoRA modules "
            f"({sum(v.nbytes for v in tensors.values()) / 2**20:.1f} MiB), in {time.perf_counter() - t0:.0f}s",
            flush=True,
        )

        merge_cmd = [
            sys.executable,
            os.path.join(ROOT, "llm", "merge_lora_params.py"),
            "--model_name_or_path",
            base,
            "--lora_path",
            adapter,
            "--merge_model_path",
            out,
            "--no-verify",
            "--max_shard_size",
            "1GB",
        ]
        base_cmd = h.module("bench.merge", "--_baseline", base, copy)
        merges, copies = [], []
        for r in range(args.rounds):
            shutil.rmtree(copy, ignore_errors=True)
            run = h.run(base_cmd, name="baseline", mark=None)
            copies.append((run.wall_s, run.peak_rss_bytes))
            shutil.rmtree(copy, ignore_errors=True)
            last = r == args.rounds - 1
            if not last:
                shutil.rmtree(out, ignore_errors=True)
            run = h.run(merge_cmd, name="merge", mark=None)
            merges.append((run.wall_s, run.peak_rss_bytes))
            print(
                f"round {r + 1}: baseline {copies[-1][0]:.1f}s / {copies[-1][1] / 1e9:.2f} GB RSS, "
                f"merge {run.wall_s:.1f}s / {run.peak_rss_bytes / 1e9:.2f} GB RSS",
                flush=True,
            )
            if not last:
                shutil.rmtree(out, ignore_errors=True)
        print(
            "merge output (last round):\n  "
            + "\n  ".join(ln for ln in run.output.splitlines() if ln.startswith("[merge]"))
        )

        mid = layers // 2
        names = [
            "llama.layers.0.self_attn.q_proj.weight",
            f"llama.layers.{mid}.mlp.down_proj.weight",
            f"llama.layers.{layers - 1}.mlp.gate_proj.weight",
            f"llama.layers.{layers - 1}.self_attn.v_proj.weight",
            "llama.embed_tokens.weight",
            "lm_head.weight",
        ]
        rows = spot_check(base, out, tensors, names, args.dtype)
        print("spot check (merged vs base + scale*A@B; copied vs base):")
        ok_spot = True
        for name, kind, dmax, err in rows:
            good = err <= (1e-6 if kind == "merged" else 0.0)
            ok_spot &= good
            print(f"  {name:48s} {kind:6s} max|delta| {dmax:.2e}  max err {err:.2e}  {'ok' if good else 'FAIL'}")

        m_time, m_rss = min(w for w, _ in merges), max(r for _, r in merges)
        b_time, b_rss = min(w for w, _ in copies), max(r for _, r in copies)
        ratio = m_time / b_time
        print()
        print(f"checkpoint: {total / 1e9:.2f} GB ({gib(total):.2f} GiB), {args.dtype}, {nshards} shards\n")
        print(
            h.table(
                ["", "merge", "baseline copy", "merge / baseline"],
                [
                    [
                        "peak RSS (kernel maxrss)",
                        f"{m_rss / 1e9:.2f} GB ({gib(m_rss):.2f} GiB)",
                        f"{b_rss / 1e9:.2f} GB ({gib(b_rss):.2f} GiB)",
                        f"{m_rss / b_rss:.2f}x",
                    ],
                    [f"wall time (best of {args.rounds})", f"{m_time:.1f} s", f"{b_time:.1f} s", f"{ratio:.2f}x"],
                ],
            )
        )
        targets = [
            ("peak RSS <= 2.5 GB", m_rss <= 2.5e9),
            ("merge time <= 1.5x baseline", ratio <= 1.5),
            ("spot check", ok_spot),
        ]
        for label, ok in targets:
            print(f"target {label}: {'MET' if ok else 'MISSED'}")
        return 0 if all(ok for _, ok in targets) else 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
