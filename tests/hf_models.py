"""Random tiny Hugging Face (transformers) checkpoints for the HF-layout tests and the memory bench.

transformers and torch build and save them (``save_pretrained``), so the layout
under test is the other side's own, never a copy of ours.
"""

import importlib
import json
import os

import pytest

#: the families whose transformers layout the streaming loader reads (models/hf_layout.HF_FAMILIES)
FAMILIES = ["llama", "qwen2", "mistral", "qwen3"]
TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
)


def family_param(family):
    """pytest param for ``family``; qwen3 is skipped while paddlenlp_ext has no Qwen3 model of its own."""
    if family != "qwen3":
        return pytest.param(family, id=family)
    try:
        importlib.import_module("paddlenlp_ext.models.qwen3")
        ok = True
    except ImportError:
        ok = False
    return pytest.param(
        family, id=family, marks=pytest.mark.skipif(not ok, reason="paddlenlp_ext.models.qwen3 is not importable yet")
    )


FAMILY_PARAMS = [family_param(f) for f in FAMILIES]


def hf_classes(family):
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3"}[family]
    return getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")


def save_hf_model(out_dir, family, dtype="float32", max_shard_size=None, seed=0, tie=None, **overrides):
    """Build a random transformers ``<Family>ForCausalLM`` and ``save_pretrained`` it (safetensors).

    ``dtype`` "bfloat16" saves bf16 tensors; ``max_shard_size`` (e.g. "40KB") shards the
    weights with a ``model.safetensors.index.json``.  Returns ``out_dir``.
    """
    import torch

    cfg_cls, model_cls = hf_classes(family)
    kw = {**TINY, **overrides}
    kw["tie_word_embeddings"] = (family == "qwen2") if tie is None else tie
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).to(getattr(torch, dtype))
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def edit_config(model_dir, **changes):
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
