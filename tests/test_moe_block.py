"""The MoE block (paddlenlp_ext/models/decoder/moe*.py) against transformers 4.55's own MoE modules.

For each MoE type, transformers' block is built from its config at random weights, the weights copied
into ours by name (the names must be transformers'), and outputs, router logits, the aux loss
(transformers' ``load_balancing_loss_func``) and gradients compared.

Micro-benchmark (grouped vs a per-expert dense loop, CPU):
    .venv/bin/python tests/test_moe_block.py bench
"""

import doctest
import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":  # the bench: the CPU math set-up of every entry script, before paddle loads
    from paddlenlp_ext.runtime.cpu_env import setup_cpu

    print(setup_cpu().text)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import paddle

from paddlenlp_ext.models.decoder import moe, moe_balance, moe_spec
from paddlenlp_ext.models.decoder.moe import MoEBlock
from paddlenlp_ext.models.decoder.moe_balance import (
    expert_load,
    load_balancing_loss,
    load_stats,
    update_correction_bias,
)
from paddlenlp_ext.models.decoder.moe_spec import MoEConfigError, is_moe_layer

H = 32
#: model_type -> (config class, transformers module path, block class, config kwargs)
CASES = {
    "mixtral": (
        "MixtralConfig",
        "mixtral",
        "MixtralSparseMoeBlock",
        dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "qwen2_moe",
        "Qwen2MoeSparseMoeBlock",
        dict(
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        dict(moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    ),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "ernie4_5_moe",
        "Ernie4_5_MoeSparseMoeBlock",
        dict(moe_intermediate_size=24, moe_num_experts=6, moe_k=2, moe_num_shared_experts=2, use_bias=True),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "deepseek_v2",
        "DeepseekV2MoE",
        dict(
            moe_intermediate_size=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=1,
            routed_scaling_factor=1.5,
            mlp_bias=True,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "deepseek_v3",
        "DeepseekV3MoE",
        dict(
            moe_intermediate_size=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "gpt_oss",
        "GptOssMLP",
        dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
    ),
}
TYPES = list(CASES)


def hf_module(model_type):
    import importlib

    return importlib.import_module(f"transformers.models.{CASES[model_type][1]}.modeling_{CASES[model_type][1]}")


def hf_config(model_type, **extra):
    cfg_name, _, _, kw = CASES[model_type]
    base = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return getattr(transformers, cfg_name)(**{**base, **kw, **extra})


def build_pair(model_type, seed=0, **extra):
    """(transformers block at random weights, our block with its weights copied by name)."""
    cfg = hf_config(model_type, **extra)
    torch.manual_seed(seed)
    ref = getattr(hf_module(model_type), CASES[model_type][2])(cfg).float()
    with torch.no_grad():
        for name, t in list(ref.named_parameters()) + list(ref.named_buffers()):
            # routers a bit sharper than the experts so tokens spread over the experts; gpt-oss' experts
            # large enough that its SwiGLU clamps (limit 7) are reached
            std = 0.2
            if name.startswith(("gate.", "router.")):
                std = 0.5
            elif model_type == "gpt_oss":
                std = 0.7 if name.startswith("experts.gate_up_proj") else 0.05
            t.copy_(torch.randn(t.shape) * std)
    ours = MoEBlock.from_config(cfg)
    theirs = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    mine = ours.state_dict()
    assert sorted(mine) == sorted(theirs), "parameter names differ from transformers'"
    for k, p in mine.items():
        v = theirs[k]
        if v.ndim == 2 and k.endswith(".weight"):  # nn.Linear: torch [out, in] -> paddle [in, out]
            v = v.T
        assert list(p.shape) == list(v.shape), k
        p.set_value(paddle.to_tensor(np.ascontiguousarray(v)))
    return ref, ours


def hf_forward(model_type, ref, x):
    """(output [B, L, H], router logits as transformers records them [B*L, E])."""
    if model_type.startswith("deepseek"):  # DeepseekV{2,3}MoE return the hidden states only; the logits: their gate's
        logits = torch.nn.functional.linear(x.reshape(-1, H).float(), ref.gate.weight.float())
        return ref(x), logits
    return ref(x)


def inputs(b=2, length=5, seed=1):
    return np.random.RandomState(seed).randn(b, length, H).astype("float32")


def hf_loss_func(model_type):
    # qwen2_moe's copy indexes by the device number (int(device.index)) and cannot run on CPU; deepseek_v2/v3
    # have none: they are judged by mixtral's (the one the others are "copied from")
    name = model_type if model_type not in ("qwen2_moe", "deepseek_v2", "deepseek_v3") else "mixtral"
    return hf_module(name).load_balancing_loss_func


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_forward_matches_transformers(model_type, training):
    ref, ours = build_pair(model_type)
    ref.train(training), ours.train(training)
    x = inputs()
    with torch.no_grad():
        want, want_logits = hf_forward(model_type, ref, torch.from_numpy(x))
    got, got_logits = ours(paddle.to_tensor(x))
    assert list(got.shape) == [2, 5, H] and list(got_logits.shape) == list(want_logits.shape)
    np.testing.assert_allclose(got_logits.numpy(), want_logits.numpy(), rtol=2e-6, atol=1e-6)  # fp32 rounding
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)
    used = set(ours.last_selected.numpy().reshape(-1).tolist())
    assert len(used) > 2, "the test input should spread over several experts"


def test_options_change_the_result_as_in_transformers():
    """Negative controls: norm_topk_prob, group-limited routing, gpt-oss' clamp and ernie's correction bias
    change the output (they are honoured, not ignored)."""
    for model_type, extra, other in (
        ("qwen2_moe", dict(norm_topk_prob=True), dict(norm_topk_prob=False)),
        ("qwen3_moe", dict(norm_topk_prob=False), dict(norm_topk_prob=True)),
        ("deepseek_v2", dict(topk_method="greedy"), {}),
        ("deepseek_v3", {}, dict(n_group=1, topk_group=1)),
    ):
        ref, ours = build_pair(model_type, **extra)
        x = inputs()
        with torch.no_grad():
            want = hf_forward(model_type, ref, torch.from_numpy(x))[0].numpy()
        got = ours(paddle.to_tensor(x))[0].numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        _, changed = build_pair(model_type, **other)
        assert np.abs(changed(paddle.to_tensor(x))[0].numpy() - want).max() > 1e-3
    _, ours = build_pair("gpt_oss")  # the SwiGLU clamp is reached by the test weights
    x = paddle.to_tensor(inputs())
    clamped = ours(x)[0].numpy()
    ours.experts.limit = 1e9
    assert np.abs(ours(x)[0].numpy() - clamped).max() > 1e-3
    for model_type in ("ernie4_5_moe", "deepseek_v3"):
        _, ours = build_pair(model_type)
        with_bias = ours(x)[0].numpy()
        ours.correction_bias.set_value(paddle.zeros_like(ours.correction_bias))
        assert np.abs(ours(x)[0].numpy() - with_bias).max() > 1e-3, model_type


def test_mixtral_jitter_only_in_training():
    """router_jitter_noise: multiplicative input noise in training (random, as in transformers), none in eval."""
    ref, ours = build_pair("mixtral", router_jitter_noise=0.1)
    x = inputs()
    with torch.no_grad():
        want = ref.eval()(torch.from_numpy(x))[0].numpy()
    np.testing.assert_allclose(ours.eval()(paddle.to_tensor(x))[0].numpy(), want, rtol=0, atol=1e-5)
    ours.train()
    a, b = (ours(paddle.to_tensor(x))[0].numpy() for _ in range(2))
    assert np.abs(a - want).max() > 1e-3 and np.abs(a - b).max() > 1e-3


def rel(a, b):
    a = np.zeros_like(b) if a is None else a
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


@pytest.mark.parametrize("model_type", TYPES)
def test_gradients_match_transformers(model_type):
    """d(sum(out * g) + 0.1 * aux) w.r.t. the input and every parameter, within 1e-4 relative."""
    ref, ours = build_pair(model_type)
    ref.train(), ours.train()
    spec = ours.spec
    x, g = inputs(), np.random.RandomState(2).randn(2, 5, H).astype("float32")
    tx = torch.from_numpy(x).requires_grad_(True)
    out, logits = hf_forward(model_type, ref, tx)
    aux = hf_loss_func(model_type)((logits,), spec.num_experts, spec.top_k)
    ((out * torch.from_numpy(g)).sum() + 0.1 * aux).backward()
    px = paddle.to_tensor(x, stop_gradient=False)
    pout, plogits = ours(px)
    ((pout * paddle.to_tensor(g)).sum() + 0.1 * load_balancing_loss([plogits], spec.num_experts, spec.top_k)).backward()
    assert rel(px.grad.numpy(), tx.grad.numpy()) < 1e-4
    theirs = dict(ref.named_parameters())
    checked = []
    for name, p in ours.named_parameters():
        t = theirs[name]
        if t.grad is None and p.grad is None:
            continue
        want = t.grad.numpy() if t.grad is not None else np.zeros(t.shape, "float32")
        got = None if p.grad is None else p.grad.numpy()
        if got is not None and got.ndim == 2 and name.endswith(".weight"):
            got = got.T
        assert rel(got, want) < 1e-4, name
        checked.append(name)
    router = f"{spec.router_name}.weight"
    assert router in checked and len(checked) >= min(7, len(theirs)), checked  # router + experts' weights


def masks():
    # padded: 3 rows of 6 with right padding; packed: 2 rows of 3 documents each, only a tail of padding
    padded = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]], "int64")
    docs = [[3, 2, 1], [2, 2, 0]]  # document lengths per row (6 tokens per row)
    packed = np.zeros((2, 6), "int64")
    for r, lens in enumerate(docs):
        packed[r, : sum(lens)] = 1
    return {"padded": padded, "packed": packed}


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("form", ["padded", "packed", "none"])
def test_aux_loss_equals_transformers(model_type, form):
    """Two MoE layers on the same batch, loss of ours from our blocks vs transformers' from theirs."""
    mask = masks().get(form, masks()["padded"] if form == "none" else None)
    b, length = mask.shape
    layers = [build_pair(model_type, seed=s) for s in (0, 1)]
    x = inputs(b, length, seed=3)
    want_logits, got_logits = [], []
    for ref, ours in layers:
        with torch.no_grad():
            want_logits.append(hf_forward(model_type, ref, torch.from_numpy(x))[1])
        got_logits.append(ours(paddle.to_tensor(x))[1])
    spec = layers[0][1].spec
    tmask = None if form == "none" else torch.from_numpy(mask)
    want = float(hf_loss_func(model_type)(tuple(want_logits), spec.num_experts, spec.top_k, tmask))
    got = float(
        load_balancing_loss(
            got_logits, spec.num_experts, spec.top_k, None if form == "none" else paddle.to_tensor(mask)
        )
    )
    assert abs(got - want) < 1e-6, (got, want)
    if form != "none":  # the mask matters: counting the padding gives another value
        unmasked = float(load_balancing_loss(got_logits, spec.num_experts, spec.top_k))
        assert abs(unmasked - got) > 1e-4


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "ernie4_5_moe", "gpt_oss"])
def test_aux_loss_equals_the_causal_lm_aux_loss(model_type):
    """transformers' whole model with output_router_logits=True on a padded batch: its aux_loss, from the
    router_logits it records (gpt-oss: the router's scores), equals ours on the same tensors."""
    cfg = hf_config(model_type, vocab_size=64, output_router_logits=True, head_dim=8)
    cfg._attn_implementation = "eager"
    mod = hf_module(model_type)
    lm_cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("ForCausalLM"))
    torch.manual_seed(0)
    model = lm_cls(cfg).float().eval()
    mask = masks()["padded"]
    ids = torch.from_numpy(np.random.RandomState(4).randint(1, 64, mask.shape))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.from_numpy(mask), labels=ids)
    spec = moe_spec.moe_spec(cfg)
    got = load_balancing_loss(
        [paddle.to_tensor(z.numpy()) for z in out.router_logits], spec.num_experts, spec.top_k, mask
    )
    assert len(out.router_logits) == sum(is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers)) >= 1
    assert abs(float(got) - float(out.aux_loss)) < 1e-6, (float(got), float(out.aux_loss))


def test_aux_loss_input_checks():
    z = paddle.zeros([6, 4])
    assert float(load_balancing_loss([], 4, 2)) == 0.0
    with pytest.raises(ValueError, match="covers 4 tokens"):
        load_balancing_loss([z], 4, 2, attention_mask=np.ones((2, 2)))
    with pytest.raises(ValueError, match="batch, seq"):
        load_balancing_loss([z], 4, 2, attention_mask=np.ones((1, 1, 6)))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_expert_without_tokens_is_never_called(model_type):
    ref, ours = build_pair(model_type)
    calls = []
    run = ours.run_expert
    ours.run_expert = lambda e, xs: (calls.append((e, xs.shape[0])), run(e, xs))[1]
    hooks = []
    if not ours.spec.fused_experts:  # the experts' own Linears are not run either
        for e, expert in enumerate(ours.experts):
            hooks.append(expert.gate_proj.register_forward_pre_hook(lambda layer, a, e=e: calls.append(("linear", e))))
    x = inputs(1, 1)  # one token, top-2 of 4 or 8 experts: the others get nothing
    got = ours(paddle.to_tensor(x))[0].numpy()
    with torch.no_grad():
        want = hf_forward(model_type, ref, torch.from_numpy(x))[0].numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    chosen = sorted(ours.last_selected.numpy().reshape(-1).tolist())
    assert sorted(e for e, n in calls if e != "linear") == chosen and all(n == 1 for e, n in calls if e != "linear")
    if hooks:
        assert sorted(e for tag, e in calls if tag == "linear") == chosen
    assert len(chosen) == 2 < ours.spec.num_experts


def skewed_deepseek():
    """A deepseek_v3 block whose router sends almost every token to experts 0 and 1 (8 experts, 4 groups)."""
    _, blk = build_pair("deepseek_v3")
    w = blk.gate.weight.numpy()  # [H, E]
    w[:, :2] += 0.08  # inputs with a positive mean favour experts 0 and 1
    blk.gate.weight.set_value(paddle.to_tensor(w))
    x = paddle.to_tensor(inputs(4, 16, seed=5) * 0.5 + 1.0)
    return blk, x


def test_bias_update_moves_toward_balance():
    blk, x = skewed_deepseek()
    gate_before = blk.gate.weight.numpy().copy()
    with paddle.no_grad():
        blk(x)
    first = load_stats(expert_load(blk.last_selected, 8))
    assert first["max_over_mean"] > 3.0 and first["fraction"][2] == 0.0, first  # skewed to start with
    history = [first["max_over_mean"]]
    for _ in range(100):  # one "optimizer step" each: the bias moves by the sign of the load error
        counts = expert_load(blk.last_selected, 8)
        update_correction_bias(blk, counts, rate=0.01)
        with paddle.no_grad():
            blk(x)
        history.append(load_stats(expert_load(blk.last_selected, 8))["max_over_mean"])
    assert np.mean(history[-20:]) < 0.6 * history[0], history
    np.testing.assert_array_equal(blk.gate.weight.numpy(), gate_before)  # the gate weights never move
    assert blk.correction_bias.stop_gradient  # a buffer: no gradient, no optimizer
    assert all(p.name != blk.correction_bias.name for p in blk.parameters())
    # layers without a correction bias: nothing to update
    _, mixtral = build_pair("mixtral")
    assert update_correction_bias(mixtral, paddle.ones([4]), 0.1) is None


def test_expert_load_counts_only_real_tokens():
    blk, x = skewed_deepseek()
    with paddle.no_grad():
        blk(x[:1, :4])
    sel = blk.last_selected.numpy()
    mask = np.array([[1, 1, 0, 0]])
    want = np.bincount(sel[:2].reshape(-1), minlength=8).astype("float32")
    np.testing.assert_array_equal(expert_load(blk.last_selected, 8, mask).numpy(), want)


def test_router_parameters_and_names():
    _, blk = build_pair("gpt_oss")
    assert [p.name for p in blk.router_parameters()] == [blk.router.weight.name, blk.router.bias.name]
    names = dict(blk.named_parameters())
    assert list(names["experts.gate_up_proj"].shape) == [4, H, 48]  # fused, as in transformers
    _, blk = build_pair("mixtral")
    blk(paddle.to_tensor(inputs()))
    assert [n for n, _ in blk.named_buffers()] == [] and list(blk.last_selected.shape) == [10, 2]
    linears = [n for n, layer in blk.named_sublayers() if isinstance(layer, paddle.nn.Linear)]
    assert {f"experts.{j}.{p}" for j in range(4) for p in ("w1", "w2", "w3")} <= set(linears)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "ernie4_5_moe", "deepseek_v2", "deepseek_v3"])
def test_is_moe_layer_matches_transformers_decoder(model_type):
    extra = {
        "qwen2_moe": dict(decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=6),
        "ernie4_5_moe": dict(moe_layer_start_index=1, moe_layer_interval=2, num_hidden_layers=6),
        "deepseek_v2": dict(
            first_k_dense_replace=1,
            num_hidden_layers=3,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
        "deepseek_v3": dict(
            first_k_dense_replace=2,
            num_hidden_layers=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    }[model_type]
    cfg = hf_config(model_type, **{**extra, "intermediate_size": 40})
    cfg._attn_implementation = "eager"
    mod = hf_module(model_type)
    layer_cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("DecoderLayer"))
    sparse_cls = getattr(mod, CASES[model_type][2])
    want = [isinstance(layer_cls(cfg, i).mlp, sparse_cls) for i in range(cfg.num_hidden_layers)]
    assert [is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers)] == want
    assert True in want and False in want


def test_config_errors_name_the_key():
    with pytest.raises(MoEConfigError, match="'num_local_experts' is missing"):
        moe_spec.moe_spec({"model_type": "mixtral", "hidden_size": 8, "intermediate_size": 8})
    with pytest.raises(MoEConfigError, match="covers"):
        moe_spec.moe_spec({"model_type": "llama", "hidden_size": 8})
    with pytest.raises(MoEConfigError, match="topk_group"):
        moe_spec.moe_spec(
            {
                "model_type": "deepseek_v3",
                "hidden_size": 8,
                "moe_intermediate_size": 8,
                "n_routed_experts": 8,
                "num_experts_per_tok": 4,
                "n_group": 4,
                "topk_group": 1,
            }
        )
    with pytest.raises(MoEConfigError, match="hidden_act"):
        MoEBlock.from_config(
            {
                "model_type": "mixtral",
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_local_experts": 4,
                "hidden_act": "no_such_act",
            }
        )


def test_run_keys_aux_coef_and_bias_rate():
    """The keys docs/moe.md promises: the alias, the checkpoint default, refusals naming the key."""
    ckpt = {"router_aux_loss_coef": 0.9, "output_router_logits": True}
    assert moe_spec.router_aux_loss_coef({}, ckpt) == 0.9
    assert moe_spec.router_aux_loss_coef({"router_aux_loss_coef": 0.01}, ckpt) == 0.01
    assert moe_spec.router_aux_loss_coef({"moe_aux_loss_coef": 0.02, "router_aux_loss_coef": 0.02}, ckpt) == 0.02
    with pytest.raises(MoEConfigError, match="disagree; set only router_aux_loss_coef"):
        moe_spec.router_aux_loss_coef({"moe_aux_loss_coef": 0.02, "router_aux_loss_coef": 0.01}, ckpt)
    with pytest.raises(MoEConfigError, match="moe_aux_loss_coef='x' must be a number"):
        moe_spec.router_aux_loss_coef({"moe_aux_loss_coef": "x"}, ckpt)
    assert moe_spec.moe_key_problems({"moe_router_bias_update_rate": 1e-3}, "ernie4_5_moe") == []
    assert (
        "remove moe_router_bias_update_rate"
        in moe_spec.moe_key_problems({"moe_router_bias_update_rate": 1e-3}, "qwen3_moe")[0]
    )
    assert "must be a number >= 0" in moe_spec.moe_key_problems({"moe_router_bias_update_rate": -1}, "deepseek_v3")[0]
    assert moe_spec.moe_key_problems({"freeze_router": True}, "llama")[0].startswith("freeze_router: model_type")


@pytest.mark.parametrize("module", [moe, moe_balance, moe_spec], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_worked_examples(module):
    res = doctest.testmod(module, verbose=False)
    assert res.attempted >= 2 and res.failed == 0


# ---------------------------------------------------------------- micro-benchmark (not a test)


def _dense_loop(blk, x):
    """The naive form: every expert on every token, weighted by its (mostly zero) routing weight."""
    logits = blk.gate_layer(x)
    weights, selected, _ = moe.route(logits, blk.spec)
    dense_w = (paddle.nn.functional.one_hot(selected, blk.spec.num_experts) * weights.unsqueeze(-1)).sum(1)  # [T, E]
    out = paddle.zeros_like(x)
    for e in range(blk.spec.num_experts):
        out = out + blk.experts[e](x) * dense_w[:, e : e + 1]
    return out


def bench(hidden=512, experts=8, top_k=2, tokens=2048, inter=1024, repeat=5):
    """Median times of the grouped block vs the dense loop (paddle), and transformers' qwen3_moe block
    (torch, its per-expert masked loop) for reference, on the same weights."""
    if os.environ.get("OMP_NUM_THREADS"):  # the same thread count on both sides
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    spec = moe_spec.MoESpec("qwen3_moe", hidden, experts, top_k, inter, norm_topk_prob=True)
    blk = MoEBlock(spec)
    x = paddle.randn([tokens, hidden])
    grouped = lambda: blk._grouped(x, *moe.route(blk.gate_layer(x), spec)[:2])
    np.testing.assert_allclose(grouped().numpy(), _dense_loop(blk, x).numpy(), atol=1e-4)
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
    ref = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for k, p in blk.state_dict().items():
            v = p.numpy()
            dict(ref.named_parameters())[k].copy_(torch.from_numpy(np.ascontiguousarray(v.T if v.ndim == 2 else v)))
    tx = torch.from_numpy(x.numpy()).reshape(1, tokens, hidden)
    np.testing.assert_allclose(ref(tx)[0].detach().numpy().reshape(tokens, hidden), grouped().numpy(), atol=1e-4)
    cases = (
        ("grouped (ours, paddle)", grouped, blk, paddle.no_grad),
        ("dense per-expert loop", lambda: _dense_loop(blk, x), blk, paddle.no_grad),
        ("transformers (torch)", lambda: ref(tx)[0], ref, torch.no_grad),
    )
    rows = []
    for name, fn, layer, no_grad in cases:
        for mode in ("forward", "forward+backward"):
            times = []
            for _ in range(repeat + 1):
                t0 = time.perf_counter()
                if mode == "forward":
                    with no_grad():
                        fn()
                else:
                    fn().sum().backward()
                times.append(time.perf_counter() - t0)
            rows.append((name, mode, sorted(times[1:])[len(times[1:]) // 2]))
    print(
        f"hidden {hidden}, {experts} experts, top-{top_k}, {tokens} tokens, expert intermediate {inter}; "
        f"paddle threads {os.environ.get('OMP_NUM_THREADS', 'default')}, torch threads {torch.get_num_threads()}, "
        f"MKL_DEBUG_CPU_TYPE={os.environ.get('MKL_DEBUG_CPU_TYPE', 'unset')}"
    )
    for name, mode, t in rows:
        print(f"  {name:24s} {mode:17s} {t * 1000:8.1f} ms (median of {repeat})")
    return rows


if __name__ == "__main__" and sys.argv[1:] == ["bench"]:
    bench()
