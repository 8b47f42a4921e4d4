"""Mistral, Gemma, Llama, Qwen2 and Qwen3 moved from PaddleNLP's classes (and ours of qwen3) onto our decoder:
checkpoints PaddleNLP's own ``MistralForCausalLM`` / ``GemmaForCausalLM`` / ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` (and ``models/qwen3``'s ``Qwen3ForCausalLM``) write load into the decoder by name (the same
tensor names and [in, out] Linears), and the decoder's logits equal those classes' forward on them."""

import numpy as np
import paddle
import pytest

from conftest import DATA_DIR
from family_models import build_family_model
from paddlenlp_ext.models.family_table import FAMILIES

MOVED = ["mistral", "gemma"]


@pytest.mark.parametrize("model_type", MOVED)
def test_paddlenlp_checkpoint_loads_into_the_decoder_with_paddlenlps_logits(model_type, tiny_model_dir, tmp_path):
    import paddlenlp.transformers as T

    from paddlenlp_ext.models.decoder import classes_for
    from paddlenlp_ext.models.loading import decoder_class_for, load_model_streaming

    assert FAMILIES[model_type].decoder
    path = build_family_model(model_type, str(tmp_path / model_type), tiny_model_dir)
    ref = T.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    ref.eval()
    _, _, lm_cls = classes_for(model_type)
    cls, config = decoder_class_for(T.AutoConfig.from_pretrained(path))  # what training and the predictor build
    assert cls is lm_cls
    ours, stats = load_model_streaming(path, config, "float32", model_class=lm_cls)
    ours.eval()
    assert stats["layout"] == "paddlenlp"
    ids = paddle.to_tensor(np.random.RandomState(0).randint(3, 500, size=(2, 16)), dtype="int64")
    mask = paddle.to_tensor([[0] * 4 + [1] * 12, [1] * 16], dtype="int64")  # a left-padded row
    with paddle.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, return_dict=True).logits.numpy()
        got = ours(input_ids=ids, attention_mask=mask, return_dict=True).logits.numpy()
    np.testing.assert_allclose(got[0, 4:], want[0, 4:], atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)


#: the rows the toolkit trained on PaddleNLP's LlamaForCausalLM / Qwen2ForCausalLM and on models/qwen3 (ours, in
#: PaddleNLP's layout) before they moved: checkpoints those classes write, and the classes' forward as the judge
PADDLENLP_BUILT = {
    "llama": ("paddlenlp.transformers", "LlamaForCausalLM", {}),
    "llama-tied": ("paddlenlp.transformers", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    # PaddleNLP's own linear RoPE scaling key: transformers' linear scaling (decoder/rows.paddlenlp_rope_scaling)
    "llama-linear": (
        "paddlenlp.transformers",
        "LlamaForCausalLM",
        {"rope_scaling_type": "linear", "rope_scaling_factor": 2.0},
    ),
    "qwen2": ("paddlenlp.transformers", "Qwen2ForCausalLM", {}),
    "qwen3": ("paddlenlp_ext.models.qwen3", "Qwen3ForCausalLM", {}),
}


@pytest.mark.parametrize("case", sorted(PADDLENLP_BUILT))
def test_llama_qwen2_qwen3_checkpoints_load_into_the_decoder_with_their_classes_logits(case, tmp_path):
    import importlib

    from paddlenlp_ext.models.decoder import classes_for
    from paddlenlp_ext.models.loading import decoder_class_for, load_model_streaming
    from paddlenlp_ext.models.model_config import load_model_config
    from paddlenlp_ext.models.tiny import build_tiny_model

    module, name, overrides = PADDLENLP_BUILT[case]
    model_type = case.split("-")[0]
    assert FAMILIES[model_type].decoder
    path = build_tiny_model(str(tmp_path / case), DATA_DIR, family=model_type, **overrides)
    ref_cls = getattr(importlib.import_module(module), name)
    ref = ref_cls.from_pretrained(path, dtype="float32")
    ref.eval()
    _, _, lm_cls = classes_for(model_type)
    cls, config = decoder_class_for(load_model_config(path, dtype="float32"))  # what training and the predictor build
    assert cls is lm_cls and not isinstance(ref, lm_cls)
    ours, stats = load_model_streaming(path, config, "float32", model_class=lm_cls)
    ours.eval()
    assert stats["layout"] == "paddlenlp"
    assert sorted(ours.state_dict()) == sorted(ref.state_dict())  # the same tensor names: adapters keep their keys
    _same_logits(ref, ours)


def _same_logits(ref, ours):
    ids = paddle.to_tensor(np.random.RandomState(0).randint(3, 500, size=(2, 16)), dtype="int64")
    mask = paddle.to_tensor([[0] * 4 + [1] * 12, [1] * 16], dtype="int64")  # a left-padded row
    with paddle.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, return_dict=True).logits.numpy()
        got = ours(input_ids=ids, attention_mask=mask, return_dict=True).logits.numpy()
    np.testing.assert_allclose(got[0, 4:], want[0, 4:], atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)


def test_paddlenlp_fused_projections_are_refused_with_advice_that_works(tiny_model_dir, tmp_path):
    """A checkpoint holding PaddleNLP's fused ``qkv_proj`` / ``gate_up_fused_proj`` (what a fused LlamaForCausalLM's
    state_dict holds; PaddleNLP 3.0.0b4's save_pretrained splits them) is refused naming them, and the advice, run
    as written, gives a directory the decoder loads with the fused model's logits."""
    import json
    import shutil

    import paddlenlp.transformers as T
    from safetensors.numpy import save_file

    from paddlenlp_ext.models.checkpoint import CheckpointError
    from paddlenlp_ext.models.loading import decoder_class_for, load_model_streaming
    from paddlenlp_ext.models.model_config import load_model_config

    fused_dir = tmp_path / "fused"
    shutil.copytree(tiny_model_dir, fused_dir)
    config = T.LlamaConfig.from_pretrained(tiny_model_dir)
    config.fuse_attention_qkv = config.fuse_attention_ffn = True
    ref = T.LlamaForCausalLM.from_pretrained(tiny_model_dir, config=config, dtype="float32")
    ref.eval()
    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    assert (
        "llama.layers.0.self_attn.qkv_proj.weight" in state and "llama.layers.0.mlp.gate_up_fused_proj.weight" in state
    )
    (fused_dir / "model.safetensors").unlink()
    save_file(state, str(fused_dir / "model.safetensors"), metadata={"format": "np"})
    raw = json.loads((fused_dir / "config.json").read_text())
    (fused_dir / "config.json").write_text(json.dumps({**raw, "fuse_attention_qkv": True, "fuse_attention_ffn": True}))

    cls, cfg = decoder_class_for(load_model_config(str(fused_dir), dtype="float32"))
    with pytest.raises(CheckpointError, match="qkv_proj.*gate_up_fused_proj|gate_up_fused_proj.*qkv_proj") as e:
        load_model_streaming(str(fused_dir), cfg, "float32", model_class=cls)
    advice = str(e.value).split("python -c ")[1].split(" and set model_name_or_path")[0]
    out = tmp_path / "split"
    exec(advice.strip('"').replace("OUT_DIR", str(out)), {})  # the command's program, in this process
    cls, cfg = decoder_class_for(load_model_config(str(out), dtype="float32"))
    ours, _ = load_model_streaming(str(out), cfg, "float32", model_class=cls)
    ours.eval()
    _same_logits(ref, ours)


def test_qwen2_attention_dropout_applies_in_training_only(tiny_qwen2_dir):
    """qwen2 kept its attention dropout when it moved (attention_probs_dropout_prob -> the config's
    attention_dropout, as PaddleNLP's eager Qwen2 attention): the probabilities drop out in training only."""
    from paddlenlp_ext.models.dropout import dropout_config_updates
    from paddlenlp_ext.models.loading import decoder_class_for, load_model_streaming
    from paddlenlp_ext.models.model_config import load_model_config

    config = load_model_config(tiny_qwen2_dir, dtype="float32")
    for attr, value in dropout_config_updates("qwen2", {"attention_probs_dropout_prob": 0.5}).items():
        setattr(config, attr, value)
    cls, config = decoder_class_for(config)
    model, _ = load_model_streaming(tiny_qwen2_dir, config, "float32", model_class=cls)
    ids = paddle.to_tensor(np.random.RandomState(0).randint(3, 500, size=(1, 12)), dtype="int64")
    with paddle.no_grad():
        model.eval()
        a, b = (model(input_ids=ids, return_dict=True).logits.numpy() for _ in range(2))
        model.train()
        paddle.seed(0)
        c = model(input_ids=ids, return_dict=True).logits.numpy()
    np.testing.assert_array_equal(a, b)
    assert np.abs(c - a).max() > 1e-3  # half of every row's attention weights dropped (and the rest doubled)


def test_prefix_tuning_on_the_decoder_with_recompute(tiny_model_dir):
    """PaddleNLP's shipped llama/pt_argument.json sets recompute=true: a decoder layer given the prefix's
    past_key_values is not recomputed, so the prefix gets the same loss and gradients as without recompute."""
    from paddlenlp_ext.models.loading import decoder_class_for, load_model_streaming
    from paddlenlp_ext.models.model_config import load_model_config
    from paddlenlp_ext.prefix.config import ModelFacts, prefix_config_for_model
    from paddlenlp_ext.prefix.model import PrefixModel

    cls, config = decoder_class_for(load_model_config(tiny_model_dir, dtype="float32"))
    model, _ = load_model_streaming(tiny_model_dir, config, "float32", model_class=cls)
    paddle.seed(1)
    pm = PrefixModel(model, prefix_config_for_model(ModelFacts.of(model.config), 4, dtype="float32"))
    pm.train()
    ids = paddle.to_tensor(np.random.RandomState(0).randint(3, 500, size=(2, 12)), dtype="int64")
    out = []
    for recompute in (False, True):
        model.config.recompute = recompute
        loss = pm(input_ids=ids, labels=ids, return_dict=True).loss
        loss.backward()
        grads = [p.grad.numpy().copy() for p in pm.prefix_encoder.parameters()]
        pm.clear_gradients()
        out.append((float(loss), grads))
    model.config.recompute = False
    assert out[0][0] == out[1][0]
    for a, b in zip(out[0][1], out[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)  # autograd vs the saved-q/k/v attention: rounding
