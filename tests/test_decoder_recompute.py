"""recompute on our decoder: the gradients do not change, ``no_recompute_layers`` is honoured, Paddle's false
"no input needs grad" warning stays off the console, and what the decoder does not implement is refused."""

import importlib
import logging
import os

import numpy as np
import paddle
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_decoder_parity import BASE, load_ours  # noqa: E402

MODEL_TYPE = "gemma2"  # sandwich norms and soft-caps: a layer with every slot in use


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.AutoConfig.for_model(MODEL_TYPE, **{**BASE, "num_hidden_layers": 3, "head_dim": 16})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    path = str(tmp_path_factory.mktemp("recompute"))
    hf.save_pretrained(path)
    return path


def _grads(path, **config):
    model = load_ours(path, MODEL_TYPE)
    for k, v in config.items():
        setattr(model.config, k, v)
    model.train()
    for name, p in model.named_parameters():
        p.stop_gradient = "embed_tokens" in name  # frozen embeddings: no input of layer 0 needs grad (as LoRA)
    ids = paddle.to_tensor(np.random.RandomState(0).randint(3, 120, size=(2, 12)), dtype="int64")
    out = model(input_ids=ids, labels=ids, return_dict=True)
    out.loss.backward()
    return {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_recompute_keeps_every_gradient_and_drops_only_the_false_warning(checkpoint):
    logger = importlib.import_module("paddle.distributed.fleet.recompute.recompute").logger
    seen = _Records()
    logger.addHandler(seen)
    try:
        plain = _grads(checkpoint, recompute=False)
        recomputed = _grads(checkpoint, recompute=True)
        partly = _grads(checkpoint, recompute=True, no_recompute_layers=[0, 2])
        logger.warning("another warning of this logger")
    finally:
        logger.removeHandler(seen)
    assert len(plain) > 10 and set(plain) == set(recomputed) == set(partly)
    for name in plain:
        np.testing.assert_allclose(recomputed[name], plain[name], rtol=1e-5, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(partly[name], plain[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert seen.messages == ["another warning of this logger"], seen.messages


def test_no_recompute_layers_skips_those_layers(checkpoint, monkeypatch):
    from paddlenlp_ext.models.decoder import modeling

    calls = []
    real = modeling.recompute_layer
    monkeypatch.setattr(modeling, "recompute_layer", lambda layer, *a: calls.append(layer) or real(layer, *a))
    model = load_ours(checkpoint, MODEL_TYPE)
    model.config.recompute, model.config.no_recompute_layers = True, [1]
    model.train()
    ids = paddle.to_tensor([[5, 6, 7, 8]], dtype="int64")
    model(input_ids=ids, labels=ids, return_dict=True).loss.backward()
    layers = getattr(model, model.base_model_prefix).layers  # gemma2.layers.N
    assert calls == [layers[0], layers[2]]


@pytest.mark.parametrize(
    "key,value,advice",
    [
        ("recompute_granularity", "core_attn", 'recompute_granularity to "full"'),
        ("recompute_use_reentrant", "true", "recompute_use_reentrant=false"),
    ],
)
def test_what_the_decoder_does_not_recompute_is_refused(checkpoint, key, value, advice):
    from conftest import ROOT
    from paddlenlp_ext.config.parse import ConfigError, load_config

    cfg = os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json")
    with pytest.raises(ConfigError) as e:
        load_config(cfg, ["--model_name_or_path", checkpoint, "--recompute", "true", f"--{key}", value])
    assert key in str(e.value) and advice in str(e.value)
    load_config(cfg, ["--model_name_or_path", checkpoint, "--recompute", "true"])  # the advice, followed, passes


def test_paddlenlps_fusion_switches_are_refused_on_decoder_rows(checkpoint):
    """fuse_attention_qkv / _ffn would send the build to PaddleNLP's own loader (and, for a model_type PaddleNLP
    also has, its class): refused on every decoder row, naming the key."""
    from conftest import ROOT
    from paddlenlp_ext.config.parse import ConfigError, load_config

    cfg = os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json")
    for key in ("fuse_attention_qkv", "fuse_attention_ffn"):
        with pytest.raises(ConfigError) as e:
            load_config(cfg, ["--model_name_or_path", checkpoint, f"--{key}", "true"])
        assert f"{key}=true" in str(e.value) and f"remove {key}" in str(e.value)
    load_config(cfg, ["--model_name_or_path", checkpoint, "--fuse_attention_qkv", "false"])
