"""Print the key figures of one or more runs (their output_dir/run_summary.json) as a table.

    python llm/tools/show_summary.py output/tiny_sft output/tiny_lora

Columns: method, trainable parameters, train loss, eval loss before -> after
training (and their ratio), eval accuracy (next-token; DPO: reward accuracy),
tokens/s and training time.  Fine-tuning (llm/run_finetune.py) and DPO
(llm/run_dpo.py) summaries both work.  Each run's curves are in
OUTPUT_DIR/loss.png, its full log in OUTPUT_DIR/train.log (docs/logging.md).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.training.console import format_count, format_duration, format_float  # noqa: E402

HEADER = ("run", "method", "trainable", "train loss", "eval loss before -> after", "accuracy", "tokens/s", "time")


def row(run_dir: str, s: dict) -> tuple:
    """One table row of a run_summary.json (fine-tuning or DPO)."""
    dpo_eval = s.get("eval") if isinstance(s.get("eval"), dict) else {}
    before = s.get("eval_loss_before_train")
    if before is None and isinstance(s.get("eval_before_train"), dict):
        before = s["eval_before_train"].get("eval_loss")
    after = s.get("eval_loss", dpo_eval.get("eval_loss"))
    loss = f"{format_float(before)} -> {format_float(after)}"
    if isinstance(before, (int, float)) and isinstance(after, (int, float)) and before:
        loss += f" ({after / before:.3f})"
    accuracy = s.get("eval_accuracy", dpo_eval.get("eval_rewards/accuracies"))
    tokens, seconds = s.get("tokens_trained"), s.get("train_time_s")
    rate = tokens / seconds if tokens and seconds else None
    return (
        run_dir,
        s.get("method", "?"),
        format_count(s.get("trainable_params")),
        format_float(s.get("train_loss")),
        loss,
        format_float(accuracy),
        format_count(rate),
        format_duration(seconds) if seconds else "-",
    )


def main(dirs):
    if not dirs:
        print(__doc__)
        return 2
    rows = []
    for d in dirs:
        path = os.path.join(d, "run_summary.json")
        if not os.path.isfile(path):
            print(f"{d}: no run_summary.json (did the run finish?)", file=sys.stderr)
            return 2  # bad input (docs/reliability.md)
        with open(path, encoding="utf-8") as f:
            rows.append(row(d, json.load(f)))
    widths = [max(len(r[i]) for r in [HEADER] + rows) for i in range(len(HEADER))]
    for r in [HEADER] + rows:
        # text columns left-aligned, figures right-aligned
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
