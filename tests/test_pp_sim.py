"""Pipeline-parallel adapters, by simulation (fleet's pipeline cannot run on a CPU build).

PaddleNLP's own LlamaForCausalLMPipe / Qwen2ForCausalLMPipe stages (each holding only its layers) get
our adapters by the plain model's names; a micro-batch runs through them with detached activations
("sent") and back-propagated activation gradients ("received"), and the last stage applies our
PipelineCriterion.  Loss and every adapter gradient must equal the single model's (global_token_loss
with the same N), for 2 and 4 stages, 2 virtual chunks per stage, unpadded and packed rows; a stage
checkpoint gathered over the simulated pipeline group must equal the single-device one (same keys, tensors
and config).
"""

import os

import numpy as np
import paddle
import pytest

from paddlenlp_ext.data.global_batches import GLOBAL_TOKENS_KEY

LAYERS = 4


def model_config(tiny_dir, virtual=1, **extra):
    from paddlenlp.transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_dir)
    config.num_hidden_layers = LAYERS
    config.virtual_pp_degree = virtual
    for k, v in extra.items():
        setattr(config, k, v)
    return config


def classes(family):
    from paddlenlp.transformers import LlamaForCausalLM, LlamaForCausalLMPipe, Qwen2ForCausalLM, Qwen2ForCausalLMPipe

    return {"llama": (LlamaForCausalLM, LlamaForCausalLMPipe), "qwen2": (Qwen2ForCausalLM, Qwen2ForCausalLMPipe)}[
        family
    ]


def adapter_config(method):
    from paddlenlp_ext.adapters import AdapterConfig

    if method == "lokr":
        return AdapterConfig(method="lokr", r=4, alpha=8)
    return AdapterConfig(method="lora", r=4, alpha=8, rslora=method == "rslora")


def build_pair(tiny_dir, family, method, stages, virtual=1, **extra):
    """(single model with adapters, [stage models with the same weights and adapters])."""
    from paddlenlp_ext.adapters import adapter_state_dict, apply_adapters, load_adapter_state_dict
    from paddlenlp_ext.adapters.pp_stage import prepare_stage_for_adapters
    from paddlenlp_ext.parallel.pp_sim import build_stages

    single_cls, pipe_cls = classes(family)
    config = model_config(tiny_dir, virtual, **extra)
    paddle.seed(3)
    single = single_cls(config)
    plain = {k: v.numpy() for k, v in single.state_dict().items()}
    if method == "full":  # full fine-tuning: every weight trains, no adapters
        parts = build_stages(pipe_cls, config, stages)
        for stage in parts:
            stage.set_state_dict({k: paddle.to_tensor(v) for k, v in plain.items()})
        return single, parts
    paddle.seed(4)
    apply_adapters(single, adapter_config(method))
    with paddle.no_grad():  # B (or LoKr's second factor) starts at 0: make every gradient non-trivial
        for name, p in single.named_parameters():
            if not p.stop_gradient:
                p.set_value(p + paddle.randn(p.shape, dtype=p.dtype) * 0.05)
    trained = adapter_state_dict(single)
    parts = build_stages(pipe_cls, config, stages)
    for stage in parts:
        stage.set_state_dict({k: paddle.to_tensor(v) for k, v in plain.items()})
        names = prepare_stage_for_adapters(stage)
        apply_adapters(stage, adapter_config(method), layer_names=names)
        load_adapter_state_dict(stage, trained)  # a stage takes its own layers' tensors
    return single, parts


def batch(kind, vocab, seed=0):
    """(model inputs for the single model, the first stage's tuple, labels, N)."""
    rng = np.random.RandomState(seed)
    if kind == "padded":  # right padding, no mask (PaddingCollator)
        ids = rng.randint(3, vocab, size=(2, 12)).astype("int64")
        labels = rng.randint(3, vocab, size=(2, 12)).astype("int64")
        ids[1, 8:] = 0
        labels[1, 8:] = -100
        labels[:, :3] = -100
        single = {"input_ids": paddle.to_tensor(ids)}
        first = (paddle.to_tensor(ids), None, None, None)
        return single, first, paddle.to_tensor(labels), int((labels != -100).sum())
    from paddlenlp_ext.data.collate import PackedCollator
    from paddlenlp_ext.data.packed_row import build_packed_row

    def example(n):
        return {
            "input_ids": rng.randint(3, vocab, size=n).tolist(),
            "labels": [-100] * 2 + rng.randint(3, vocab, size=n - 2).tolist(),
        }

    rows = [build_packed_row([example(5), example(4)], 12, 0), build_packed_row([example(7), example(3)], 12, 0)]
    out = PackedCollator(flash_mask=kind == "packed_flash")(rows)
    t = {k: paddle.to_tensor(v) for k, v in out.items() if k != "real_tokens"}
    labels = t.pop("labels")
    if kind == "packed_flash":
        sri = t["attn_mask_startend_row_indices"].astype("int32")
        first = (t["input_ids"], None, sri, t["position_ids"])
    else:
        first = (t["input_ids"], t["attention_mask"], None, t["position_ids"])
    return t, first, labels, int((out["labels"] != -100).sum())


def adapter_grads(model):
    """Adapter gradients by plain name; with no adapters (full fine-tuning) every weight's gradient."""
    from paddlenlp_ext.adapters.api import iter_adapter_layers

    if not iter_adapter_layers(model):
        return {k: v.grad.numpy() for k, v in model.state_dict().items() if v.grad is not None}
    out = {}
    for name, layer in iter_adapter_layers(model):
        for pname, p in layer.named_parameters():
            if not p.stop_gradient and p.grad is not None:
                out[f"{name}.{pname}"] = p.grad.numpy()
    return out


def compare(single, stages, kind, ranks=2, accumulation=3):
    from paddlenlp_ext.integrations.flashmask import cpu_flashmask
    from paddlenlp_ext.parallel.pp_sim import run_pipeline
    from paddlenlp_ext.training.loss import global_token_loss
    from paddlenlp_ext.training.pp_step import PipelineCriterion

    inputs, first, labels, n = batch(kind, single.config.vocab_size)
    n_global = n + 17  # N counts the whole global batch, not only this micro-batch
    with cpu_flashmask():
        ref = global_token_loss(single, {**inputs, "labels": labels}, n_global, ranks, accumulation)
        ref.backward()
        loss = run_pipeline(stages, first, (labels, paddle.to_tensor(n_global)), PipelineCriterion(ranks, accumulation))
    want = adapter_grads(single)
    got = {}
    for stage in stages:
        part = adapter_grads(stage)
        assert not set(part) & set(got), "two stages hold the same adapter"
        got.update(part)
    assert set(got) == set(want) and len(want) > 0
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
    for k in want:  # the single model's loss runs lm_head + cross-entropy in chunks: fp32 summation order
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=max(1e-6, 2e-6 * np.abs(want[k]).max()), err_msg=k)
    return want


@pytest.mark.parametrize(
    "family,method,stages,virtual,kind",
    [
        ("llama", "lora", 2, 1, "padded"),
        ("llama", "rslora", 4, 1, "padded"),
        ("llama", "lokr", 2, 1, "padded"),
        ("llama", "full", 2, 1, "packed_flash"),
        ("qwen2", "full", 4, 1, "padded"),
        ("llama", "lora", 2, 2, "padded"),
        ("llama", "lora", 2, 1, "packed_flash"),
        ("llama", "lora", 4, 1, "packed_dense"),
        ("qwen2", "lora", 2, 1, "padded"),
        ("qwen2", "lora", 2, 2, "packed_flash"),
    ],
)
def test_stages_reproduce_the_single_model(request, family, method, stages, virtual, kind):
    tiny_dir = request.getfixturevalue("tiny_model_dir" if family == "llama" else "tiny_qwen2_dir")
    single, parts = build_pair(tiny_dir, family, method, stages, virtual, use_flash_attention=kind == "packed_flash")
    # every stage holds only its own layers (and their adapters), named as in the plain model
    from paddlenlp_ext.adapters.api import iter_adapter_layers

    per_stage = [sorted({n.split(".")[2] for n in p.state_dict() if n.split(".")[1] == "layers"}) for p in parts]
    assert sum(len(s) for s in per_stage) == LAYERS and all(per_stage)
    if method != "full":
        assert [sorted({n.split(".")[2] for n, _ in iter_adapter_layers(p)}) for p in parts] == per_stage
    grads = compare(single, parts, kind)
    assert max(float(np.abs(g).max()) for g in grads.values()) > 1e-4  # the comparison can fail


def test_a_wrong_stage_weight_is_detected(tiny_model_dir):
    """Negative control: one adapter value changed on the last stage changes loss and gradients."""
    single, parts = build_pair(tiny_model_dir, "llama", "lora", 2)
    from paddlenlp_ext.adapters.api import iter_adapter_layers

    _, layer = iter_adapter_layers(parts[-1])[0]
    with paddle.no_grad():
        layer.lora_A.set_value(layer.lora_A + 0.01)
    with pytest.raises(AssertionError):
        compare(single, parts, "padded")


def test_stage_checkpoint_is_the_single_device_checkpoint(tmp_path, tiny_model_dir):
    from paddlenlp_ext.adapters import AdapterConfig, load_adapter, save_adapter
    from paddlenlp_ext.adapters.api import adapter_state_dict
    from paddlenlp_ext.adapters.pp_stage import attach_pipeline_group, prepare_stage_for_adapters
    from paddlenlp_ext.parallel.pp_sim import SimulatedPipelineGroup, build_stages, run_stages_in_threads

    single, parts = build_pair(tiny_model_dir, "llama", "lora", 4)
    save_adapter(single, None, str(tmp_path / "single"))
    group = SimulatedPipelineGroup(4)
    for s, stage in enumerate(parts):
        attach_pipeline_group(stage, group.view(s))
    paths = run_stages_in_threads(4, lambda s: save_adapter(parts[s], None, str(tmp_path / "pipe")))
    assert len({p["weights"] for p in paths}) == 1
    with (
        open(tmp_path / "single" / "adapter_config.json", "rb") as a,
        open(tmp_path / "pipe" / "adapter_config.json", "rb") as b,
    ):
        assert a.read() == b.read()
    from safetensors import safe_open

    files = [safe_open(str(tmp_path / d / "adapter_model.safetensors"), "np") for d in ("single", "pipe")]
    assert files[0].metadata() == files[1].metadata()
    assert list(files[0].keys()) == list(files[1].keys()) and len(list(files[0].keys())) == 2 * 7 * LAYERS
    for k in files[0].keys():
        np.testing.assert_array_equal(files[1].get_tensor(k), files[0].get_tensor(k))
    # and a stage loads its own part of it (lora_path / resume on a pipeline stage)
    _, pipe_cls = classes("llama")
    fresh = build_stages(pipe_cls, model_config(tiny_model_dir), 2)
    expected = adapter_state_dict(single)
    for stage in fresh:
        load_adapter(stage, str(tmp_path / "pipe"), layer_names=prepare_stage_for_adapters(stage))
        got = adapter_state_dict(stage)
        assert got and all(np.array_equal(v.numpy(), expected[k].numpy()) for k, v in got.items())
    assert isinstance(AdapterConfig.load(str(tmp_path / "pipe")), AdapterConfig)


def test_stage_without_group_refuses_to_save(tmp_path, tiny_model_dir):
    from paddlenlp_ext.adapters import save_adapter
    from paddlenlp_ext.adapters.base import AdapterError

    _, parts = build_pair(tiny_model_dir, "llama", "lora", 2)
    with pytest.raises(AdapterError, match="no pipeline group"):
        save_adapter(parts[0], None, str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x" / "adapter_model.safetensors")


def test_vera_refused_on_a_stage(tiny_model_dir):
    from paddlenlp_ext.adapters import AdapterConfig, apply_adapters
    from paddlenlp_ext.adapters.pp_stage import prepare_stage_for_adapters
    from paddlenlp_ext.parallel.pp_sim import build_stages

    stage = build_stages(classes("llama")[1], model_config(tiny_model_dir), 2)[0]
    with pytest.raises(NotImplementedError, match="VeRA on a pipeline stage"):
        apply_adapters(stage, AdapterConfig(method="vera", r=4), layer_names=prepare_stage_for_adapters(stage))


# ------------------------------------------------------------------ the pipeline's inputs and loss


def test_pipeline_inputs_doctest():
    import doctest

    from paddlenlp_ext.training import pp_step

    assert doctest.testmod(pp_step, verbose=False).failed == 0


def test_pipeline_inputs_cast_what_the_layers_tell_apart_by_dtype():
    from paddlenlp_ext.training.pp_step import pipeline_inputs

    micro = [
        {
            "input_ids": paddle.ones([1, 4], "int64"),
            "labels": paddle.ones([1, 4], "int64"),
            "attn_mask_startend_row_indices": paddle.full([1, 1, 4], 4, "int64"),
            "position_ids": paddle.arange(4, dtype="int32").unsqueeze(0),
            GLOBAL_TOKENS_KEY: paddle.to_tensor(4),
        }
    ]
    first, last = pipeline_inputs(micro * 2)
    assert first[1] is None and len(first[0]) == 2
    with pytest.raises(ValueError, match=r"keys no pipeline stage takes: \['chosen_labels'\]"):
        pipeline_inputs([{**micro[0], "chosen_labels": paddle.ones([1, 4], "int64")}])
    assert first[2][0].dtype == paddle.int32 and first[3][0].dtype == paddle.int64
    assert len(last) == 2 and [int(n) for n in last[1]] == [4, 4]


def test_accumulated_micro_losses_give_the_global_token_mean():
    """The pipeline divides each micro-batch loss by the accumulation steps; with ranks = 1 the sum over
    the micro-batches must be the token mean of the whole global batch (micro-batches of 3 and 9 tokens)."""
    from paddlenlp_ext.training.pp_step import PipelineCriterion

    rng = np.random.RandomState(0)
    logits = [paddle.to_tensor(rng.randn(1, 12, 7).astype("float32")) for _ in range(2)]
    labels = [np.full((1, 12), -100, "int64") for _ in range(2)]
    labels[0][0, :3] = rng.randint(0, 7, 3)
    labels[1][0, :9] = rng.randint(0, 7, 9)
    crit = PipelineCriterion(ranks=1, accumulation=2)
    n = 12
    total = sum(float(crit(lg, (paddle.to_tensor(lb), paddle.to_tensor(n)))) / 2 for lg, lb in zip(logits, labels))
    flat_logits = np.concatenate([lg.numpy()[0] for lg in logits])
    flat_labels = np.concatenate([lb[0] for lb in labels])
    keep = flat_labels != -100
    z = flat_logits[keep]
    nll = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1) - z[np.arange(keep.sum()), flat_labels[keep]]
    assert total == pytest.approx(nll.mean(), rel=1e-5)
    # PaddleNLP's per-micro-batch means would weight the 3-token batch like the 9-token one
    per_mean = (nll[:3].mean() + nll[3:].mean()) / 2
    assert abs(per_mean - nll.mean()) > 1e-3
    # evaluation (no N): the micro-batch's token mean
    assert float(crit(logits[0], paddle.to_tensor(labels[0]))) == pytest.approx(nll[:3].mean(), rel=1e-5)


def test_layout_problems():
    from paddlenlp_ext.training.model_build import pipeline_layout_problem

    assert pipeline_layout_problem("llama", 32, 4, 1) is None
    assert "has no pipeline model" in pipeline_layout_problem("gpt", 32, 2, 1)
    assert "fewer than" in pipeline_layout_problem("qwen2", 2, 4, 1)


# ------------------------------------------------------------------ what the config accepts


def pp_problems(monkeypatch, config, *overrides, processes=2):
    from conftest import ROOT

    from paddlenlp_ext.config.parse import ConfigError, load_config

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", str(processes))
    path = os.path.join(ROOT, "llm", "config", "tiny", config)
    try:
        load_config(path, ["--pipeline_parallel_degree", "2", *overrides])
    except ConfigError as e:
        return [p for p in e.problems if "pipeline" in p or "virtual_pp" in p]
    return []


def test_config_accepts_lora_family_and_lokr(monkeypatch):
    assert pp_problems(monkeypatch, "lora_argument.json") == []
    assert pp_problems(monkeypatch, "lora_argument.json", "--rslora", "true", "--lora_plus_scale", "4") == []
    assert pp_problems(monkeypatch, "lokr_argument.json") == []
    assert (
        pp_problems(
            monkeypatch,
            "lora_argument.json",
            "--pipeline_parallel_degree",
            "4",
            "--virtual_pp_degree",
            "2",
            "--gradient_accumulation_steps",
            "8",
            processes=4,
        )
        == []
    )


def test_config_accepts_full_fine_tuning_and_packed_rows(monkeypatch):
    assert pp_problems(monkeypatch, "sft_argument.json") == []
    assert pp_problems(monkeypatch, "lora_argument.json", "--zero_padding", "true", "--flash_mask", "false") == []


@pytest.mark.parametrize("config,overrides,expect", [
    ("lora_argument.json", ["--lora", "false", "--vera", "true"], "vera=true is not supported"),
    ("lora_argument.json", ["--pissa", "true"], "pissa=true"),
    ("lora_argument.json", ["--neftune", "true"], "neftune=true"),
    ("lora_argument.json", ["--weight_quantize_algo", "nf4"], "weight_quantize_algo"),
    ("lora_argument.json", ["--do_eval", "true", "--eval_with_do_generation", "true"],
     "eval_with_do_generation=true is not supported"),
    ("lora_argument.json", ["--virtual_pp_degree", "2"], "needs pipeline_parallel_degree > 2"),
    ("lora_argument.json", ["--pipeline_parallel_degree", "4", "--virtual_pp_degree", "2"],
     "gradient_accumulation_steps >= 2 x pipeline_parallel_degree = 8"),
])  # fmt: skip
def test_config_refuses_with_the_key_to_change(monkeypatch, config, overrides, expect):
    processes = 4 if "4" in overrides else 2
    problems = pp_problems(monkeypatch, config, *overrides, processes=processes)
    assert any(expect in p for p in problems), problems


def test_config_refuses_tensor_x_pipeline_for_adapters(monkeypatch):
    problems = pp_problems(monkeypatch, "lora_argument.json", "--tensor_parallel_degree", "2", processes=4)
    assert any("tensor_parallel_degree=2 is not supported yet" in p for p in problems), problems


def test_a_run_builds_and_wires_its_stage(tiny_model_dir):
    """What build_model does under pipeline_parallel_degree 2 on rank 1: PaddleNLP's stage with its own
    weights, our inputs and criterion installed, the pipeline group attached, adapters by plain names."""
    from types import SimpleNamespace

    from paddlenlp.transformers import AutoConfig, AutoModelForCausalLM

    from paddlenlp_ext.adapters import AdapterConfig, apply_adapters
    from paddlenlp_ext.adapters.api import iter_adapter_layers
    from paddlenlp_ext.integrations.paddlenlp_pipe import pipeline_stage_construction
    from paddlenlp_ext.training.model_build import load_pipeline_stage, prepare_pipeline_stage
    from paddlenlp_ext.training.pp_step import PipelineCriterion, pipeline_inputs

    config = AutoConfig.from_pretrained(tiny_model_dir)
    args = SimpleNamespace(pipeline_parallel_degree=2, dataset_world_size=3, gradient_accumulation_steps=4)
    with pipeline_stage_construction(2, 1):
        stage = load_pipeline_stage(
            SimpleNamespace(continue_training=True, model_name_or_path=tiny_model_dir),
            config,
            "float32",
            args,
            "c.json",
        )
        names = prepare_pipeline_stage(stage, args)
    crit = stage._loss_fn[0]
    assert isinstance(crit, PipelineCriterion) and (crit.ranks, crit.accumulation) == (3, 4)
    assert stage._prepare_pipeline_inputs_func is pipeline_inputs
    group = stage._paddlenlp_ext_pipeline_group
    assert (group.stage, group.num_stages) == (1, 2)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    last = config.num_hidden_layers - 1
    for k, v in stage.state_dict().items():  # the stage's own weights, loaded
        np.testing.assert_array_equal(v.numpy(), plain[k].numpy())
    assert any(k.startswith(f"llama.layers.{last}.") for k in stage.state_dict())
    assert not any(k.startswith("llama.layers.0.") for k in stage.state_dict())
    apply_adapters(stage, AdapterConfig(method="lora", r=4, alpha=8), layer_names=names)
    assert {n.split(".")[2] for n, _ in iter_adapter_layers(stage)} == {str(last)}
    assert prepare_pipeline_stage(plain_model := AutoModelForCausalLM.from_pretrained(tiny_model_dir), args) is None
    assert not hasattr(plain_model, "_paddlenlp_ext_pipeline_group")


def test_full_fine_tuning_stages_save_one_single_device_checkpoint(tmp_path, tiny_model_dir):
    """Each stage writes its own layers; the first adds the plain class's config and one index: the directory
    loads with LlamaForCausalLM.from_pretrained and equals the single model, also when saved again over it."""
    import json

    from paddlenlp.transformers import LlamaForCausalLM

    from paddlenlp_ext.adapters.pp_stage import INDEX_NAME, attach_pipeline_group, save_stage_weights
    from paddlenlp_ext.parallel.pp_sim import SimulatedPipelineGroup, run_stages_in_threads

    single, parts = build_pair(tiny_model_dir, "llama", "full", 2)
    want = {k: v.numpy() for k, v in single.state_dict().items()}
    for round_ in range(2):
        with paddle.no_grad():  # round 2: new values, written over round 1's files
            for stage in parts:
                for k, v in stage.state_dict().items():
                    v.set_value(paddle.to_tensor(want[k] + round_))
        group = SimulatedPipelineGroup(2)
        for s, stage in enumerate(parts):
            attach_pipeline_group(stage, group.view(s))
        shard = "40KB" if round_ == 0 else "60KB"  # fewer shards the second time: the first save's extra go
        run_stages_in_threads(2, lambda s: save_stage_weights(parts[s], str(tmp_path / "out"), max_shard_size=shard))
        index = json.load(open(tmp_path / "out" / INDEX_NAME))
        assert set(index["weight_map"]) == set(want)
        files = set(index["weight_map"].values())
        assert len(files) > 2  # several shards per stage
        assert {n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")} == files
        assert json.load(open(tmp_path / "out" / "config.json"))["architectures"] == ["LlamaForCausalLM"]
        loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "out"))
        for k, v in loaded.state_dict().items():
            np.testing.assert_array_equal(v.numpy(), want[k] + round_, err_msg=k)
    from paddlenlp.transformers import AutoConfig

    from paddlenlp_ext.models.loading import load_model_streaming

    streamed, _ = load_model_streaming(
        str(tmp_path / "out"), AutoConfig.from_pretrained(str(tmp_path / "out")), "float32"
    )
    for k, v in streamed.state_dict().items():  # our streaming loader (training, predict) reads it too
        np.testing.assert_array_equal(v.numpy(), want[k] + 1, err_msg=k)
    # resuming: a fresh stage takes its own layers' tensors from the checkpoint (the trainer's loader)
    from types import SimpleNamespace

    from paddlenlp_ext.parallel.pp_sim import build_stages
    from paddlenlp_ext.training.trainer import FinetuneTrainer

    fresh = build_stages(classes("llama")[1], model_config(tiny_model_dir), 2)[1]
    FinetuneTrainer._load_full_safetensors(SimpleNamespace(model=fresh), str(tmp_path / "out"))
    for k, v in fresh.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want[k] + 1, err_msg=k)
    os.remove(tmp_path / "out" / sorted(set(index["weight_map"].values()))[-1])  # a stage-1 shard lost
    with pytest.raises((ValueError, FileNotFoundError, OSError)):
        FinetuneTrainer._load_full_safetensors(SimpleNamespace(model=fresh), str(tmp_path / "out"))
