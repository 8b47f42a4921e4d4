"""Expert parallelism of the decoder's MoE rows (paddlenlp_ext/models/decoder/expert_parallel.py): N simulated ranks equal one process.

Each EP rank is a data-parallel rank with its own rows of the batch and only E/N experts (the single-process
model's own expert objects, renumbered); tokens travel to their expert's rank by a simulated all-to-all and come
back.  The reference is one process on the whole batch.  The objective of N data-parallel ranks is the mean of
their losses, so the ranks backward ``loss_r / N`` in one graph: a replicated parameter's gradient is the sum over
the ranks (what the data-parallel all-reduce adds), an expert's is its owner's alone.  Every row of a rank has
the same number of label tokens, so the mean of the rank losses is the single process's loss.

* EP = 2 and 4 on mixtral (8 experts top-2), EP = 2 on qwen2_moe (a shared expert with a gate and a dense
  layer) and deepseek_v3 (group-limited sigmoid routing with a correction bias, a dense first layer): the loss
  within 1e-5 and every gradient (experts, router, attention, embeddings) within 1e-5 of max(1, |grad|);
* negative control: a rank that runs the received rows in source order instead of expert order (the
  permutation skipped) fails the same comparison;
* the expert ids each rank holds, the source -> expert permutation (worked examples in the docstrings).
"""

import numpy as np
import paddle
import pytest

transformers = pytest.importorskip("transformers")

from paddlenlp_ext.models.decoder import expert_parallel as ep_mod  # noqa: E402
from paddlenlp_ext.models.decoder.expert_parallel import SimulatedExpertComm, apply_expert_parallel  # noqa: E402
from paddlenlp_ext.parallel.simulate import SimulatedGroup  # noqa: E402

TOL = 1e-5
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
ROWS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    "deepseek_v3": dict(
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        num_key_value_heads=4,
    ),
}


def build(model_type):
    from paddlenlp_ext.models.decoder import classes_for

    config_cls, _, lm_cls = classes_for(model_type)
    kw = transformers.AutoConfig.for_model(model_type, **{**BASE, **ROWS[model_type]}).to_dict()
    paddle.seed(11)
    model = lm_cls(config_cls(**kw))
    for name, buf in model.named_buffers():  # a non-zero correction bias, so that it takes part in the choice
        if name.endswith("e_score_correction_bias"):
            buf.set_value(paddle.uniform(buf.shape, "float32", -0.1, 0.1))
    return model


def batch(rows, seq=8, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 128, (rows, seq))
    labels = rng.integers(3, 128, (rows, seq))
    labels[:, :2] = -100  # the same number of label tokens on every row
    return ids, labels


def run(model_type, degree):
    """(single loss, single grads by name, rank losses, rank grads [{global name: grad}], E)."""
    ids, labels = batch(2 * degree)
    ref = build(model_type)
    loss = ref(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)).loss
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in ref.named_parameters() if p.grad is not None}
    sim = SimulatedGroup(degree)
    ranks = [build(model_type) for _ in range(degree)]  # the same seed: the single process's weights
    for r, m in enumerate(ranks):
        assert apply_expert_parallel(m, SimulatedExpertComm(sim, r))
    rows = len(ids) // degree

    def step(r):
        sl = slice(r * rows, (r + 1) * rows)
        return ranks[r](input_ids=paddle.to_tensor(ids[sl]), labels=paddle.to_tensor(labels[sl])).loss

    losses = sim.run(step)
    paddle.autograd.backward([lr / degree for lr in losses])
    return loss, grads, losses, [global_grads(m, r, degree) for r, m in enumerate(ranks)]


def global_grads(model, rank, degree):
    """The rank's gradients by the single process's names (``experts.J`` local -> global id)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts") + 1
            block = model
            for part in parts[: i - 1]:
                block = getattr(block, part) if not part.isdigit() else block[int(part)]
            parts[i] = str(block.expert_parallel.local.start + int(parts[i]))
        out[".".join(parts)] = p.grad.numpy()
    return out


def compare(loss, grads, losses, rank_grads):
    """The largest loss and gradient differences (EP vs one process) and the gradient names covered."""
    loss_err = abs(float(np.mean([float(lr) for lr in losses])) - float(loss))
    summed = {}
    for g in rank_grads:
        for n, v in g.items():
            summed[n] = summed.get(n, 0) + v
    assert set(summed) == set(grads), set(summed) ^ set(grads)
    grad_err = max(float(np.abs(summed[n] - grads[n]).max()) / max(1.0, float(np.abs(grads[n]).max())) for n in grads)
    return loss_err, grad_err, set(grads)


@pytest.mark.parametrize("model_type,degree", [("mixtral", 2), ("mixtral", 4), ("qwen2_moe", 2), ("deepseek_v3", 2)])
def test_expert_parallel_equals_one_process_in_loss_and_every_gradient(model_type, degree):
    loss, grads, losses, rank_grads = run(model_type, degree)
    loss_err, grad_err, names = compare(loss, grads, losses, rank_grads)
    assert loss_err <= TOL, loss_err
    assert grad_err <= TOL, grad_err
    for part in ("experts.", "gate.weight", "self_attn.", "embed_tokens"):  # every kind of parameter is judged
        assert any(part in n for n in names), part
    # each rank holds E/N experts and computed gradients only for them
    per = 8 // degree
    for r, g in enumerate(rank_grads):
        ids = {int(n.split("experts.")[1].split(".")[0]) for n in g if "experts." in n and "shared" not in n}
        assert ids <= set(range(r * per, (r + 1) * per)) and ids, (r, ids)


def test_negative_control_received_rows_run_in_source_order_fail(monkeypatch):
    # the permutation source-major -> expert-major skipped: rows reach the wrong local expert
    monkeypatch.setattr(ep_mod, "source_to_expert_order", lambda recv: np.arange(int(recv.sum()), dtype="int64"))
    loss, grads, losses, rank_grads = run("mixtral", 2)
    loss_err, grad_err, _ = compare(loss, grads, losses, rank_grads)
    assert loss_err > 1e-4 or grad_err > 1e-3, (loss_err, grad_err)


def test_owned_experts_and_the_permutation():
    assert list(ep_mod.owned_experts(8, 2, 1)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="expert_parallel_degree"):
        ep_mod.owned_experts(6, 4, 0)
    # two sources, two local experts: source 0 sends 1 row for e0 and 2 for e1, source 1 sends 2 for e0
    recv = np.array([[1, 2], [2, 0]])
    assert ep_mod.source_to_expert_order(recv).tolist() == [0, 3, 4, 1, 2]


def test_fused_experts_are_refused():
    from paddlenlp_ext.models.decoder import classes_for

    config_cls, _, lm_cls = classes_for("gpt_oss")
    kw = transformers.AutoConfig.for_model(
        "gpt_oss", **{**BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16}
    ).to_dict()
    model = lm_cls(config_cls(**kw))
    with pytest.raises(ValueError, match="expert_parallel_degree"):
        apply_expert_parallel(model, SimulatedExpertComm(SimulatedGroup(2), 0))


# ------------------------------------------------------------------------------------ config-time refusals
def _model_dir(tmp_path, model_type, **over):
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **ROWS.get(model_type, {}), **over})
    cfg.save_pretrained(str(tmp_path / model_type))
    return str(tmp_path / model_type)


@pytest.mark.parametrize(
    "model_type,degree,over,expect",
    [
        ("mixtral", 3, {}, "not a multiple of 3"),
        ("mixtral", 2, {}, "verified by simulation only"),
        ("llama", 2, {}, "has no experts"),
        ("qwen3_moe", 2, {"num_experts": 8}, "PaddleNLP-layout"),
        ("gpt_oss", 2, {"num_local_experts": 4, "head_dim": 16}, "fused"),
        ("mixtral", 2, {"tensor_parallel_degree": 2}, "tensor_parallel_degree=2"),
    ],
)
def test_expert_parallel_degree_is_refused_naming_the_key(tmp_path, model_type, degree, over, expect):
    from types import SimpleNamespace

    from paddlenlp_ext.config.expert_parallel import expert_parallel_problems

    training = {"expert_parallel_degree": degree, **{k: v for k, v in over.items() if k.endswith("_degree")}}
    model_dir = _model_dir(tmp_path, model_type, **{k: v for k, v in over.items() if not k.endswith("_degree")})
    got = expert_parallel_problems(SimpleNamespace(training=training), model_type, model_dir)
    assert len(got) == 1 and got[0].startswith(f"expert_parallel_degree={degree}") and expect in got[0], got
    for off in (1, -1, None):  # PaddleNLP's default -1, and 1: no expert parallelism, nothing to refuse
        assert (
            expert_parallel_problems(SimpleNamespace(training={"expert_parallel_degree": off}), model_type, model_dir)
            == []
        )


def test_the_cli_exits_2_naming_the_key(tmp_path):
    from test_decoder_cli import finetune, save_row

    base = save_row("mixtral", str(tmp_path / "base"))  # 4 experts
    r = finetune(base, str(tmp_path / "out"), "--expert_parallel_degree", "3", check=False)
    assert r.returncode == 2 and "expert_parallel_degree=3" in r.stdout + r.stderr, (r.stdout[-2000:], r.stderr[-2000:])


def test_docstring_examples():
    import doctest

    from bench import moe as bench_moe

    assert doctest.testmod(ep_mod).failed == 0
    assert doctest.testmod(bench_moe).failed == 0
