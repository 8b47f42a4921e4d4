"""Benchmark: supervised tokens/s of one training micro-step, packed vs unpacked, in-process.

    .venv/bin/python -m bench.packed_step MODEL_DIR [--rows 2] [--max-length 1024] [--repeats 3] [--json F]

Tokenizes alpaca_en_demo (``../shared/data`` or PADDLENLP_EXT_SHARED_DATA; else llm/data/advertise) with
MODEL_DIR's tokenizer (our pipeline: ``data.tokenize.tokenize_examples``), packs the first 200 examples
greedily into rows of ``--max-length`` (``data.packing.PackedDataset``), takes ``--rows`` of them evenly
spaced over the packs (best-fit-decreasing puts the longest examples first), and times forward
+ backward of our SFT loss (``training.loss.global_token_loss``) with LoRA r8 on every decoder linear,
per variant, interleaved over ``--repeats`` rounds after one warm-up round:

* ``unpacked``: the same examples one per micro-step (batch 1, no padding, causal mask), as a run
  without zero_padding;
* ``packed dense``: the packed rows with the dense block-diagonal mask (``flash_mask=false``);
* ``packed flashmask tiles``: FlashMask start rows through the block-sparse kernel;
* ``packed flashmask varlen``: FlashMask start rows through per-document attention (kernels/varlen.py),
  what ``flash_mask=true`` runs on CPU.

Prints supervised tokens/s (the supervised tokens of the examples over the summed micro-step time),
the ratios to unpacked, and the largest relative difference of the losses (per variant vs unpacked).
All variants run in the patched library state of a real run (``training.run.library_patches``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

import numpy as np

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402

ROOT, ALPACA = h.ROOT, h.ALPACA


def load_examples(tokenizer, max_length: int):
    from paddlenlp_ext.data.reader import Example
    from paddlenlp_ext.data.tokenize import tokenize_examples

    if os.path.isfile(ALPACA):
        with open(ALPACA, encoding="utf-8") as f:
            raw = [
                {"src": (r["instruction"] + ("\n" + r["input"] if r.get("input") else "")), "tgt": r["output"]}
                for r in json.load(f)
            ]
    else:
        with open(os.path.join(ROOT, "llm", "data", "advertise", "train.json"), encoding="utf-8") as f:
            raw = [json.loads(line) for line in f if line.strip()]
    raw = [Example(src=[r["src"]], tgt=[r["tgt"]], origin=f"example {i}") for i, r in enumerate(raw)]
    examples, _ = tokenize_examples(raw, tokenizer, max_length, max_length, False)
    return examples


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args(argv)
    from paddlenlp_ext.runtime.cpu_env import setup_cpu

    print(setup_cpu().text, flush=True)  # the CLIs' CPU set-up, before paddle loads
    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM, AutoTokenizer

    import paddlenlp_ext.kernels.flashmask as fm_kernel
    from paddlenlp_ext.adapters.api import apply_adapters
    from paddlenlp_ext.adapters.config import AdapterConfig
    from paddlenlp_ext.data.collate import PackedCollator
    from paddlenlp_ext.data.packing import PackedDataset
    from paddlenlp_ext.integrations.dense_attention import fast_dense_attention
    from paddlenlp_ext.integrations.flashmask import cpu_flashmask
    from paddlenlp_ext.integrations.rotary import fast_rotary
    from paddlenlp_ext.training.loss import global_token_loss

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    examples = load_examples(tok, a.max_length)
    ds = PackedDataset(examples[:200], a.max_length, tok.pad_token_id or 0, greedy=True, shuffle=False)
    picked = sorted(set(int(x) for x in np.linspace(0, len(ds) - 1, a.rows)))  # long and short examples alike
    rows = [ds[i] for i in picked]
    used = [i for j in picked for i in ds.packs[j]]
    docs = [examples[i] for i in used]
    supervised = sum(int((np.asarray(d["labels"]) != -100).sum()) for d in docs)
    real = sum(len(d["input_ids"]) for d in docs)
    print(
        f"{len(docs)} examples in {len(rows)} rows of {a.max_length} ({real} tokens, {supervised} supervised, "
        f"padding {1 - real / (len(rows) * a.max_length):.1%}); lengths {sorted(len(d['input_ids']) for d in docs)}"
    )

    stack = contextlib.ExitStack()
    stack.enter_context(fast_rotary())
    stack.enter_context(fast_dense_attention())
    stack.enter_context(cpu_flashmask())

    def build(flash):
        paddle.seed(0)
        model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype="float32", use_flash_attention=flash)
        apply_adapters(model, AdapterConfig(method="lora", r=8, alpha=16))
        model.train()
        return model

    def tensors(batch):
        return {k: paddle.to_tensor(v) for k, v in batch.items() if k != "real_tokens"}

    dense_model, flash_model = build(False), build(True)
    unpacked = [tensors({"input_ids": np.asarray([d["input_ids"]]), "labels": np.asarray([d["labels"]])}) for d in docs]
    dense_batches = [tensors(PackedCollator(False)([r])) for r in rows]
    flash_batches = [tensors(PackedCollator(True)([r])) for r in rows]

    def step(model, batches):
        model.clear_gradients()
        total = 0.0
        for b in batches:
            loss = global_token_loss(model, dict(b), supervised, 1, 1)  # summed / all supervised tokens
            loss.backward()
            total += float(loss)
        return total

    original_layout = fm_kernel._document_layout
    variants = {  # name -> (model, batches, the patches it runs under)
        "unpacked": (dense_model, unpacked, contextlib.nullcontext),
        "packed dense": (dense_model, dense_batches, contextlib.nullcontext),
        "packed flashmask tiles": (
            flash_model,
            flash_batches,
            lambda: _patched(fm_kernel, "_document_layout", lambda *x: None),
        ),
        "packed flashmask varlen": (flash_model, flash_batches, contextlib.nullcontext),
    }
    assert fm_kernel._document_layout is original_layout
    times, losses = h.interleave(
        {k: (lambda m=m, b=b: step(m, b)) for k, (m, b, _) in variants.items()},
        a.repeats,
        context=lambda name: variants[name][2](),
        log=True,
    )
    stack.close()
    base = statistics.median(times["unpacked"])
    out, body = {}, []
    for name, ts in times.items():
        med = statistics.median(ts)
        diff = abs(losses[name] - losses["unpacked"]) / abs(losses["unpacked"])
        out[name] = {"times": ts, "median": med, "sup_tok_s": supervised / med, "loss": losses[name], "rel": diff}
        body.append(
            [
                name,
                f"{med:.2f} s ({', '.join(f'{t:.2f}' for t in ts)})",
                f"{supervised / med:.1f}",
                f"{base / med:.2f}x",
                f"{diff:.1e}",
            ]
        )
    print()
    print(
        h.table(
            ["variant", "median time (each)", "supervised tok/s", "vs unpacked", "loss rel. diff vs unpacked"], body
        )
    )
    h.write_json(a.json, {"variants": out, "examples": len(docs), "supervised": supervised, "tokens": real})
    return 0


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


if __name__ == "__main__":
    sys.exit(main())
