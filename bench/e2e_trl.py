"""bench/e2e.py's TRL side: one SFTTrainer + PEFT LoRA run, in the TRL venv's interpreter (torch, not paddle).

    VENV/bin/python bench/e2e_trl.py '{"model": HF_DIR, "train": TRAIN_JSONL, "out": DIR, "steps": 5, ...}'

Reads {src, tgt} JSON lines as TRL prompt-completion rows (loss on the completion only; ``"packing": true``:
TRL's ``packing=True``, its default best-fit-decreasing padding-free rows of max_length), trains
with LoRA r / alpha on every decoder linear, and writes ``DIR/result.json``: supervised tokens (the
shifted labels that are not -100, counted in ``compute_loss``) and processed tokens (the attention
mask's ones, or every input id of a padding-free batch), each micro-batch's row length, train time, step
times, per-step losses and CPU% from the first to the last step end (peak RSS: the harness that runs this
process).

Optional keys: ``"gradient_checkpointing"`` (TRL 0.22's SFTConfig turns it on by default; absent: TRL's
default), ``"order_seed": S`` (unpacked only: the examples in ours' order, ``RandomState(S).permutation(n)``
of paddlenlp_ext/data/global_batches.py at epoch 0, instead of the Trainer's own shuffle, so both toolkits
train on the same examples in every step), ``"threads"``.
"""

import json
import os
import sys
import time


def main(spec):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    with open(spec["train"], encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    data = Dataset.from_list([{"prompt": r["src"], "completion": r["tgt"]} for r in rows])
    # "use_fast": false reads the SentencePiece model directly (the fast conversion needs protobuf)
    tok = AutoTokenizer.from_pretrained(spec["model"], use_fast=spec.get("use_fast", True))
    model = AutoModelForCausalLM.from_pretrained(spec["model"], torch_dtype=torch.float32)
    marks = []  # (wall, process CPU seconds) at every optimizer step end
    supervised, processed = [0], [0]
    row_tokens = []  # each micro-batch's row length: the peak RSS depends on the longest one
    order = None
    if spec.get("order_seed") is not None:

        class OursOrder(torch.utils.data.Sampler):
            def __init__(self, indices):
                self.indices = indices

            def __iter__(self):
                return iter(self.indices)

            def __len__(self):
                return len(self.indices)

        order = OursOrder(ours_order(len(rows), spec["order_seed"]))
    if order is not None and spec.get("packing"):
        raise SystemExit("order_seed is for unpacked runs (TRL's packing orders the examples itself)")

    class CountingTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            supervised[0] += int((inputs["labels"][..., 1:] != -100).sum())
            row_tokens.append(int(inputs["input_ids"].shape[-1]))
            mask = inputs.get("attention_mask")
            processed[0] += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
            return super().compute_loss(model, inputs, *args, **kwargs)

        def _get_train_sampler(self, *args, **kwargs):
            return super()._get_train_sampler(*args, **kwargs) if order is None else order

    more = (
        {}
        if spec.get("gradient_checkpointing") is None
        else {"gradient_checkpointing": bool(spec["gradient_checkpointing"])}
    )
    cfg = SFTConfig(
        **trainer_args(spec),
        packing=bool(spec.get("packing")),
        completion_only_loss=True,
        **more,
    )
    trainer = CountingTrainer(
        model=model,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        peft_config=lora_config(spec),
        callbacks=[step_marks(marks)],
    )
    write_result(
        spec,
        trainer,
        trainer.train(),
        marks,
        supervised_tokens=supervised[0],
        tokens=processed[0],
        row_tokens=row_tokens,
        gradient_checkpointing=bool(cfg.gradient_checkpointing),
        order="ours" if order else "trainer",
        trainable_params=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    )


def ours_order(n, seed):
    """The example order of ours' first epoch at one process (paddlenlp_ext/data/global_batches.py:
    ``RandomState(seed).permutation(n)``; at batch 1 x accumulation k every micro-step takes the next one):
    ``ours_order(5, 0)`` -> ``[2, 0, 1, 3, 4]``."""
    import numpy as np

    return np.random.RandomState(seed).permutation(n).tolist()


def trainer_args(spec):
    """The TrainingArguments both TRL runs share (SFT and DPO): fp32 on the CPU, batch 1 x
    ``spec["accumulation"]``, linear schedule without warmup, a loss logged every step, nothing saved."""
    return dict(
        output_dir=spec["out"],
        max_steps=spec["steps"],
        per_device_train_batch_size=1,
        gradient_accumulation_steps=spec["accumulation"],
        learning_rate=spec["lr"],
        warmup_steps=0,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        max_length=spec["max_length"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=42,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def lora_config(spec):
    """LoRA r / alpha on every decoder linear (or ``spec["target_modules"]``), no dropout (as ours)."""
    from peft import LoraConfig

    targets = spec.get("target_modules") or [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    return LoraConfig(
        r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets
    )


def step_marks(marks):
    """A callback appending (wall time, process CPU seconds) to ``marks`` at every optimizer step end."""
    from transformers import TrainerCallback

    class StepMarks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.perf_counter(), time.process_time()))  # user + system CPU of all threads

    return StepMarks()


def write_result(spec, trainer, out, marks, **extra):
    """``OUT/result.json``: train time, step times, CPU% over the steps, losses, versions, ``extra``."""
    import torch

    step_ends = [m[0] for m in marks]
    step_times = [b - a for a, b in zip(step_ends, step_ends[1:])]
    cpu_pct = 100.0 * (marks[-1][1] - marks[0][1]) / (marks[-1][0] - marks[0][0]) if len(marks) > 1 else None
    result = {
        **extra,
        "train_time_s": out.metrics["train_runtime"],
        "step_times_s": step_times,
        "cpu_pct": cpu_pct,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "torch_threads": torch.get_num_threads(),
        "versions": {
            m.__name__: m.__version__
            for m in (torch, __import__("transformers"), __import__("peft"), __import__("trl"))
        },
    }
    with open(os.path.join(spec["out"], "result.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
