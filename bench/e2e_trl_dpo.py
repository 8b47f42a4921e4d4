"""bench/e2e.py's TRL DPO side: one DPOTrainer + PEFT LoRA run, in the TRL venv's interpreter (torch, not paddle).

    VENV/bin/python bench/e2e_trl_dpo.py '{"model": HF_DIR, "train": TRAIN_JSONL, "out": DIR, "steps": 5, ...}'

Reads PaddleNLP preference lines ({"src": [...], "tgt": [...], "response": [chosen, rejected], "sort": [1, 0]},
as ``bench/dpo.py`` converts dpo_en_demo.json) as TRL rows {prompt, chosen, rejected} (the turns before the
answer joined by newlines; no chat template, as ours), trains DPO (sigmoid loss, beta 0.1, the reference =
the base model with the adapters off) with LoRA r / alpha on every decoder linear, and writes
``DIR/result.json``: pairs, train time, step times, per-step losses, CPU%.
"""

import json
import os
import sys

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.e2e_trl import lora_config, step_marks, trainer_args, write_result  # noqa: E402


def main(spec):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    with open(spec["train"], encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    data = []
    for r in rows:
        turns = [t for pair in zip(r["src"], r["tgt"] + [None]) for t in pair if t is not None]
        chosen, rejected = r["response"] if r["sort"][0] > r["sort"][1] else r["response"][::-1]
        data.append({"prompt": "\n".join(turns) + "\n", "chosen": chosen, "rejected": rejected})
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], torch_dtype=torch.float32)
    marks = []
    cfg = DPOConfig(**trainer_args(spec), beta=0.1, loss_type=["sigmoid"])
    trainer = DPOTrainer(
        model=model,
        args=cfg,
        train_dataset=Dataset.from_list(data),
        processing_class=tok,
        peft_config=lora_config(spec),
        callbacks=[step_marks(marks)],
    )
    write_result(spec, trainer, trainer.train(), marks, pairs=spec["steps"] * spec["accumulation"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
