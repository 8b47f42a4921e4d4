"""Build the tiny demo/test model (random-init Llama + SentencePiece tokenizer trained on the bundled data).

python llm/tools/make_tiny_model.py [--output build/tiny-llama] [--data llm/data/advertise] [--force]
"""

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.models.tiny import build_tiny_model, ensure_tiny_model  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="build/tiny-llama")
    p.add_argument("--data", default="llm/data/advertise", help="directory of *.json lines to train the tokenizer on")
    p.add_argument("--vocab_size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if the model exists")
    a = p.parse_args()
    if a.force and os.path.isdir(a.output):
        shutil.rmtree(a.output)
    builder = build_tiny_model if a.force else ensure_tiny_model
    print(builder(a.output, a.data, vocab_size=a.vocab_size, seed=a.seed))


if __name__ == "__main__":
    main()
