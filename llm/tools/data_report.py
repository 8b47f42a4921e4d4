"""Tokenize and pack the configured dataset without training; print one JSON object.

    python llm/tools/data_report.py CONFIG.json [--key value ...]

Per split (train with do_train, dev with do_eval): examples,
truncated_examples, dropped_rounds, tokens, supervised_tokens,
supervised_fraction, packing, packs (or batches), padding_ratio,
length_histogram.  The same figures are logged at the start of training and
stored in run_summary.json ("data").  With lazy=true the report still reads
the whole train set (it has to count it); training itself streams.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.cli.common import config_or_exit, run_or_exit_code  # noqa: E402

USAGE = "usage: python llm/tools/data_report.py CONFIG.json [--key value ...]"


def main(argv):
    """Exit codes as every script (paddlenlp_ext.cli.common): 0 ok, 2 bad config or data (file:line)."""
    return run_or_exit_code(report, config_or_exit(argv, USAGE))


def report(cfg):
    from paddlenlp_ext.data.build import build_datasets
    from paddlenlp_ext.training.run import load_tokenizer

    t = cfg.training
    # A report needs every example counted, so the train set is read whole even with lazy=true.
    cfg.data.lazy = False
    data = build_datasets(
        cfg,
        load_tokenizer(cfg),
        do_train=t.get("do_train", False),
        do_eval=t.get("do_eval", False),
        seed=t.get("seed", 42),
    )
    print(json.dumps(data.reports, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
