"""Qwen3 (paddlenlp_ext.models.qwen3) against transformers' own Qwen3ForCausalLM, and its integration.

The judge is transformers on PyTorch CPU (random weights, made large enough that
greedy decoding has clear winners): its state dict is copied into our model by
this test's own renaming (``model.`` -> ``qwen3.``) and transposition (Linear
``[out, in]`` -> ``[in, out]``), never by the library's loader.  Logits agree to
1e-4 (fp32) and 20 greedy tokens from our generation code (``predict.generate``,
left-padded batch, KV cache) equal transformers' ``generate``.  A negative control
shows the q/k norms are really exercised.
"""

import numpy as np
import paddle
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paddlenlp_ext.models.registration import register_qwen3  # noqa: E402
from paddlenlp_ext.models.qwen3 import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

VOCAB = 101
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)


def hf_model(seed=0, **overrides):
    """transformers' Qwen3ForCausalLM, random weights with std 0.15 and norm weights 1 +- 0.3 (so heads and
    norms all matter and greedy choices are far apart)."""
    kw = {**SIZES, "tie_word_embeddings": False, **overrides}
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def hf_to_ours(hf_state):
    """The test's own conversion: ``model.`` -> ``qwen3.``; 2-D Linear weights transposed (embeddings not)."""
    out = {}
    for k, v in hf_state.items():
        a = v.detach().numpy()
        if a.ndim == 2 and "embed_tokens" not in k:
            a = a.T
        out["qwen3." + k[len("model.") :] if k.startswith("model.") else k] = a
    return out


def our_model(hf, **overrides):
    kw = {**SIZES, "tie_word_embeddings": hf.config.tie_word_embeddings, **overrides}
    model = Qwen3ForCausalLM(Qwen3Config(**kw))
    model.eval()
    state = hf_to_ours(hf.state_dict())
    own = model.state_dict()
    if hf.config.tie_word_embeddings:  # one parameter under two names on both sides
        assert own["lm_head.weight"] is own["qwen3.embed_tokens.weight"]
        state.pop("lm_head.weight", None)
        own.pop("lm_head.weight")
    assert set(state) == set(own), sorted(set(state) ^ set(own))
    for k, v in state.items():
        assert list(own[k].shape) == list(v.shape), k
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    return model


def logits_of(model, ids):
    out = model(paddle.to_tensor(ids))
    return (out[0] if isinstance(out, tuple) else out.logits).numpy()


@pytest.mark.parametrize(
    "case",
    [dict(), dict(tie_word_embeddings=True), dict(attention_bias=True), dict(num_key_value_heads=4, head_dim=16)],
)
def test_logits_match_transformers(case):
    hf = hf_model(**case)
    ours = our_model(hf, **{k: v for k, v in case.items() if k != "tie_word_embeddings"})
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(3, 17))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    got = logits_of(ours, ids)
    assert got.shape == want.shape == (3, 17, VOCAB)
    assert np.abs(want).max() > 1.0  # not a near-zero model where anything agrees
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_negative_control_the_head_norms_matter():
    """Our model with q_norm/k_norm weights reset to 1 is far from transformers': the norms are applied."""
    hf = hf_model()
    ours = our_model(hf)
    for layer in ours.qwen3.layers:
        layer.self_attn.q_norm.weight.set_value(paddle.ones_like(layer.self_attn.q_norm.weight))
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(1, 12))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(logits_of(ours, ids) - want).max() > 1e-2


def test_20_greedy_tokens_identical_with_our_generation():
    """predict.generate (one left-padded batch, KV cache) vs transformers' generate, each prompt alone."""
    from paddlenlp_ext.predict.generate import generate_batch
    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.predict.prompts import Prompt

    hf = hf_model(seed=3)
    ours = our_model(hf)
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(1, VOCAB, size=n)) for n in (9, 4)]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]),
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
            )
        want.append(out[0, len(p) :].tolist())
    assert all(len(w) == 20 for w in want) and len(set(map(tuple, want))) == 2
    eos = next(t for t in range(VOCAB) if all(t not in w for w in want))  # never generated: no early stop
    o = PredictOptions(model_name_or_path="unused", decode_strategy="greedy_search")
    got = generate_batch(
        ours, [Prompt(ids=[int(t) for t in p], max_new_tokens=20) for p in prompts], o, eos_ids=[eos], pad_id=0
    )
    assert got == want


# ------------------------------------------------------------------ integration with PaddleNLP and our loaders
def test_auto_classes_and_streaming_loader_build_qwen3(tiny_qwen3_dir):
    """Dense qwen3 trains on our decoder: PaddleNLP's Auto classes build the decoder's Qwen3 classes from a
    checkpoint models/qwen3 wrote (PaddleNLP's layout), and the streaming loader quantizes it on arrival."""
    from paddlenlp_ext.models.registration import register_decoder

    register_qwen3()
    register_decoder()
    from paddlenlp.transformers import AutoConfig, AutoModelForCausalLM

    from paddlenlp_ext.models.decoder import classes_for
    from paddlenlp_ext.models.loading import load_model_streaming
    from paddlenlp_ext.models.tokenizer import load_tokenizer

    config_cls, _, lm_cls = classes_for("qwen3")
    config = AutoConfig.from_pretrained(tiny_qwen3_dir)
    assert type(config) is config_cls and config.model_type == "qwen3"
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.head_dim == 32 != config.hidden_size // config.num_attention_heads  # the tiny model bites
    loaded = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype="float32")
    assert type(loaded) is lm_cls and type(AutoModelForCausalLM.from_config(config)) is lm_cls
    names = dict(loaded.named_parameters())
    assert list(names["qwen3.layers.0.self_attn.q_proj.weight"].shape) == [64, 4 * 32]
    assert list(names["qwen3.layers.0.self_attn.o_proj.weight"].shape) == [4 * 32, 64]
    assert list(names["qwen3.layers.1.self_attn.k_norm.weight"].shape) == [32]
    assert "qwen3.layers.0.self_attn.q_proj.bias" not in names and "lm_head.weight" in names
    assert load_tokenizer(tiny_qwen3_dir).vocab_size == config.vocab_size

    streamed, stats = load_model_streaming(
        tiny_qwen3_dir,
        config,
        "float32",
        quantization={
            "weight_quantize_algo": "nf4",
            "weight_blocksize": 64,
            "weight_double_quant": False,
            "weight_double_quant_block_size": 256,
        },
    )
    assert type(streamed) is lm_cls and stats["quantized_layers"] == 14  # 7 linears x 2 layers
    ids = np.arange(1, 11)[None]
    ref = logits_of(loaded, ids)
    plain, _ = load_model_streaming(tiny_qwen3_dir, config, "float32")
    np.testing.assert_array_equal(logits_of(plain, ids), ref)
    from paddlenlp_ext.models.quantize import quantize_model

    quantize_model(loaded, "nf4", block_size=64)  # quantized after a full load: the same codes as on arrival
    got = logits_of(streamed, ids)
    np.testing.assert_allclose(got, logits_of(loaded, ids), atol=1e-5)
    assert np.abs(got - ref).max() > 1e-3  # and really quantized


def test_registration_leaves_the_other_families_alone(tiny_model_dir, tiny_qwen2_dir):
    register_qwen3()
    register_qwen3()  # idempotent
    from paddlenlp.transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM

    # the Auto model classes still give PaddleNLP's own classes (which the toolkit no longer trains llama / qwen2 on:
    # models.loading.decoder_class_for picks the decoder; AutoConfig may hold the decoder's config classes once
    # models.registration.register_decoder ran in this process, so each class builds from its own config class)
    for d, cls in ((tiny_model_dir, LlamaForCausalLM), (tiny_qwen2_dir, Qwen2ForCausalLM)):
        assert AutoConfig.from_pretrained(d).model_type == cls.config_class.model_type
        assert type(AutoModelForCausalLM.from_config(cls.config_class.from_pretrained(d))) is cls


def test_hf_name_mappings_cover_every_parameter():
    """PaddleNLP's convert_from_torch mapping (``_get_name_mappings``) names exactly our parameters."""
    for kw in (dict(), dict(attention_bias=True), dict(tie_word_embeddings=True)):
        config = Qwen3Config(**SIZES, **kw)
        config.architectures = ["Qwen3ForCausalLM"]
        mapped = {m.target_name for m in Qwen3ForCausalLM._get_name_mappings(config)}
        own = set(Qwen3ForCausalLM(config).state_dict())
        if config.tie_word_embeddings:
            own.discard("lm_head.weight")
        assert mapped == own, sorted(mapped ^ own)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("use_sliding_window", True, "use_sliding_window=true"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling="),
        ("fuse_attention_qkv", True, "fuse_attention_qkv=true"),
    ],
)
def test_unimplemented_settings_are_refused_by_name(key, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Qwen3ForCausalLM(Qwen3Config(**SIZES, **{key: value}))


@pytest.mark.parametrize("recompute", [None, ("full", False), ("full_attn", True), ("core_attn", False)])
def test_packed_flashmask_row_matches_examples_one_by_one(recompute):
    """A packed row (FlashMask start rows + restarting position ids, our CPU kernel via the fusion_ops patch)
    gives the loss and every gradient of the examples run alone through the dense path; with recompute
    too (``core_attn`` recomputes inside our attention forward)."""
    from test_flashmask_patch import (
        LENGTHS,
        assert_match,
        make_examples,
        packed_loss_and_grads,
        separate_loss_and_grads,
    )  # noqa: I001

    from paddlenlp_ext.integrations.flashmask import cpu_flashmask

    kw = {**SIZES, "vocab_size": 128, "max_position_embeddings": 128}
    rc = (
        {}
        if recompute is None
        else dict(recompute=True, recompute_granularity=recompute[0], recompute_use_reentrant=recompute[1])
    )
    paddle.seed(7)
    model = Qwen3ForCausalLM(Qwen3Config(**kw, use_flash_attention=True, **rc))
    ref = Qwen3ForCausalLM(Qwen3Config(**kw, use_flash_attention=False))
    ref.set_state_dict(model.state_dict())
    model.train()
    ref.train()
    if recompute is not None:
        model.recompute_enable()
        assert model.qwen3.layers[0].self_attn.enable_recompute and model.qwen3.enable_recompute
    examples = make_examples()
    assert len(examples) == len(LENGTHS)
    with cpu_flashmask():
        assert_match(packed_loss_and_grads(model, examples), separate_loss_and_grads(ref, examples))


def test_dpo_lm_head_split_takes_the_qwen3_body(tiny_qwen3_dir):
    """models.heads: the causal LM as body + lm_head (DPO's scored rows) -- the same logits as the forward, on
    models/qwen3's class (the base of its Qwen3-MoE) and on the decoder's (what dense qwen3 trains on)."""
    from paddlenlp_ext.models.heads import split_lm_head
    from paddlenlp_ext.models.loading import decoder_class_for, load_model_streaming
    from paddlenlp_ext.models.model_config import load_model_config

    cls, config = decoder_class_for(load_model_config(tiny_qwen3_dir, dtype="float32"))
    decoder, _ = load_model_streaming(tiny_qwen3_dir, config, "float32", model_class=cls)
    for model in (Qwen3ForCausalLM.from_pretrained(tiny_qwen3_dir, dtype="float32"), decoder):
        _check_split(model, split_lm_head)


def _check_split(model, split_lm_head):
    model.eval()
    body, head = split_lm_head(model)
    assert body is model.qwen3
    ids = paddle.to_tensor(np.arange(1, 9)[None])
    hidden = body(input_ids=ids)[0]
    np.testing.assert_allclose(head(hidden).numpy(), logits_of(model, ids.numpy()), atol=1e-6)


def test_support_docstring_and_no_paddle_import():
    import doctest
    import subprocess
    import sys

    from paddlenlp_ext.models.qwen3 import support

    assert doctest.testmod(support).failed == 0
    code = "import sys, paddlenlp_ext.models.qwen3.support; print('paddle' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # config validation can read the refusals without paddle
