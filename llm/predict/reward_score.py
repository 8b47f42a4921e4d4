"""Score completions or preference pairs with a reward model trained by llm/run_reward.py.

    python llm/predict/reward_score.py --model_name_or_path OUTPUT_DIR --input_file IN.jsonl \
        --output_file OUT.jsonl [--batch_size 8] [--dtype float32]

OUTPUT_DIR: a reward output directory (full weights or an adapter; a checkpoint-N of it; or a
merged one).  Each input record is ``{"prompt", "response"}`` (-> ``"score"``) or a preference
pair in a DPO format (-> ``"chosen_score"``, ``"rejected_score"``; the pair accuracy is printed).
See docs/alignment.md.  Exit codes: 0 ok; 2 bad input (flags, file records, not a reward directory).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.cli.common import EXIT_INPUT_ERROR  # noqa: E402
from paddlenlp_ext.data.reader import DataError  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description="Score records with a reward model (docs/alignment.md).")
    p.add_argument("--model_name_or_path", required=True, help="reward output directory (llm/run_reward.py)")
    p.add_argument("--input_file", required=True, help='JSON lines: {"prompt", "response"} or preference pairs')
    p.add_argument("--output_file", required=True, help="JSON lines: each input record plus its score(s)")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per forward (default 8)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    if args.batch_size < 1:
        print("error: --batch_size must be >= 1", file=sys.stderr)
        return EXIT_INPUT_ERROR
    if not os.path.isfile(args.input_file):
        print(f"error: --input_file {args.input_file}: no such file", file=sys.stderr)
        return EXIT_INPUT_ERROR
    if not os.path.isdir(args.model_name_or_path):
        print(f"error: --model_name_or_path {args.model_name_or_path}: not a directory", file=sys.stderr)
        return EXIT_INPUT_ERROR
    from paddlenlp_ext.reward.score_file import score_records, write_jsonl
    from paddlenlp_ext.reward.scorer import RewardScorer

    try:
        scorer = RewardScorer.from_pretrained(args.model_name_or_path, dtype=args.dtype)
    except ValueError as e:  # not a reward directory, its base model missing, a head that does not fit
        print(f"error: --model_name_or_path {args.model_name_or_path}: {e}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    scorer.batch_size = args.batch_size
    try:
        rows, summary = score_records(scorer, [args.input_file])
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    write_jsonl(args.output_file, rows)
    line = f"[reward_score] scored {summary['records']} record(s) -> {args.output_file}"
    if summary["pairs"]:
        line += (
            f"; pairs {summary['pairs']}: pair accuracy {summary['pair_accuracy']:.4f}, "
            f"mean margin {summary['mean_margin']:.4f}"
        )
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
