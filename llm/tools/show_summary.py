"""Print the key figures of one or more runs (their output_dir/run_summary.json) as a table.

    python llm/tools/show_summary.py output/tiny_sft output/tiny_lora
"""

import json
import os
import sys


def main(dirs):
    if not dirs:
        print(__doc__)
        return 2
    print(f"{'run':<24} {'method':<12} {'trainable':>10} {'eval loss before':>17} {'eval loss after':>16} "
          f"{'after/before':>13} {'tokens/s':>9}")
    for d in dirs:
        path = os.path.join(d, "run_summary.json")
        if not os.path.isfile(path):
            print(f"{d}: no run_summary.json (did the run finish?)", file=sys.stderr)
            return 1
        s = json.load(open(path))
        before, after = s.get("eval_loss_before_train"), s.get("eval_loss")
        ratio = f"{after / before:.3f}" if before and after is not None else "-"
        fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else "-"  # noqa: E731
        print(f"{d:<24} {s['method']:<12} {s['trainable_params']:>10,} {fmt(before):>17} {fmt(after):>16} "
              f"{ratio:>13} {s.get('tokens_per_second', 0):>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
