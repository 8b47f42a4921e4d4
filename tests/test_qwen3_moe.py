"""Qwen3-MoE (paddlenlp_ext.models.qwen3.moe) against transformers' own Qwen3MoeForCausalLM.

transformers' model with random weights is copied into ours by this test's own renaming and transposition;
logits agree to 1e-4 and so do the gradients of the router, the experts and the head norms (the routing
weights are differentiable, the expert choice is not -- as in transformers).  Then: the Auto classes and the
streaming (nf4) loader build it, unimplemented settings are refused by name, and LoRA trains it through the CLI.
"""

import json
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import ROOT  # noqa: E402
from paddlenlp_ext.models.registration import register_qwen3  # noqa: E402
from paddlenlp_ext.models.qwen3 import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

VOCAB = 101
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=128,
    moe_intermediate_size=40,
    num_experts=6,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
)


def pair(seed=0, **overrides):
    """(transformers' model, ours) with the same random weights (std 0.15, norm weights 1 +- 0.3)."""
    kw = {**SIZES, **overrides}
    torch.manual_seed(seed)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    ours = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw))
    ours.eval()
    state = {}
    for k, v in hf.state_dict().items():
        a = v.numpy()
        state["qwen3_moe." + k[len("model.") :] if k.startswith("model.") else k] = (
            a.T if a.ndim == 2 and "embed_tokens" not in k else a
        )
    assert set(state) == set(ours.state_dict())
    ours.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    return hf, ours


@pytest.mark.parametrize(
    "case",
    [
        dict(norm_topk_prob=True),
        dict(norm_topk_prob=False),
        dict(decoder_sparse_step=2, mlp_only_layers=[], num_experts_per_tok=3),
    ],
)
def test_logits_and_gradients_match_transformers(case):
    hf, ours = pair(**case)
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(2, 13))
    g = np.random.default_rng(1).standard_normal((2, 13, VOCAB)).astype("float32")
    want = hf(torch.tensor(ids)).logits
    (want * torch.tensor(g)).sum().backward()
    got = ours(paddle.to_tensor(ids))[0]
    (got * paddle.to_tensor(g)).sum().backward()
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), atol=1e-4, rtol=0)
    hf_params, our_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    checked = 0
    names = [
        n
        for n in (
            "layers.0.mlp.gate.weight",
            "layers.1.mlp.gate.weight",
            "layers.0.mlp.experts.3.down_proj.weight",
            "layers.1.mlp.experts.2.gate_proj.weight",
            "layers.2.mlp.experts.0.up_proj.weight",
            "layers.1.mlp.up_proj.weight",
            "layers.0.mlp.up_proj.weight",
            "layers.0.self_attn.q_norm.weight",
            "layers.2.self_attn.k_proj.weight",
        )
        if "model." + n in hf_params
    ]
    assert set(names) & {"layers.0.mlp.gate.weight", "layers.1.mlp.gate.weight"}  # a router is checked
    for name in names:
        theirs = hf_params["model." + name]
        if theirs.grad is None:  # an expert no token was routed to (both sides: no gradient)
            assert our_params["qwen3_moe." + name].grad is None or not our_params["qwen3_moe." + name].grad.any()
            continue
        t = theirs.grad.numpy()
        t = t.T if t.ndim == 2 else t
        mine = our_params["qwen3_moe." + name].grad.numpy()
        np.testing.assert_allclose(mine, t, atol=1e-4 * max(1.0, np.abs(t).max()), rtol=0, err_msg=name)
        checked += 1
    assert checked >= 5


def test_dense_and_sparse_layers_follow_the_config():
    _, ours = pair(decoder_sparse_step=2, mlp_only_layers=[])
    assert [type(l.mlp).__name__ for l in ours.qwen3_moe.layers] == ["Qwen2MLP", "Qwen3MoeSparseMoeBlock", "Qwen2MLP"]
    _, ours = pair()
    assert [type(l.mlp).__name__ for l in ours.qwen3_moe.layers] == [
        "Qwen3MoeSparseMoeBlock",
        "Qwen2MLP",
        "Qwen3MoeSparseMoeBlock",
    ]


def test_auto_classes_and_streaming_nf4_load(tiny_qwen3_moe_dir):
    register_qwen3()
    from paddlenlp.transformers import AutoConfig, AutoModelForCausalLM

    from paddlenlp_ext.models.loading import load_model_streaming
    from paddlenlp_ext.models.quantize import quantize_model

    config = AutoConfig.from_pretrained(tiny_qwen3_moe_dir)
    assert type(config) is Qwen3MoeConfig and config.architectures == ["Qwen3MoeForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype="float32")
    assert type(loaded) is Qwen3MoeForCausalLM
    q = {
        "weight_quantize_algo": "nf4",
        "weight_blocksize": 64,
        "weight_double_quant": False,
        "weight_double_quant_block_size": 256,
    }
    streamed, stats = load_model_streaming(tiny_qwen3_moe_dir, config, "float32", quantization=q)
    ids = paddle.to_tensor(np.arange(1, 11)[None])
    quantize_model(loaded, "nf4", block_size=64)
    assert (
        stats["quantized_layers"]
        == sum(1 for n, _ in loaded.named_sublayers() if type(_).__name__ == "QuantizedLinear")
        >= 4 + 4 * 3 + 3
    )
    np.testing.assert_allclose(streamed(ids)[0].numpy(), loaded(ids)[0].numpy(), atol=1e-5)


def test_dpo_lm_head_split_takes_the_moe_body():
    from paddlenlp_ext.models.heads import split_lm_head

    _, ours = pair()
    body, head = split_lm_head(ours)
    assert body is ours.qwen3_moe
    ids = paddle.to_tensor(np.arange(1, 9)[None])
    np.testing.assert_allclose(head(body(input_ids=ids)[0]).numpy(), ours(ids)[0].numpy(), atol=1e-6)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("output_router_logits", True, "output_router_logits=true"),
        ("tensor_parallel_degree", 2, "tensor_parallel_degree=2"),
    ],
)
def test_unimplemented_settings_are_refused_by_name(key, value, message):
    with pytest.raises(ValueError, match=message):
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**SIZES, **{key: value}))


def test_hf_name_mappings_cover_every_parameter():
    config = Qwen3MoeConfig(**SIZES)
    config.architectures = ["Qwen3MoeForCausalLM"]
    mapped = {m.target_name for m in Qwen3MoeForCausalLM._get_name_mappings(config)}
    assert mapped == set(Qwen3MoeForCausalLM(config).state_dict())


@pytest.mark.slow
def test_lora_trains_through_the_cli_and_merges(tiny_qwen3_moe_dir, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = tmp_path / "lora"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "llm/run_finetune.py"),
            "llm/config/tiny/lora_argument.json",
            "--model_name_or_path",
            tiny_qwen3_moe_dir,
            "--output_dir",
            str(out),
            "--max_steps",
            "20",
            "--per_device_train_batch_size",
            "8",
            "--logging_steps",
            "5",
            "--eval_before_train",
            "false",
            "--do_eval",
            "false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    state = json.loads((out / "trainer_state.json").read_text())
    ls = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert ls[-1] < ls[0] - 1.0, ls
    from safetensors.numpy import load_file

    keys = load_file(str(out / "adapter_model.safetensors"))
    assert "qwen3_moe.layers.0.mlp.experts.3.down_proj.lora_A" in keys  # experts adapted
    assert "qwen3_moe.layers.1.mlp.down_proj.lora_A" in keys  # the dense layer too
    m = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "llm/merge_lora_params.py"),
            "--model_name_or_path",
            tiny_qwen3_moe_dir,
            "--lora_path",
            str(out),
            "--merge_model_path",
            str(tmp_path / "merged"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert m.returncode == 0 and "verify: passed" in m.stdout + m.stderr, m.stderr[-3000:]


def test_packed_flashmask_row_matches_examples_one_by_one():
    """Routing is per token, so a packed row (FlashMask start rows, our CPU kernel) is exact here too."""
    from test_flashmask_patch import assert_match, make_examples, packed_loss_and_grads, separate_loss_and_grads

    from paddlenlp_ext.integrations.flashmask import cpu_flashmask

    kw = {**SIZES, "vocab_size": 128}
    paddle.seed(3)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw, use_flash_attention=True))
    ref = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw, use_flash_attention=False))
    ref.set_state_dict(model.state_dict())
    model.train()
    ref.train()
    with cpu_flashmask():
        packed = packed_loss_and_grads(model, make_examples())
    assert any(".experts." in k for k in packed[1]) and any(".mlp.gate." in k for k in packed[1])
    assert_match(packed, separate_loss_and_grads(ref, make_examples()))
