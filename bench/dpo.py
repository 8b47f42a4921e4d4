"""DPO through the real CLI: packed vs unpacked pairs/s, and LoRA-DPO vs LoRA-SFT peak memory.

    .venv/bin/python -m bench.dpo [--part speed,memory] [--steps 20] [--max_seq_len 2048] [--batch_size 4]
        [--model_dir build/llama-0.8b] [--sft_data build/alpaca_en_demo] [--json out.json]

speed: a tiny random-init Llama with the real Llama 2 tokenizer (so lengths are those of real data)
trains with llm/run_dpo.py on ../shared/data/dpo_en_demo.json (converted to PaddleNLP's
{"src", "tgt", "response", "sort"} lines) twice, in separate processes:

  unpacked : one pair per row, each batch padded to its longest row
  packed   : zero_padding + greedy_zero_padding + use_flash_attention + flash_mask, rows of max_seq_len
             holding about as many pairs per step as the unpacked batch

and prints pairs/s (pairs trained / train time) and the padding ratio of both side by side.

memory: on the 0.84B-parameter Llama of bench/big_model.py, LoRA-SFT (llm/run_finetune.py) and
LoRA-DPO (llm/run_dpo.py, the reference = the same model with adapters off: no second copy) run 3
steps each in their own process at batch 1; peak RSS of each run (the harness's) and the ratio.
The DPO row holds prompt + chosen + rejected (max_seq_len 512); the SFT row holds prompt + answer
padded to 512 as well, so both forward the same number of tokens per step.
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
from bench.big_model import ensure  # noqa: E402

ROOT = h.ROOT


def convert_dpo_demo(src_path, out_dir, n_dev=16):
    """LLaMA-Factory's sharegpt preference rows -> PaddleNLP's preference JSON lines (train.json, dev.json).

    {"conversations": [{"from": "human", "value": q1}, {"from": "gpt", "value": a1}, {"from": "human", "value": q2}],
     "chosen": {"value": c}, "rejected": {"value": r}}
    -> {"src": [q1, q2], "tgt": [a1], "response": [c, r], "sort": [1, 0]}
    """
    rows = json.load(open(src_path, encoding="utf-8"))
    out = []
    for r in rows:
        turns = r["conversations"]
        src = [t["value"] for t in turns if t["from"] == "human"]
        tgt = [t["value"] for t in turns if t["from"] == "gpt"]
        if len(src) != len(tgt) + 1 or not r["chosen"]["value"].strip() or not r["rejected"]["value"].strip():
            continue  # counted below: the converter reports what it skipped
        out.append({"src": src, "tgt": tgt, "response": [r["chosen"]["value"], r["rejected"]["value"]], "sort": [1, 0]})
    os.makedirs(out_dir, exist_ok=True)
    for name, part in (("train", out), ("dev", out[:n_dev])):
        with open(os.path.join(out_dir, f"{name}.json"), "w", encoding="utf-8") as f:
            for r in part:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return len(out), len(rows) - len(out)


def run_cli(script, config, overrides, out_dir) -> h.Run:
    return h.run(h.cli(script, os.path.join(ROOT, config), "--output_dir", out_dir, *overrides), out_dir=out_dir)


def speed(a, tmp):
    demo, spm = h.DPO_DEMO, h.TOKENIZER_MODEL
    h.require_shared(demo, spm)
    from paddlenlp_ext.models.tiny import build_tiny_model

    data_dir, model_dir = os.path.join(tmp, "dpo_data"), os.path.join(tmp, "model")
    n, skipped = convert_dpo_demo(demo, data_dir)
    build_tiny_model(model_dir, None, spm_model=spm, max_position_embeddings=a.max_seq_len)
    common = h.flags(model_name_or_path=model_dir, train_dataset_path=data_dir, dev_dataset_path=data_dir)
    common += h.flags(max_steps=a.steps, max_seq_len=a.max_seq_len, max_prompt_len=a.max_seq_len // 2)
    common += h.flags(do_eval="false", logging_steps=5)
    base = run_cli(
        "llm/run_dpo.py",
        "llm/config/tiny/dpo_lora_argument.json",
        common + ["--per_device_train_batch_size", a.batch_size, "--zero_padding", "false"],
        os.path.join(tmp, "unpacked"),
    ).summary
    tokens_per_pair = base["tokens_trained"] / base["pairs_trained"]
    rows = max(1, math.ceil(a.batch_size * tokens_per_pair / a.max_seq_len))
    packed = run_cli(
        "llm/run_dpo.py",
        "llm/config/tiny/dpo_lora_argument.json",
        common + ["--per_device_train_batch_size", rows] + h.PACKED,
        os.path.join(tmp, "packed"),
    ).summary
    print(
        f"\ndpo_en_demo: {n} pairs ({skipped} skipped by the converter), tiny Llama (hidden 64, 2 layers, LoRA) "
        f"with the Llama 2 tokenizer, max_seq_len {a.max_seq_len}, {a.steps} steps\n"
    )
    out, rows_ = {}, []
    for name, s, batch in (
        ("unpacked (batch padding)", base, f"{a.batch_size} pairs"),
        ("zero_padding+greedy+flash_mask", packed, f"{rows} rows of {a.max_seq_len}"),
    ):
        out[name] = {
            "pairs_per_second": s["pairs_per_second"],
            "padding_ratio": s["row_padding_ratio"],
            "pairs_trained": s["pairs_trained"],
            "step_time_s": s["train_time_s"] / s["global_steps"],
        }
        rows_.append(
            [
                name,
                batch,
                f"{out[name]['padding_ratio']:.4f}",
                s["pairs_trained"],
                f"{s['pairs_per_second']:.1f}",
                f"{out[name]['step_time_s']:.3f}",
            ]
        )
    print(h.table(["run", "batch", "padding ratio", "pairs trained", "pairs/s", "step time (s)"], rows_))
    ratio = (
        out["zero_padding+greedy+flash_mask"]["pairs_per_second"] / out["unpacked (batch padding)"]["pairs_per_second"]
    )
    print(f"\nspeed-up (pairs/s): {ratio:.2f}x  (target >= 1.5x: {h.verdict(ratio, 1.5, at_least=True)})")
    out["speedup"] = ratio
    return out


def memory(a, tmp):
    ensure(a.model_dir, a.sft_data)
    dpo_dir = os.path.join(tmp, "dpo_mem")
    convert_dpo_demo(h.DPO_DEMO, dpo_dir)
    steps = [
        "--max_steps",
        3,
        "--per_device_train_batch_size",
        1,
        "--do_eval",
        "false",
        "--save_strategy",
        "no",
        "--lora",
        "true",
        "--lora_rank",
        8,
        "--logging_steps",
        1,
        "--model_name_or_path",
        a.model_dir,
    ]
    sft = run_cli(
        "llm/run_finetune.py",
        "llm/config/tiny/lora_argument.json",
        steps
        + [
            "--dataset_name_or_path",
            a.sft_data,
            "--max_length",
            512,
            "--src_length",
            256,
            "--pad_to_max_length",
            "true",
            "--eval_before_train",
            "false",
        ],
        os.path.join(tmp, "sft_mem"),
    )
    dpo = run_cli(
        "llm/run_dpo.py",
        "llm/config/tiny/dpo_lora_argument.json",
        steps
        + [
            "--train_dataset_path",
            dpo_dir,
            "--dev_dataset_path",
            dpo_dir,
            "--max_seq_len",
            512,
            "--max_prompt_len",
            256,
            "--zero_padding",
            "true",
        ],
        os.path.join(tmp, "dpo_mem"),
    )
    ratio = dpo.peak_rss_bytes / sft.peak_rss_bytes
    print("\n0.84B Llama, LoRA r=8, batch 1, rows of 512 tokens, 3 steps, each run in its own process\n")
    print(
        h.table(
            ["run", "peak RSS (GiB)", "RSS after load (GiB)", "median step (s)"],
            [
                [
                    name,
                    f"{r.peak_rss_bytes / h.GiB:.2f}",
                    f"{r.summary['rss_after_load_bytes'] / h.GiB:.2f}",
                    h.fmt(r.median_step_s()),
                ]
                for name, r in (("LoRA-SFT (run_finetune)", sft), ("LoRA-DPO (run_dpo, reference = adapters off)", dpo))
            ],
        )
    )
    print(f"\nLoRA-DPO / LoRA-SFT peak RSS: {ratio:.2f}x  (target <= 1.15x: {h.verdict(ratio, 1.15)})")
    return {"sft_peak": sft.peak_rss_bytes, "dpo_peak": dpo.peak_rss_bytes, "ratio": ratio}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--part", default="speed,memory")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max_seq_len", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=4, help="pairs per step without packing")
    p.add_argument("--model_dir", default=os.path.join(ROOT, "build", "llama-0.8b"))
    p.add_argument("--sft_data", default=os.path.join(ROOT, "build", "alpaca_en_demo"))
    p.add_argument("--json")
    a = p.parse_args()
    print("command: python -m bench.dpo " + " ".join(sys.argv[1:]))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "speed" in a.part:
            results["speed"] = speed(a, tmp)
        if "memory" in a.part:
            results["memory"] = memory(a, tmp)
    h.write_json(a.json, results)


if __name__ == "__main__":
    main()
