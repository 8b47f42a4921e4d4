"""Benchmark: nf4 QLoRA peak RSS from a Hugging Face (transformers-layout) checkpoint vs the same model in PaddleNLP layout.

    .venv/bin/python -m bench.hf_checkpoint_memory [--steps 3] [--shard_size 500MB]
        [--hf_dir build/llama-0.8b-hf] [--pd_dir build/llama-0.8b-hf-paddle] [--data_dir build/alpaca_en_demo]
        [--json out.json] [--keep]

1. transformers + torch build a random ``LlamaForCausalLM`` with bench/big_model.py's shape (hidden 2048,
   intermediate 5504, 14 layers, 16 heads, vocab 32000: 839,444,480 parameters) directly in bfloat16 and
   ``save_pretrained(max_shard_size=...)`` it: ``model-0000i-of-0000N.safetensors`` + index, names
   ``model.layers.N...``, Linear weights [out, in] (about 1.7 GB).
2. The same tensors in PaddleNLP's layout (``llama.layers.N...``, [in, out], bf16 stored as U16 as
   PaddleNLP's save_pretrained writes it, the same shard count; PaddleNLP's config.json) are written by
   streaming the transformers checkpoint through ``models.checkpoint.iter_tensors`` (one tensor at a time).
   Both directories get the same tokenizer (the Llama-2 SentencePiece model, as bench/big_model.py).
3. Each runs ``llm/run_finetune.py`` with LoRA on an nf4 (double-quantized) base, the overrides of
   bench/qlora_memory.py (batch 1, 256 tokens, no eval), in its own process, one after the other; peak RSS
   by the bench harness (the kernel's ru_maxrss of that process, as ``/usr/bin/time -f %M``).
   Target: HF peak <= 1.10 x PaddleNLP peak (printed PASS/FAIL, exit 1 on FAIL).

Needs ../shared/data (the tokenizer and the Alpaca demo data; exit 2 when absent).  The built
directories are cached (``bench_build.json`` markers).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import big_model  # noqa: E402  (the model shape, tokenizer and data of the QLoRA bench)
from bench import harness as h  # noqa: E402
from bench import qlora_memory  # noqa: E402  (one CLI run and its per-run breakdown)

ROOT, GB = h.ROOT, h.GiB
MARKER = "bench_build.json"
NF4 = ["--weight_quantize_algo", "nf4", "--weight_double_quant", "true"]
TARGET = 1.10


def build_hf(hf_dir, shard_size, seed=0):
    """transformers' random bf16 Llama, saved sharded; returns the build info."""
    import torch
    import transformers

    t0 = time.time()
    shape = dict(big_model.MODEL_SHAPE)
    cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)  # initialize in bf16: the fp32 model (3.4 GB) is never built
    try:
        model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(hf_dir, max_shard_size=shard_size, safe_serialization=True)
    del model
    big_model.write_tokenizer(hf_dir)
    return {"params": n_params, "build_seconds": round(time.time() - t0, 1), "seed": seed}


def convert_to_paddle(hf_dir, pd_dir):
    """The same tensors in PaddleNLP's names, shapes and shards, streamed one tensor at a time."""
    from paddlenlp.transformers import AutoConfig
    from safetensors.numpy import save_file

    from paddlenlp_ext.models.checkpoint import find_checkpoint, iter_tensors

    t0 = time.time()
    os.makedirs(pd_dir, exist_ok=True)
    ckpt = find_checkpoint(hf_dir)
    assert ckpt.hf_model_type == "llama" and len(ckpt.files) >= 2, (ckpt.hf_model_type, ckpt.files)
    n = len(ckpt.files)
    weight_map, shard, idx = {}, {}, 0

    def flush():
        nonlocal shard, idx
        idx += 1
        name = f"model-{idx:05d}-of-{n:05d}.safetensors"
        save_file(shard, os.path.join(pd_dir, name), metadata={"format": "np"})  # bf16 as U16, as PaddleNLP
        weight_map.update({k: name for k in shard})
        shard = {}

    current = None
    for key, arr, path in iter_tensors(ckpt):  # renamed, Linear weights transposed to [in, out]
        if current is not None and path != current:
            flush()
        current = path
        shard[key] = arr
    flush()
    with open(os.path.join(pd_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    AutoConfig.from_pretrained(hf_dir).save_pretrained(pd_dir)  # PaddleNLP's own config.json
    big_model.write_tokenizer(pd_dir)
    assert find_checkpoint(pd_dir).hf_model_type is None
    return {"convert_seconds": round(time.time() - t0, 1), "shards": idx}


def ensure(hf_dir, pd_dir, shard_size):
    marker = os.path.join(pd_dir, MARKER)
    if os.path.isfile(marker):
        with open(marker) as f:
            return json.load(f)
    for d in (hf_dir, pd_dir):
        shutil.rmtree(d, ignore_errors=True)
    info = build_hf(hf_dir, shard_size)
    info.update(convert_to_paddle(hf_dir, pd_dir))
    info["hf_bytes"] = qlora_memory.dir_bytes(hf_dir)
    info["shard_size"] = shard_size
    with open(marker, "w") as f:
        json.dump(info, f, indent=2)
    return info


def run(name, model_dir, data_dir, work, steps):
    rec = qlora_memory.run_one(name, model_dir, data_dir, work, steps, args=NF4)
    if "summary" in rec:
        rec["layout"] = (rec["summary"].get("quantization") or {}).get("layout")
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shard_size", default="500MB", help="transformers' max_shard_size (>= 2 shards)")
    p.add_argument("--hf_dir", default=os.path.join(ROOT, "build", "llama-0.8b-hf"))
    p.add_argument("--pd_dir", default=os.path.join(ROOT, "build", "llama-0.8b-hf-paddle"))
    p.add_argument("--data_dir", default=os.path.join(ROOT, "build", "alpaca_en_demo"))
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    h.require_shared()
    hf_dir, pd_dir, data_dir = (os.path.abspath(x) for x in (a.hf_dir, a.pd_dir, a.data_dir))
    if not os.path.isfile(os.path.join(data_dir, "train.json")):
        big_model.write_data(data_dir)
    build = ensure(hf_dir, pd_dir, a.shard_size)
    print(f"models: {json.dumps(build)}", flush=True)
    work = tempfile.mkdtemp(prefix="hf_memory_", dir=a.workdir)
    try:
        records = {
            "paddlenlp-layout": run("paddlenlp-layout", pd_dir, data_dir, work, a.steps),
            "transformers-layout": run("transformers-layout", hf_dir, data_dir, work, a.steps),
        }
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    if not all("summary" in r for r in records.values()):
        return 1
    pd, hf = records["paddlenlp-layout"], records["transformers-layout"]
    ratio = hf["peak_rss_bytes"] / pd["peak_rss_bytes"]
    print()
    print(
        h.table(
            ["run", "layout", "peak RSS (GiB)", "load peak (GiB)", "median step (s)", "train loss"],
            [
                [
                    name,
                    r["layout"],
                    f"{r['peak_rss_bytes'] / GB:.3f}",
                    h.fmt((r["load_peak_bytes"] or 0) / GB, ".3f"),
                    h.fmt(r["median_step_s"]),
                    h.fmt(r["train_loss"], ".4f"),
                ]
                for name, r in records.items()
            ],
        )
    )
    ok = h.verdict(ratio, TARGET) == "PASS"
    print(f"transformers / PaddleNLP peak RSS = {ratio:.3f} (target <= {TARGET}): {h.verdict(ratio, TARGET)}")
    h.write_json(a.json, {"build": build, "steps": a.steps, "runs": records, "ratio": ratio, "pass": ok}, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
