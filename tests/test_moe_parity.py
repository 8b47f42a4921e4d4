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

from test_decoder_parity import _left_padded, build  # noqa: E402

MOE_ROWS = [k for k, f in FAMILIES.items() if f.arch is not None and f.arch.mlp == "moe"]
#: rows whose transformers 4.55 model computes no aux loss (no output_router_logits)
NO_HF_AUX = {"deepseek_v2", "deepseek_v3"}


def test_moe_rows_are_listed():
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "ernie4_5_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"} <= set(MOE_ROWS)


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
        want = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos),
                  labels=torch.tensor(labels), output_router_logits=True)
    for h in hooks:
        h.remove()
    if model_type in NO_HF_AUX:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        spec = ours.moe_blocks()[0].spec
        aux = load_balancing_loss_func(tuple(gate_logits), spec.num_experts, spec.top_k, torch.tensor(mask))
        want.aux_loss, want.router_logits, want.loss = aux, tuple(gate_logits), want.loss + coef * aux
    shifted = np.concatenate([labels[:, 1:], np.full((labels.shape[0], 1), -100)], axis=1)
    got = ours(input_ids=paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask),
               position_ids=paddle.to_tensor(pos), labels=paddle.to_tensor(shifted), output_router_logits=True)
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
    out = ours(input_ids=paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask),
               position_ids=paddle.to_tensor(pos), output_router_logits=False)
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
