"""PaddleNLP's merge script location, on paddlenlp_ext's streaming, verified merge.

    python llm/tools/merge_lora_params.py --model_name_or_path BASE_DIR --lora_path ADAPTER_DIR \
        --output_path OUT_DIR [--safe_serialization False] [--device gpu|npu|cpu] [--low_gpu_mem True]

The same command as llm/merge_lora_params.py, with the same flags (``--output_path``, the older
``--merge_lora_model_path`` and ``--merge_model_path`` are one flag; without ``--model_name_or_path`` the
adapter's ``base_model_name_or_path`` is used, as older PaddleNLP did) and either adapter format: this
project's, or PaddleNLP's lora_config.json + lora_model_state.pdparams.  Only the defaults are PaddleNLP's:
``--safe_serialization`` false (``model_state.pdparams``) and PaddleNLP's shard sizes.  ``--low_gpu_mem`` and
``--device npu`` are accepted with a notice: the merge streams on the CPU.  Unknown flags are an error.
Same merge, exit codes and output as llm/merge_lora_params.py (docs/merge.md).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.cli import merge as command  # noqa: E402


def parse_arguments(argv=None):
    return command.parse_arguments(argv, paddlenlp_defaults=True)


def main(argv=None):
    return command.main(argv, paddlenlp_defaults=True)


if __name__ == "__main__":
    sys.exit(main())
