"""KTO (Kahneman-Tversky Optimization) of a causal LM on labelled completions, from a JSON config.

    python llm/run_kto.py llm/config/tiny/kto_lora_argument.json [--key value ...]

Data: one record per example, a conversation whose last turn is the assistant's completion plus
a boolean ``label`` (desirable or not): ``{"messages": [...], "label": true}`` (docs/alignment.md).
Keys: PaddleNLP's llm/alignment/kto ones (beta, desirable_weight, undesirable_weight,
train_dataset_path, max_seq_len, ...; docs/alignment.md) plus the model / adapter / training keys
of llm/run_finetune.py.  Config problems are all reported together, before anything is loaded,
with exit code 2; so are bad data records (``file:line``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(
    __file__, config_first=True
)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.cli.common import run_config_script  # noqa: E402

USAGE = "usage: python llm/run_kto.py CONFIG.json [--key value ...]"


def main(argv):
    return run_config_script(argv, USAGE, mode="kto", runner="paddlenlp_ext.kto.run")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
