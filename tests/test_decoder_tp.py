"""Our decoder under tensor (and sequence) parallelism: 2 simulated ranks equal one process, on every dense row.

The rows come from the family table (every decoder row whose MLP is dense), so a new row is tested without
editing this file; the non-default knobs are tests/test_decoder_parity.py's ``KNOBS`` (windows, soft-caps,
partial rotary, biases, tied embeddings, q/k norms).  Each rank gets the single-device weights sliced by THIS
test's own numpy code (:func:`expected_split`: column-parallel q/k/v/gate/up and the vocab, row-parallel o/down,
a fused projection per segment), runs in lock step with the others (``parallel.SimulatedGroup``), and then:

* the loss on every rank equals the single process's (1e-5), and every parameter's gradient, gathered by this
  test's own code, equals the single process's (1e-5 relative to max(1, |grad|));
* with LoRA on the row's targets, every adapter gradient (gathered with ``unshard_adapter_states``) and the
  complete adapter checkpoint (``full_adapter_state_dict``) equal the single process's;
* negative controls fail: a contiguous (instead of per segment) split of a fused projection, a per-rank rms
  of OLMo 2's whole-projection q/k norm, and a head norm whose gradient is not summed over the ranks;
* the streaming loader cuts each rank's shard from a single-process checkpoint (the same tensors as the test's).
"""

import numpy as np
import paddle
import pytest

transformers = pytest.importorskip("transformers")

from test_decoder_parity import BASE, KNOBS  # noqa: E402

from paddlenlp_ext.models.family_table import FAMILIES  # noqa: E402
from paddlenlp_ext.parallel import SimulatedGroup  # noqa: E402

ROWS = [k for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp == "dense"]
N, B, S, TOL = 2, 2, 8, 1e-5
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")
ROW = ("o_proj", "down_proj")


def config_dict(model_type, **over):
    kw = {**BASE, **KNOBS.get(model_type, {}), **over}
    return transformers.AutoConfig.for_model(model_type, **kw).to_dict()


def build(model_type, tp=1, rank=0, sp=False, **over):
    from paddlenlp_ext.models.decoder import classes_for

    config_cls, _, lm_cls = classes_for(model_type)
    cfg = config_cls(
        **config_dict(model_type, **over), tensor_parallel_degree=tp, tensor_parallel_rank=rank, sequence_parallel=sp
    )
    return lm_cls(cfg)


def segments(name, cfg):
    """The fused output segments of a column layer (full sizes), () for an unfused one."""
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if ".qkv_proj." in name:
        return (heads * head_dim, kv * head_dim, kv * head_dim)
    if ".gate_up_proj." in name:
        return (cfg["intermediate_size"],) * 2
    return ()


def expected_split(name, cfg, model_type):
    """(axis, segments) of parameter ``name`` under tensor parallelism; axis None: replicated on every rank."""
    leaf = name.split(".")
    layer, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", leaf[-1])
    if name.endswith("embed_tokens.weight"):
        return 0, ()
    if name == "lm_head.weight":  # [hidden, vocab]; tied: the embedding table itself, [vocab, hidden]
        return (0 if cfg.get("tie_word_embeddings") else 1), ()
    if layer in COLUMN:
        return (1 if kind == "weight" else 0), segments(name, cfg)
    if layer in ROW:
        return (0 if kind == "weight" else None), ()
    if layer in ("q_norm", "k_norm") and FAMILIES[model_type].arch.qk_norm == "proj":
        return 0, ()  # OLMo 2: the norm over the whole projection is split like the projection's columns
    return None, ()


def np_take(full, axis, segs, rank, n=N):
    if not segs:
        return np.split(full, n, axis=axis)[rank]
    pieces = np.split(full, np.cumsum(segs)[:-1], axis=axis)
    return np.concatenate([np.split(p, n, axis=axis)[rank] for p in pieces], axis=axis)


def np_join(parts, axis, segs):
    if not segs:
        return np.concatenate(parts, axis=axis)
    per_rank = [np.split(p, np.cumsum([s // len(parts) for s in segs])[:-1], axis=axis) for p in parts]
    return np.concatenate([np.concatenate([r[i] for r in per_rank], axis=axis) for i in range(len(segs))], axis=axis)


def randomize(model, seed=0):
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        v = 1 + 0.3 * rng.standard_normal(p.shape) if "norm" in name else 0.15 * rng.standard_normal(p.shape)
        p.set_value(v.astype("float32"))


def load_shards(ref, tps, cfg, model_type, split=expected_split):
    full = {k: v.numpy() for k, v in ref.state_dict().items()}
    for r, m in enumerate(tps):
        for name, p in m.state_dict().items():
            axis, segs = split(name, cfg, model_type)
            value = full[name] if axis is None else np_take(full[name], axis, segs, r)
            assert list(value.shape) == list(p.shape), f"{name}: rank {r} holds {p.shape}, test slices {value.shape}"
            p.set_value(value)


def batch(seed=1, vocab=BASE["vocab_size"], shape=(B, S)):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, shape)
    mask = np.ones(shape, "int64")
    mask[-1, :3] = 0  # left padding
    labels = np.where(rng.random(shape) < 0.3, -100, rng.integers(3, vocab, shape))
    labels[-1, :3] = -100
    return dict(
        input_ids=paddle.to_tensor(ids),
        attention_mask=paddle.to_tensor(mask),
        position_ids=paddle.to_tensor(np.maximum(np.cumsum(mask, 1) - 1, 0)),
        labels=paddle.to_tensor(labels),
    )


def rel_err(got, want):
    return float(np.max(np.abs(got - want))) / max(1.0, float(np.max(np.abs(want))))


def run_both(model_type, sp=False, lora=None, split=expected_split, over=None, shape=(B, S), quant=None):
    """(single model, its loss, the N rank models, their losses, the simulation) after one backward each."""
    over = over or {}
    cfg = config_dict(model_type, **over)
    paddle.seed(0)
    ref = build(model_type, **over)
    randomize(ref)
    sim = SimulatedGroup(N)
    tps = sim.build(lambda r: build(model_type, N, r, sp, **over))
    load_shards(ref, tps, cfg, model_type, split)
    if quant is not None:  # QLoRA: each rank quantizes its own shards (column shards quantize exactly as whole)
        from paddlenlp_ext.models.quantize import quantize_model

        for m in [ref] + tps:
            quantize_model(m, quant, block_size=16)
    if lora is not None:
        from paddlenlp_ext.adapters import AdapterConfig, adapter_state_dict, apply_adapters, load_adapter_state_dict

        for m in [ref] + tps:
            apply_adapters(m, AdapterConfig.from_dict(lora.to_dict()))
        rng = np.random.default_rng(5)
        state = {k: (rng.standard_normal(v.shape) * 0.1).astype("float32") for k, v in adapter_state_dict(ref).items()}
        for m in [ref] + tps:
            load_adapter_state_dict(m, state)
    inputs = batch(shape=shape)
    loss = ref(**inputs).loss
    loss.backward()
    losses = sim.run(lambda r: tps[r](**inputs).loss)
    paddle.autograd.backward(losses)
    return ref, loss, tps, losses, cfg


@pytest.mark.parametrize(
    "sp,shape", [(False, (B, S)), (True, (B, S)), (True, (3, 5))], ids=["tp2", "tp2_sp", "tp2_sp_odd_tokens"]
)
@pytest.mark.parametrize("model_type", ROWS)
def test_two_ranks_equal_one_process_loss_and_every_gradient(model_type, sp, shape):
    """tp2_sp_odd_tokens: 15 tokens over 2 ranks (sequence parallel pads a zero row and drops it again)."""
    ref, loss, tps, losses, cfg = run_both(model_type, sp, shape=shape)
    for r, lr in enumerate(losses):
        assert abs(float(lr) - float(loss)) <= TOL * max(1.0, abs(float(loss))), f"rank {r} loss {lr} vs {loss}"
    ref_params = dict(ref.named_parameters())
    rank_params = [dict(m.named_parameters()) for m in tps]
    assert set(rank_params[0]) == set(ref_params)
    split_seen = 0
    for name, p in ref_params.items():
        axis, segs = expected_split(name, cfg, model_type)
        grads = [rp[name].grad.numpy() for rp in rank_params]
        if axis is None:
            for r, g in enumerate(grads):
                err = rel_err(g, p.grad.numpy())
                assert err <= TOL, f"{model_type}: replicated {name} grad on rank {r}: {err:.3g}"
        else:
            split_seen += 1
            err = rel_err(np_join(grads, axis, segs), p.grad.numpy())
            assert err <= TOL, f"{model_type}: split {name} grad: {err:.3g}"
    assert split_seen >= 7 * BASE["num_hidden_layers"] // (2 if FAMILIES[model_type].arch.fused_qkv else 1)


@pytest.mark.parametrize("model_type", ROWS)
def test_lora_on_parallel_layers_equals_one_process_and_saves_the_single_device_adapter(model_type):
    from paddlenlp_ext.adapters import AdapterConfig, adapter_state_dict, iter_adapter_layers
    from paddlenlp_ext.adapters.tp_checkpoint import adapter_shard_specs, adapter_split_axes, full_adapter_state_dict
    from paddlenlp_ext.adapters.tp_checkpoint import unshard_adapter_states

    lora = AdapterConfig(target_modules=list(FAMILIES[model_type].targets), r=4, alpha=8)
    ref, loss, tps, losses, cfg = run_both(model_type, lora=lora)
    assert abs(float(losses[0]) - float(loss)) <= TOL * max(1.0, abs(float(loss)))

    def grads(m):
        return {f"{n}.{s}": getattr(l, s).grad for n, l in iter_adapter_layers(m) for s in l.state_suffixes}

    got = unshard_adapter_states([grads(m) for m in tps], adapter_split_axes(tps[0]), adapter_shard_specs(tps[0]))
    want = grads(ref)
    assert set(got) == set(want) and want
    for k in want:
        assert rel_err(got[k], want[k].numpy()) <= TOL, k
    sim = next(l.collectives.simulation for _, l in iter_adapter_layers(tps[0]))  # the ranks' group
    states = sim.run(lambda r: {k: v.numpy() for k, v in full_adapter_state_dict(tps[r]).items()})
    single = {k: v.numpy() for k, v in adapter_state_dict(ref).items()}
    assert set(states[0]) == set(single)
    for k in single:
        np.testing.assert_array_equal(states[0][k], single[k], err_msg=k)


@pytest.mark.parametrize("model_type", ROWS)
def test_qlora_nf4_on_parallel_layers_equals_one_process(model_type):
    """The decoder's parallel linears are quantized per rank (QuantizedParallelLinear) and carry LoRA; blocks of 16
    divide every row shard here, so the dequantized shards are the single-device weights' slices."""
    from paddlenlp_ext.adapters import AdapterConfig, iter_adapter_layers
    from paddlenlp_ext.adapters.tp_checkpoint import adapter_shard_specs, adapter_split_axes, unshard_adapter_states
    from paddlenlp_ext.quant.parallel_linear import QuantizedParallelLinear

    lora = AdapterConfig(target_modules=list(FAMILIES[model_type].targets), r=4, alpha=8)
    ref, loss, tps, losses, cfg = run_both(model_type, lora=lora, quant="nf4")
    assert any(isinstance(l.base_layer, QuantizedParallelLinear) for _, l in iter_adapter_layers(tps[0]))
    assert abs(float(losses[1]) - float(loss)) <= TOL * max(1.0, abs(float(loss)))

    def grads(m):
        return {f"{n}.{s}": getattr(l, s).grad for n, l in iter_adapter_layers(m) for s in l.state_suffixes}

    got = unshard_adapter_states([grads(m) for m in tps], adapter_split_axes(tps[0]), adapter_shard_specs(tps[0]))
    for k, v in grads(ref).items():
        assert rel_err(got[k], v.numpy()) <= TOL, k


def _fused_row(kind):
    rows = [r for r in ROWS if getattr(FAMILIES[r].arch, kind)]
    if not rows:
        pytest.skip(f"no dense decoder row with {kind}")
    return rows[0]


def test_negative_control_contiguous_split_of_a_fused_projection_fails():
    model_type = _fused_row("fused_gate_up")

    def wrong(name, cfg, mt):
        axis, _ = expected_split(name, cfg, mt)
        return axis, ()  # the fused output cut in N contiguous blocks: rank 0 would hold gate only

    ref, loss, tps, losses, cfg = run_both(model_type, split=wrong)
    assert abs(float(losses[0]) - float(loss)) > 1e-3


def test_negative_control_per_rank_rms_of_a_whole_projection_norm_fails(monkeypatch):
    rows = [r for r in ROWS if FAMILIES[r].arch.qk_norm == "proj"]
    if not rows:
        pytest.skip("no row with a whole-projection q/k norm")
    from paddlenlp_ext.models.decoder import layers

    real = layers.Norm.forward

    def local_rms(self, x, lean=False):  # what a per-rank norm over a split projection would compute
        if not self.split:
            return real(self, x, lean)
        x32 = x.astype("float32")
        return self.weight * (x32 * paddle.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))

    monkeypatch.setattr(layers.Norm, "forward", local_rms)
    ref, loss, tps, losses, cfg = run_both(rows[0])
    assert abs(float(losses[0]) - float(loss)) > 1e-3


def test_negative_control_head_norm_gradient_not_summed_over_ranks_fails(monkeypatch):
    rows = [r for r in ROWS if FAMILIES[r].arch.qk_norm == "head"]
    if not rows:
        pytest.skip("no row with a per-head q/k norm")
    from paddlenlp_ext.models.decoder import layers

    monkeypatch.setattr(layers.Norm, "_shared", lambda self, p: p)
    ref, loss, tps, losses, cfg = run_both(rows[0])
    name = next(n for n, _ in ref.named_parameters() if n.endswith("self_attn.q_norm.weight"))
    got = dict(tps[0].named_parameters())[name].grad.numpy()
    assert rel_err(got, dict(ref.named_parameters())[name].grad.numpy()) > 1e-3


def test_heads_that_do_not_divide_the_degree_are_refused():
    sim = SimulatedGroup(N)
    with pytest.raises(ValueError, match="multiples of tensor_parallel_degree=2"):
        sim.build(lambda r: build(ROWS[0], N, r, num_key_value_heads=1))


@pytest.mark.parametrize(
    "model_type", [r for r in ROWS if FAMILIES[r].arch.fused_qkv or FAMILIES[r].arch.fused_gate_up][:1] or ROWS[:1]
)
def test_streaming_loader_cuts_each_rank_from_a_single_process_checkpoint(model_type, tmp_path):
    from paddlenlp_ext.models.decoder import classes_for
    from paddlenlp_ext.models.loading import load_model_streaming

    cfg = config_dict(model_type)
    ref = build(model_type)
    randomize(ref, seed=3)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    config_cls, _, lm_cls = classes_for(model_type)
    sim = SimulatedGroup(N)

    def load(r):
        config = config_cls.from_pretrained(str(tmp_path))
        config.tensor_parallel_degree, config.tensor_parallel_rank = N, r
        return load_model_streaming(str(tmp_path), config, "float32", model_class=lm_cls)[0]

    tps = sim.build(load)
    full = {k: v.numpy() for k, v in ref.state_dict().items()}
    for r, m in enumerate(tps):
        for name, p in m.state_dict().items():
            axis, segs = expected_split(name, cfg, model_type)
            want = full[name] if axis is None else np_take(full[name], axis, segs, r)
            np.testing.assert_array_equal(p.numpy(), want, err_msg=f"rank {r} {name}")


@pytest.mark.parametrize("model_type", ROWS)
def test_save_pretrained_merge_mappings_rebuild_the_single_device_checkpoint(model_type):
    """PaddleNLP's ``save_pretrained(merge_tensor_parallel=True)`` gathers every tensor the class's
    ``_get_tensor_parallel_mappings(is_split=False)`` names and joins it with the action (rank 0's copy for the
    rest); run with PaddleNLP's own key resolver on the simulated ranks' state dicts, that gives the single-device
    state dict exactly, and ``is_split=True`` cuts each rank's part back out.  Every split parameter is named."""
    check_merge_mappings(model_type)


def check_merge_mappings(model_type, init=randomize, load=load_shards):
    """The merge-mappings check of the test above on ``model_type``, its weights set by ``init`` and sliced per
    rank by ``load`` (tests/test_moe_parallel.py passes the MoE rows' own) -> the names of the split parameters."""
    from paddlenlp_ext.models.decoder import classes_for

    cfg = config_dict(model_type)
    ref = build(model_type)
    init(ref, seed=4)
    sim = SimulatedGroup(N)
    tps = sim.build(lambda r: build(model_type, N, r))
    load(ref, tps, cfg, model_type)
    lm_cls = classes_for(model_type)[2]
    states = [{k: v.numpy() for k, v in m.state_dict().items()} for m in tps]
    for r in range(N):
        config = tps[r].config
        actions = lm_cls._get_tensor_parallel_mappings(config, is_split=False)
        keys = lm_cls._resolve_prefix_keys(list(actions), list(states[0]))  # base name -> model key
        named = {v: b for b, v in keys.items()}  # model key -> base name
        merged = {}
        for k in states[0]:
            merged[k] = actions[named[k]]([s[k] for s in states]) if k in named else states[0][k]
        for k, v in ref.state_dict().items():
            np.testing.assert_array_equal(merged[k], v.numpy(), err_msg=k)
        cut = lm_cls._get_tensor_parallel_mappings(config, is_split=True)
        for k, base in named.items():
            np.testing.assert_array_equal(cut[base](merged[k]), states[r][k], err_msg=base)
        tp_named = {n for n, p in tps[r].named_parameters() if getattr(p, "tp_full_shape", None) is not None}
        assert tp_named <= set(named), sorted(tp_named - set(named))
    return tp_named


def _config_problems(tmp_path, model_type, *overrides, **config_over):
    """The config-time problems of a run on a config.json of ``model_type`` (the launch check set aside: these
    configs are checked outside ``paddle.distributed.launch``)."""
    import json

    from paddlenlp_ext.config.parse import ConfigError, load_config
    from test_families import DATA_DIR

    d = tmp_path / model_type
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config_dict(model_type, **config_over)), encoding="utf-8")
    try:
        load_config(
            None,
            [
                "--dataset_name_or_path",
                DATA_DIR,
                "--do_train",
                "true",
                "--model_name_or_path",
                str(d),
                "--output_dir",
                str(tmp_path / "out"),
                *overrides,
            ],
        )
    except ConfigError as e:
        return [str(p) for p in e.problems if getattr(p, "kind", None) != "launch"]
    return []


@pytest.mark.parametrize("model_type", ROWS)
def test_config_accepts_tensor_parallel_on_every_dense_row(tmp_path, model_type):
    for method in (["--lora", "true"], ["--lora", "true", "--weight_quantize_algo", "nf4"], []):
        assert _config_problems(tmp_path, model_type, "--tensor_parallel_degree", "2", *method) == []


def test_config_refuses_heads_that_do_not_divide(tmp_path):
    """(The MoE rows: tests/test_moe_parallel.py.)"""
    found = _config_problems(
        tmp_path, ROWS[0], "--tensor_parallel_degree", "2", "--lora", "true", num_key_value_heads=1
    )
    assert len(found) == 1 and "num_key_value_heads=1 is not a multiple of tensor_parallel_degree=2" in found[0]


def test_config_refuses_vera_on_a_fused_projection_under_tensor_parallelism(tmp_path):
    model_type = _fused_row("fused_gate_up")
    found = _config_problems(tmp_path, model_type, "--tensor_parallel_degree", "2", "--vera", "true")
    assert any("vera=true with tensor_parallel_degree=2" in p and "use lora=true" in p for p in found), found


@pytest.mark.parametrize("model_type", ROWS)
def test_memory_planner_counts_every_decoder_row_and_plans_tp_and_pp(tmp_path, model_type):
    """The planner's shape of a decoder row (from its knobs) has the model's exact parameter count, names the Linears
    as the model does (adapter targets match), and plans the row under TP 2 and PP 2."""
    import json

    from paddlenlp_ext.planner import estimate_for_run, load_plan_config, read_model_shape

    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_dict(model_type)), encoding="utf-8")
    shape = read_model_shape(str(d))
    model = build(model_type)
    assert shape.total_params == sum(int(np.prod(p.shape)) for p in model.parameters())
    names = {n for n, _ in model.named_sublayers()}
    assert {shape.layer_name(0, s) for s, _, _ in shape.layer_linears()} <= names
    tiny = __import__("os").path.join(__import__("conftest").ROOT, "llm", "config", "tiny", "lora_argument.json")
    sizes = {}
    for degree in ({}, {"tensor_parallel_degree": "2"}, {"pipeline_parallel_degree": "2"}):
        overrides = ["--model_name_or_path", str(d)] + [x for kv in degree.items() for x in ("--" + kv[0], kv[1])]
        cfg, _ = load_plan_config(tiny, overrides)
        sizes[tuple(degree)] = estimate_for_run(cfg, target="gpu").breakdown["weights"]
    assert sizes[("tensor_parallel_degree",)] < sizes[()] and sizes[("pipeline_parallel_degree",)] < sizes[()]


def test_a_run_loads_its_rank_of_a_transformers_checkpoint_with_sequence_parallel_and_qlora(tmp_path, monkeypatch):
    """What the run's ``load_model`` builds on each of 2 model-parallel ranks for a decoder row: the rank's shards
    streamed from a transformers-saved checkpoint, ``sequence_parallel`` taken from the run's key, the base quantized
    per rank; the 2 ranks' loss equals the single process's on the same (quantized) weights."""
    from types import SimpleNamespace

    import torch
    from conftest import ROOT
    from test_decoder_parity import BASE as HF_BASE

    from paddlenlp_ext.config.parse import load_config
    from paddlenlp_ext.parallel import ParallelLinear
    from paddlenlp_ext.quant.parallel_linear import QuantizedParallelLinear
    from paddlenlp_ext.training.model_build import load_model

    model_type = _fused_row("fused_qkv")
    hf_cfg = transformers.AutoConfig.for_model(model_type, **{**HF_BASE, **KNOBS.get(model_type, {})})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(str(tmp_path / "hf"))
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    quant = ["--weight_quantize_algo", "nf4", "--weight_blocksize", "16"]

    def run_config(tp, sp):
        return load_config(
            __import__("os").path.join(ROOT, "llm", "config", "tiny", "lora_argument.json"),
            [
                "--model_name_or_path",
                str(tmp_path / "hf"),
                "--tensor_parallel_degree",
                str(tp),
                "--sequence_parallel",
                str(sp).lower(),
                *(quant if not sp else []),
            ],
        )

    def args(tp, rank, sp):
        return SimpleNamespace(
            fp16_opt_level="O1",
            fp16=False,
            bf16=False,
            tensor_parallel_degree=tp,
            tensor_parallel_rank=rank,
            tensor_parallel_output=False,
            recompute=False,
            pipeline_parallel_degree=1,
            sequence_parallel=sp,
        )

    inputs = batch(vocab=HF_BASE["vocab_size"])
    for sp in (False, True):
        q = (
            None
            if sp
            else {
                "weight_quantize_algo": "nf4",
                "weight_blocksize": 16,
                "weight_double_quant": False,
                "weight_double_quant_block_size": 256,
            }
        )
        single, _ = load_model(run_config(1, False), args(1, 0, False), q)
        sim = SimulatedGroup(N)
        ranks = sim.build(lambda r: load_model(run_config(N, sp), args(N, r, sp), q)[0])
        assert all(m.config.sequence_parallel == sp for m in ranks)
        assert any(isinstance(l, QuantizedParallelLinear) for _, l in ranks[0].named_sublayers()) == (q is not None)
        assert any(
            isinstance(l, ParallelLinear) and l.tp_spec.sequence_parallel == sp for _, l in ranks[0].named_sublayers()
        ) == (q is None)
        want = float(single(**inputs).loss)
        losses = sim.run(lambda r: float(ranks[r](**inputs).loss))
        assert all(abs(x - want) <= TOL * max(1.0, abs(want)) for x in losses), (sp, losses, want)


@pytest.mark.parametrize("sp", [False, True])
def test_sequence_parallel_reaches_the_model_config(tiny_model_dir, monkeypatch, sp):
    """The decoder (llama here; PaddleNLP's own llama did too) reads ``sequence_parallel`` from its model config:
    the run's key must be there when the tensor-parallel model is built (it was left at False, so
    sequence_parallel=true silently ran plain TP)."""
    import os
    from types import SimpleNamespace

    from conftest import ROOT

    from paddlenlp_ext.config.parse import load_config
    from paddlenlp_ext.models import loading
    from paddlenlp_ext.training.model_build import load_model

    class Built(Exception):
        pass

    def capture(path, config, dtype, **kw):
        raise Built(config)

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setattr(loading, "load_model_streaming", capture)
    cfg = load_config(
        os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json"),
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--tensor_parallel_degree",
            "2",
            "--sequence_parallel",
            str(sp).lower(),
        ],
    )
    args = SimpleNamespace(
        fp16_opt_level="O1",
        fp16=False,
        bf16=False,
        tensor_parallel_degree=2,
        tensor_parallel_rank=0,
        tensor_parallel_output=False,
        recompute=False,
        pipeline_parallel_degree=1,
        sequence_parallel=sp,
    )
    with pytest.raises(Built) as got:
        load_model(cfg, args, None)
    config = got.value.args[0]
    assert config.model_type == "llama" and config.tensor_parallel_degree == 2
    assert config.sequence_parallel is sp
