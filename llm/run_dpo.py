"""Preference training (DPO and its family) of a causal LM from a JSON config.

    python llm/run_dpo.py llm/config/tiny/dpo_lora_argument.json [--key value ...]
    python -m paddle.distributed.launch --gpus 0,1 llm/run_dpo.py CONFIG.json

Keys: PaddleNLP's llm/alignment/dpo ones (beta, loss_type, train_dataset_path,
max_seq_len, ...; docs/dpo.md) plus the model / adapter / training keys of
llm/run_finetune.py.  Config problems (unknown keys, fine-tuning-only keys,
bad values, contradictions, missing files) are all reported together, before
anything is loaded, with exit code 2.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(
    __file__, config_first=True
)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.cli.common import run_config_script  # noqa: E402

USAGE = "usage: python llm/run_dpo.py CONFIG.json [--key value ...]"


def main(argv):
    return run_config_script(argv, USAGE, mode="dpo", runner="paddlenlp_ext.dpo.run")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
