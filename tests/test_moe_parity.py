"""The decoder's MoE rows against transformers 4.55: the load-balancing loss of a whole model.

Rows: every family-table row whose ``Arch.mlp`` is ``"moe"`` (a new MoE row is picked up without edits).
The models are the ones ``tests/test_decoder_parity.py`` builds (transformers at random weights,
``save_pretrained``, our streaming loader); that file also judges their logits, greedy tokens, packed
rows and LoRA gradients.  Here, on a left-padded batch with ``output_router_logits=True``:

* our ``aux_loss`` equals transformers' ``aux_loss`` within 1e-6 (padding excluded on both sides);
* with labels, our loss = cross entropy + ``router_aux_loss_coef`` * aux, as transformers' loss;
* deepseek_v2/v3, whose transformers models compute no aux loss: transformers' ``load_balancing_loss_func`` on
  the logits of transformers' own routers (read by a forward hook), and its cross entropy + coef * that;
* negative control: without the padding mask the aux loss differs (the mask matters).
"""

import numpy as np
import paddle
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paddlenlp_ext.models.family_table import FAMILIES  # noqa: E402

from test_decoder_parity import _left_padded, assert_padded_logits_match, build  # noqa: E402

MOE_ROWS = [k for k, f in FAMILIES.items() if f.arch is not None and f.arch.mlp == "moe"]
#: rows whose transformers 4.55 model computes no aux loss (no output_router_logits)
NO_HF_AUX = {"deepseek_v2", "deepseek_v3"}


def test_moe_rows_are_listed():
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "ernie4_5_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"} <= set(
        MOE_ROWS
    )


@pytest.fixture(params=MOE_ROWS)
def moe_row(request, tmp_path_factory):
    return (request.param,) + build(request.param, tmp_path_factory)


def test_aux_loss_and_loss_match_transformers_on_a_padded_batch(moe_row, monkeypatch):
    model_type, hf, _, ours = moe_row
    if model_type == "qwen2_moe":
        # transformers 4.55's qwen2_moe copy of load_balancing_loss_func crashes on CPU
        # (int(device.index) with index None); mixtral's is the same function minus that line
        from transformers.models.mixtral import modeling_mixtral
        from transformers.models.qwen2_moe import modeling_qwen2_moe

        monkeypatch.setattr(modeling_qwen2_moe, "load_balancing_loss_func", modeling_mixtral.load_balancing_loss_func)
    _, (ids, mask, pos) = _left_padded([12, 5, 9], seed=3)
    labels = np.where(mask.astype(bool), ids, -100)
    coef = 0.37
    hf.config.router_aux_loss_coef = hf.router_aux_loss_coef = coef
    ours.config.router_aux_loss_coef = coef
    hooks, gate_logits = [], []
    if model_type in NO_HF_AUX:
        # DeepseekV2/V3ForCausalLM compute no aux loss: the judge is transformers' load_balancing_loss_func
        # (mixtral's, the one the other types copy) on the logits their own routers compute, read by a hook
        def keep(gate, inputs, _):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            gate_logits.append(torch.nn.functional.linear(x.float(), gate.weight.float()))

        hooks = [m.gate.register_forward_hook(keep) for m in hf.modules() if type(m).__name__.endswith("MoE")]
    with torch.no_grad():
        # transformers shifts labels itself; ours take them already shifted (the toolkit's data)
        want = hf(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(pos),
            labels=torch.tensor(labels),
            output_router_logits=True,
        )
    for h in hooks:
        h.remove()
    if model_type in NO_HF_AUX:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        spec = ours.moe_blocks()[0].spec
        aux = load_balancing_loss_func(tuple(gate_logits), spec.num_experts, spec.top_k, torch.tensor(mask))
        want.aux_loss, want.router_logits, want.loss = aux, tuple(gate_logits), want.loss + coef * aux
    shifted = np.concatenate([labels[:, 1:], np.full((labels.shape[0], 1), -100)], axis=1)
    got = ours(
        input_ids=paddle.to_tensor(ids),
        attention_mask=paddle.to_tensor(mask),
        position_ids=paddle.to_tensor(pos),
        labels=paddle.to_tensor(shifted),
        output_router_logits=True,
    )
    n_moe = len(ours.moe_blocks())
    assert len(got.router_logits) == n_moe == len(want.router_logits) > 0, model_type
    aux_want, aux_got = float(want.aux_loss), float(got.aux_loss)
    assert abs(aux_got - aux_want) < 1e-6, (model_type, aux_got, aux_want)
    assert abs(float(got.loss) - float(want.loss)) < 1e-4, (model_type, float(got.loss), float(want.loss))
    # negative control: the same logits without the padding mask count the pad tokens -> another value
    from paddlenlp_ext.models.decoder.moe_balance import load_balancing_loss

    spec = ours.moe_blocks()[0].spec
    unmasked = float(load_balancing_loss(list(got.router_logits), spec.num_experts, spec.top_k))
    assert abs(unmasked - aux_want) > 1e-5, model_type


def test_no_router_logits_no_aux_loss(moe_row):
    model_type, _, _, ours = moe_row
    _, (ids, mask, pos) = _left_padded([6, 4], seed=4)
    out = ours(
        input_ids=paddle.to_tensor(ids),
        attention_mask=paddle.to_tensor(mask),
        position_ids=paddle.to_tensor(pos),
        output_router_logits=False,
    )
    assert out.aux_loss is None and out.router_logits is None, model_type


def test_targets_take_every_expert_but_never_the_router(moe_row):
    """The row's default adapter / quantization targets: attention and every expert Linear, not the router."""
    import re

    from paddlenlp_ext.models.decoder.moe import MoEBlock

    model_type, _, _, ours = moe_row
    pats = FAMILIES[model_type].targets
    linears = [n for n, m in ours.named_sublayers() if isinstance(m, paddle.nn.Linear)]
    hit = {n for n in linears if any(re.fullmatch(p, n) for p in pats)}
    routers = {n for n, m in ours.named_sublayers() if isinstance(m, MoEBlock) for n in (n + "." + m.spec.router_name,)}
    gates = {n for n in linears if n.endswith("shared_expert_gate")}
    assert routers and not (routers | gates) & hit, model_type
    assert hit == set(linears) - routers - gates, (model_type, sorted(set(linears) - hit))


#: PaddleNLP 3.0.0b4's own MoE classes (their forward crashes on Paddle 3.3, their save_pretrained works); the
#: DeepSeeks with the routing keys transformers' classes compute: V2 greedy softmax, V3 sigmoid + noaux_tc
_MLA = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
PADDLENLP_MOE = {
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(_MLA, topk_method="greedy")),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _MLA,
            n_group=2,
            topk_group=1,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            shared_expert_intermediate_size=48,
        ),
    ),
}


def save_paddlenlp_moe(model_type, out_dir, vocab_size=128, std=0.15):
    """Save a tiny random model of PaddleNLP's own class of ``model_type`` to ``out_dir``; its state as numpy."""
    import paddlenlp.transformers as T

    conf_name, lm_name, extra = PADDLENLP_MOE[model_type]
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg = getattr(T, conf_name)(**{**kw, **extra})
    pd = getattr(T, lm_name)(cfg)
    rng = np.random.default_rng(0)
    for name, p in list(pd.named_parameters()) + list(pd.named_buffers()):
        val = 1 + 0.3 * rng.standard_normal(p.shape) if "norm" in name else std * rng.standard_normal(p.shape)
        p.set_value(paddle.to_tensor(val.astype("float32")))
    pd.save_pretrained(out_dir)
    return {k: v.numpy() for k, v in pd.state_dict().items()}


@pytest.mark.parametrize("model_type", sorted(PADDLENLP_MOE))
def test_paddlenlp_built_checkpoint_loads_and_computes_as_transformers(model_type, tmp_path):
    """A checkpoint saved by PaddleNLP's own MoE class (PaddleNLP layout and config.json) loads into the decoder
    row tensor for tensor, and its logits equal transformers' on the same weights and config."""
    import json

    from paddlenlp_ext.models.hf_layout import hf_name

    want_state = save_paddlenlp_moe(model_type, str(tmp_path))

    from paddlenlp_ext.models.decoder import classes_for
    from paddlenlp_ext.models.loading import load_model_streaming

    config_cls, _, lm_cls = classes_for(model_type)
    ours, stats = load_model_streaming(
        str(tmp_path), config_cls.from_pretrained(str(tmp_path)), "float32", model_class=lm_cls
    )
    ours.eval()
    assert stats["layout"] == "paddlenlp"
    got_state = ours.state_dict()
    assert set(got_state) == set(want_state)
    assert all(np.array_equal(got_state[k].numpy(), v) for k, v in want_state.items())
    # the judge: transformers' class on the same config.json and the same weights (names / transposes of hf_layout)
    with open(tmp_path / "config.json", encoding="utf-8") as f:
        raw = json.load(f)
    keep = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "dtype", "paddlenlp_version")}
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **keep), attn_implementation="eager"
    ).eval()
    state = {}
    for k, v in want_state.items():
        name, transposed = hf_name(k, model_type)
        state[name] = torch.tensor(v.T.copy() if transposed else v)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    assert_padded_logits_match(hf, ours, model_type)
