"""Fine-tune a causal LM from a JSON config.

    python llm/run_finetune.py llm/config/tiny/lora_argument.json [--key value ...]
    python -m paddle.distributed.launch --gpus 0,1 llm/run_finetune.py CONFIG.json

Config problems (unknown keys, bad values, contradictions, missing files)
are all reported together, before anything is loaded, with exit code 2.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(
    __file__, config_first=True
)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.cli.common import run_config_script  # noqa: E402

USAGE = "usage: python llm/run_finetune.py CONFIG.json [--key value ...]"


def main(argv):
    return run_config_script(argv, USAGE, mode="sft", runner="paddlenlp_ext.training.finetune")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
