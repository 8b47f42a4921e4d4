"""The memory planner on the decoder's MoE rows (paddlenlp_ext/planner/moe_shape.py; docs/moe.md, docs/parallel.md).

* For every MoE row of the family table, at tiny random weights built by transformers (the models of
  tests/test_decoder_parity.py, loaded by our streaming loader): the planner's total parameter count equals the
  loaded model's exactly, its router buffers equal the model's ``e_score_correction_bias`` buffers, and its
  per-token active count equals a count from the model's own tensors (total - the (E - k) routed experts a
  token skips per MoE layer), besides the hand count of the worked example (mixtral).
* Expert parallelism: EP ranks hold E / EP of the routed experts (weights, adapters, their optimizer states); bad
  degrees are PlanErrors naming the key.
* The estimate against a measured run: bench/moe.py's 0.53B Mixtral, LoRA, at its longest row.
"""

import json

import pytest

from paddlenlp_ext.models.family_table import FAMILIES
from paddlenlp_ext.planner import Layout, PlanError, PlanInputs, account, estimate, read_model_shape
from paddlenlp_ext.planner.memory import GiB
from paddlenlp_ext.planner.params import AdapterSpec

MOE_ROWS = [k for k, f in FAMILIES.items() if f.arch is not None and f.arch.mlp == "moe"]


def test_every_moe_row_is_planned():
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "ernie4_5_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"} <= set(
        MOE_ROWS
    )


@pytest.fixture(params=MOE_ROWS)
def built(request, tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_decoder_parity import build

    _, path, ours = build(request.param, tmp_path_factory)
    return request.param, path, ours


def _routed_expert_params(ours) -> int:
    """The routed experts' parameters of the loaded model, read from its own tensor names."""
    return sum(int(p.numel()) for n, p in ours.named_parameters() if ".experts." in n or n.endswith(".experts"))


def test_total_and_active_parameters_equal_the_loaded_model(built):
    model_type, path, ours = built
    shape = read_model_shape(path)
    assert shape.model_type == model_type and shape.moe is not None
    assert shape.total_params == sum(int(p.numel()) for p in ours.parameters())
    buffers = sum(int(b.numel()) for n, b in ours.named_buffers() if n.endswith("e_score_correction_bias"))
    assert shape.moe.router_buffer_elements == buffers
    blocks = ours.moe_blocks()
    assert shape.moe.moe_layers == len(blocks)
    spec = blocks[0].spec
    assert (shape.moe.num_experts, shape.moe.top_k) == (spec.num_experts, spec.top_k)
    routed = _routed_expert_params(ours)
    assert shape.expert_params == routed
    # a token computes with top_k of the E routed experts of each MoE layer, and everything else
    assert shape.active_params * spec.num_experts == (
        shape.total_params * spec.num_experts - routed * (spec.num_experts - spec.top_k)
    )
    # every parameter of the model is in the account once (full fine-tuning trains them all)
    assert account(shape, "full").total_params == shape.total_params == account(shape, "full").trainable_params


def test_mixtral_by_hand(tmp_path):
    """The worked example of moe_shape.py: hidden 64, 4 heads / 2 kv heads, 2 layers, 4 experts top-2 of 96."""
    cfg = {
        "model_type": "mixtral",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = read_model_shape(str(tmp_path))
    expert = 3 * 64 * 96
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 64 * 4 + 4 * expert + 2 * 64
    assert layer == 86_400
    assert s.total_params == 2 * layer + 2 * 128 * 64 + 64 == 189_248
    assert s.active_params == 189_248 - 2 * 2 * expert == 115_520
    # LoRA r8 on the row's default targets: q/k/v/o and every expert's w1/w2/w3, never the router
    acc = account(s, "lora", adapter=AdapterSpec("lora", r=8, model_type="mixtral"))
    attn = 2 * 8 * (64 + 64) + 2 * 8 * (64 + 32)
    experts = 4 * (2 * 8 * (64 + 96) + 8 * (96 + 64))
    assert acc.trainable_params == 2 * (attn + experts)
    assert acc.adapted_linears == 2 * (4 + 4 * 3)


def _bench_moe(tmp_path, layers=12):
    """bench/moe.py's MoE: Mixtral 8 experts top-2, hidden 1024, 16 heads, expert intermediate 1408, vocab 32000."""
    cfg = {
        "model_type": "mixtral",
        "hidden_size": 1024,
        "intermediate_size": 1408,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return read_model_shape(str(tmp_path))


def test_expert_parallel_splits_the_routed_experts_only(tmp_path):
    s = _bench_moe(tmp_path)
    assert (s.total_params, s.active_params) == (531_227_648, 219_800_576)  # bench/moe.py's transformers count
    acc = account(s, "full")
    inp = PlanInputs(s, acc, target="gpu", seq=256)
    one = estimate(inp, Layout(dp=4))
    four = estimate(inp, Layout(dp=4, ep=4))
    # weights: the routed experts / 4, the rest whole (fp32)
    assert one.breakdown["weights"] - four.breakdown["weights"] == round(4 * s.expert_params * (1 - 1 / 4))
    # full fine-tuning: the experts' gradients and AdamW states (8 B) follow them
    assert one.breakdown["optimizer_states"] - four.breakdown["optimizer_states"] == round(
        8 * s.expert_params * (1 - 1 / 4)
    )
    assert four.facts["experts_per_rank"] == 2 and four.facts["active_params"] == s.active_params
    # with sharding, an EP rank's experts are sharded over sd / EP ranks: sharding stage 1 x4 already divides the
    # experts' AdamW states by 4, EP 4 on top of it leaves them as they are (PaddleNLP's moe-sharding group)
    sharded = estimate(inp, Layout(sharding_stage=1, sharding_degree=4))
    sharded_ep = estimate(inp, Layout(sharding_stage=1, sharding_degree=4, ep=4))
    assert sharded.breakdown["optimizer_states"] == sharded_ep.breakdown["optimizer_states"]
    assert (
        sharded.breakdown["weights"] - sharded_ep.breakdown["weights"]
        == one.breakdown["weights"] - four.breakdown["weights"]
    )
    assert "EP 4" in four.layout.describe() and four.layout.config_keys()["expert_parallel_degree"] == 4
    for layout, message in (
        (Layout(dp=3, ep=3), "must divide the 8 experts"),
        (Layout(dp=2, ep=4), "data-parallel x sharding ranks"),
        (Layout(sharding_stage=1, sharding_degree=2, dp=2, ep=4), "must divide sharding_parallel_degree"),
    ):
        with pytest.raises(PlanError, match=message):
            estimate(inp, layout)


def test_expert_parallel_degree_is_read_from_the_run_keys():
    from paddlenlp_ext.planner import layout_from_config

    assert layout_from_config({"expert_parallel_degree": 4}, world_size=1) == Layout(dp=4, ep=4)
    assert layout_from_config({"expert_parallel_degree": 2}, world_size=8).ep == 2
    with pytest.raises(PlanError, match="expert_parallel_degree"):
        layout_from_config({"expert_parallel_degree": "two"})


def test_expert_parallel_on_a_dense_model_is_a_plan_error():
    s = read_model_shape("Llama-2-7b")
    with pytest.raises(PlanError, match="has no experts"):
        estimate(PlanInputs(s, account(s, "full")), Layout(dp=2, ep=2))


#: bench/moe.py's ours runs, measured (docs/benchmarks.md, MoE section, 2026-11-28 10:00-10:50 UTC): peak RSS of the
#: LoRA fine-tune of the 0.53B (12 layers) and 0.84B (20 layers) Mixtral, batch 1, fp32, AdamW, whose longest row
#: was 466 tokens (the peak is that micro-step's)
LONGEST_ROW = 466


@pytest.mark.parametrize("layers, measured_gib", [(12, 3.32), (20, 4.98)])
def test_the_estimate_is_within_15_percent_of_the_measured_bench_run(tmp_path, layers, measured_gib):
    s = _bench_moe(tmp_path, layers)
    acc = account(s, "lora", adapter=AdapterSpec("lora", r=8, model_type="mixtral"))
    est = estimate(PlanInputs(s, acc, target="cpu", seq=LONGEST_ROW, grad_accum=4))
    assert abs(est.per_device_bytes / GiB / measured_gib - 1) <= 0.15, est.per_device_bytes / GiB
    # the weights are the whole model in fp32 (every expert is held, whichever a token uses) + the adapters
    assert est.breakdown["weights"] == 4 * (s.total_params + acc.trainable_params)


def test_the_cli_plans_an_moe_config(tmp_path, capsys):
    from paddlenlp_ext.cli.plan_memory import main

    _bench_moe(tmp_path)
    argv = ["llm/config/tiny/lora_argument.json", "--model_name_or_path", str(tmp_path), "--json"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert '"active_params": 219800576' in text and "mixture of experts" in text
    # a config written for PaddleFormers' expert parallelism (refused by this build's training CLI) is planned
    assert main(argv + ["--expert_parallel_degree", "4", "--sharding", "stage1"]) == 0
    text = capsys.readouterr().out
    assert '"experts_per_rank": 2' in text and '"ep": 4' in text and "verified by simulation only" in text
