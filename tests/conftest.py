import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY_DIR = os.path.join(ROOT, "build", "tiny-llama")
DATA_DIR = os.path.join(ROOT, "llm", "data", "advertise")
SHARED_DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The tiny demo model (built once; `make test` builds it before pytest runs)."""
    from paddlenlp_ext.models.tiny import ensure_tiny_model

    return ensure_tiny_model(TINY_DIR, DATA_DIR)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from paddlenlp.transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
