"""Merge a saved adapter (LoRA / rsLoRA / LoRA+ / PiSSA / VeRA / LoKr / QLoRA) into its base model.

    python llm/merge_lora_params.py --model_name_or_path BASE_DIR --lora_path ADAPTER_DIR \
        --merge_model_path OUT_DIR [--device cpu|gpu] [--safe_serialization true|false] \
        [--max_shard_size 1GB] [--verify|--no-verify] [--tolerance T] [--overwrite] [--output_format paddle|hf]

Streams the base checkpoint one tensor at a time (memory ~ a few of the largest
adapted tensors, never a shard or the whole model), writes a complete PaddleNLP
model directory and, by default, checks that the merged model reproduces
base + adapter.  ``--output_format hf`` writes the merged model in Hugging Face
transformers layout instead (docs/export.md).  See docs/merge.md.  ``--lora_path`` may also be a PaddleNLP
adapter (lora_config.json).  llm/tools/merge_lora_params.py (PaddleNLP's location) is the same command with
the same flags; only its defaults are PaddleNLP's (``paddlenlp_ext.cli.merge``).

Exit codes: 0 ok; 2 bad input or command line (nothing written); 1 the output could not be written;
3 merged but verification failed or could not run (the output carries a MERGE_VERIFY_FAILED file).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.cli import merge as command  # noqa: E402


def parse_arguments(argv=None):
    return command.parse_arguments(argv, paddlenlp_defaults=False)


def main(argv=None):
    return command.main(argv, paddlenlp_defaults=False)


if __name__ == "__main__":
    sys.exit(main())
