"""Training throughput with and without packing, same model, same data, one run.

    .venv/bin/python -m bench.train_packing [--steps 30] [--max_length 1024]

A tiny random-init Llama with the real Llama 2 tokenizer (so sequence lengths
are those of real data) is fine-tuned through llm/run_finetune.py on
../shared/data/alpaca_en_demo.json twice:

  baseline : batch padding (each batch padded to its longest example)
  packed   : zero_padding + greedy_zero_padding + use_flash_attention + flash_mask

and the non-padding tokens per second of both are printed side by side
(tokens_per_second of run_summary.json counts only example tokens).
"""

import argparse
import json
import math
import os
import sys
import tempfile

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402


def alpaca_to_dataset(src_path, out_dir, n_dev=32):
    rows = json.load(open(src_path, encoding="utf-8"))
    os.makedirs(out_dir, exist_ok=True)
    conv = [
        {"src": (r["instruction"] + ("\n" + r["input"] if r.get("input") else "")), "tgt": r["output"]}
        for r in rows
        if r["output"].strip()
    ]
    for name, part in (("train", conv), ("dev", conv[:n_dev])):
        with open(os.path.join(out_dir, f"{name}.json"), "w", encoding="utf-8") as f:
            for r in part:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return len(conv)


def run(config_overrides, out_dir):
    return h.run(
        h.cli(
            "llm/run_finetune.py",
            os.path.join(h.ROOT, "llm/config/tiny/sft_argument.json"),
            "--output_dir",
            out_dir,
            "--eval_before_train",
            "false",
            "--do_eval",
            "false",
            "--logging_steps",
            "10",
            *config_overrides,
        ),
        out_dir=out_dir,
    ).summary


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max_length", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=8, help="examples per step without packing")
    a = p.parse_args()
    print("command:", "python -m bench.train_packing " + " ".join(sys.argv[1:]))
    alpaca, spm = h.ALPACA, h.TOKENIZER_MODEL
    h.require_shared(alpaca, spm)

    from paddlenlp_ext.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        data_dir, model_dir = os.path.join(tmp, "alpaca"), os.path.join(tmp, "model")
        n = alpaca_to_dataset(alpaca, data_dir)
        build_tiny_model(model_dir, None, spm_model=spm, max_position_embeddings=a.max_length)
        common = h.flags(model_name_or_path=model_dir, dataset_name_or_path=data_dir, max_steps=a.steps)
        common += h.flags(max_length=a.max_length, src_length=a.max_length // 2)
        base = run(common + ["--per_device_train_batch_size", str(a.batch_size)], os.path.join(tmp, "base"))
        # rows of max_length holding about as many tokens per step as the baseline's batches
        tokens_per_example = base["data"]["train"]["tokens"] / base["data"]["train"]["examples"]
        rows = max(1, math.ceil(a.batch_size * tokens_per_example / a.max_length))
        packed = run(
            common + ["--per_device_train_batch_size", str(rows)] + h.PACKED,
            os.path.join(tmp, "packed"),
        )
    print(
        f"\nalpaca_en_demo: {n} examples, tiny Llama (hidden 64, 2 layers) with the Llama 2 tokenizer, "
        f"max_length {a.max_length}, {a.steps} steps\n"
    )
    print(
        h.table(
            ["run", "batch", "padding ratio", "tokens trained", "tokens/s (non-padding)", "step time (s)"],
            [
                [
                    name,
                    batch,
                    f"{s['data']['train']['padding_ratio']:.4f}",
                    s["tokens_trained"],
                    f"{s['tokens_per_second']:.0f}",
                    f"{s['train_time_s'] / s['global_steps']:.3f}",
                ]
                for name, s, batch in (
                    ("batch padding", base, f"{a.batch_size} examples"),
                    ("zero_padding+greedy+flash_mask", packed, f"{rows} rows of {a.max_length}"),
                )
            ],
        )
    )
    print(f"\nspeed-up (non-padding tokens/s): {packed['tokens_per_second'] / base['tokens_per_second']:.2f}x")


if __name__ == "__main__":
    main()
