"""Our decoder as pipeline stages (models/decoder/pipe.py): PP=2 equals one process on every dense decoder row.

As tests/test_pp_sim.py does for PaddleNLP's Llama/Qwen2 pipes: the stage models of ``pipe_class_for(row)``
are built in one process (``parallel.pp_sim.build_stages``), load the single model's state dict by the plain
names, and run one micro-batch with detached activations ("sent") and back-propagated activation gradients
("received"); the last stage applies our PipelineCriterion.  The loss (1e-5) and every gradient -- every weight
for full fine-tuning, every adapter tensor for LoRA -- equal the single model's ``global_token_loss`` with the
same N.  With tied embeddings the first stage's table and the last stage's head are two copies of one weight:
fleet all-reduces their gradients (``allreduce_shared_weight_gradients``), so their sum must be the single
model's embedding gradient.  Rows come from the family table (a new dense decoder row is tested without edits).
"""

import copy

import numpy as np
import paddle
import pytest

transformers = pytest.importorskip("transformers")

from test_decoder_tp import build, randomize  # noqa: E402
from test_pp_sim import batch  # noqa: E402

from paddlenlp_ext.models.family_table import FAMILIES  # noqa: E402

ROWS = [k for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp == "dense"]
LAYERS = 4


def stages_of(model_type, n, virtual=1, method="full", seed=0, recompute=False):
    from paddlenlp_ext.adapters import AdapterConfig, adapter_state_dict, apply_adapters, load_adapter_state_dict
    from paddlenlp_ext.models.decoder.pipe import pipe_class_for
    from paddlenlp_ext.adapters.pp_stage import prepare_stage_for_adapters
    from paddlenlp_ext.parallel.pp_sim import build_stages

    single = build(model_type, num_hidden_layers=LAYERS)
    randomize(single, seed)
    plain = {k: v.numpy() for k, v in single.state_dict().items()}
    config = copy.deepcopy(single.config)
    config.virtual_pp_degree = virtual
    config.recompute = recompute  # read by the stages' layers (the single model keeps its activations)
    parts = build_stages(pipe_class_for(model_type), config, n)
    for stage in parts:
        missing, unexpected = stage.set_state_dict({k: paddle.to_tensor(v) for k, v in plain.items()})
        assert not missing, missing
    if method == "lora":
        cfg = AdapterConfig(target_modules=list(FAMILIES[model_type].targets), r=4, alpha=8)
        apply_adapters(single, cfg)
        rng = np.random.default_rng(7)
        state = {
            k: (rng.standard_normal(v.shape) * 0.1).astype("float32") for k, v in adapter_state_dict(single).items()
        }
        load_adapter_state_dict(single, state)
        for stage in parts:
            apply_adapters(stage, AdapterConfig.from_dict(cfg.to_dict()), layer_names=prepare_stage_for_adapters(stage))
            load_adapter_state_dict(stage, state)
    return single, parts


def grads(model, method):
    from paddlenlp_ext.adapters.api import iter_adapter_layers

    if method == "full":
        return {k: v.grad.numpy() for k, v in model.state_dict().items() if v.grad is not None}
    # an MoE expert that no token chose in the batch has no gradient (on one device and on its stage alike)
    return {
        f"{n}.{s}": getattr(l, s).grad.numpy()
        for n, l in iter_adapter_layers(model)
        for s in l.state_suffixes
        if getattr(l, s).grad is not None
    }


def compare(single, parts, kind, method, model_type):
    from paddlenlp_ext.integrations.flashmask import cpu_flashmask
    from paddlenlp_ext.parallel.pp_sim import run_pipeline
    from paddlenlp_ext.training.loss import global_token_loss
    from paddlenlp_ext.training.pp_step import PipelineCriterion

    inputs, first, labels, n = batch(kind, single.config.vocab_size)
    n_global = n + 17
    with cpu_flashmask():
        ref = global_token_loss(single, {**inputs, "labels": labels}, n_global, 2, 3)
        ref.backward()
        loss = run_pipeline(parts, first, (labels, paddle.to_tensor(n_global)), PipelineCriterion(2, 3))
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
    want, got = grads(single, method), {}
    embed = f"{model_type}.embed_tokens.weight"
    for stage in parts:
        for k, g in grads(stage, method).items():
            if single.config.tie_word_embeddings and k in (embed, "lm_head.weight"):
                got[embed] = got.get(embed, 0) + g  # two copies of one weight: fleet all-reduces their gradients
                got["lm_head.weight"] = got[embed]
                continue
            assert k not in got, f"two stages hold {k}"
            got[k] = g
    assert set(got) == set(want) and want
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=max(1e-6, 2e-6 * np.abs(want[k]).max()), err_msg=k)
    assert max(float(np.abs(g).max()) for g in want.values()) > 1e-4  # the comparison can fail
    return want


@pytest.mark.parametrize("method,kind", [("full", "padded"), ("lora", "packed_flash")])
@pytest.mark.parametrize("model_type", ROWS)
def test_two_stages_equal_one_process(model_type, method, kind):
    single, parts = stages_of(model_type, 2, method=method)
    per_stage = [sorted({n.split(".")[2] for n in p.state_dict() if ".layers." in n}) for p in parts]
    assert sum(len(s) for s in per_stage) == LAYERS and all(per_stage)  # each stage holds only its layers
    compare(single, parts, kind, method, model_type)


@pytest.mark.parametrize("stages,virtual,kind", [(4, 1, "packed_dense"), (2, 2, "padded")])
def test_four_stages_and_virtual_chunks(stages, virtual, kind):
    model_type = (
        next(r for r in ROWS if FAMILIES[r].arch.fused_qkv)
        if any(FAMILIES[r].arch.fused_qkv for r in ROWS)
        else ROWS[0]
    )
    single, parts = stages_of(model_type, stages, virtual, method="lora")
    compare(single, parts, kind, "lora", model_type)


def test_recompute_on_the_stages_gives_the_same_gradients():
    single, parts = stages_of(ROWS[0], 2, recompute=True)
    assert all(p.training and p.config.recompute for p in parts)
    compare(single, parts, "padded", "full", ROWS[0])


def test_negative_control_a_stage_with_another_weight_fails():
    model_type = ROWS[0]
    single, parts = stages_of(model_type, 2)
    last = parts[-1]
    name = next(k for k in last.state_dict() if ".layers." in k and k.endswith("weight"))
    p = last.state_dict()[name]
    with paddle.no_grad():
        p.set_value(p + 0.05)
    with pytest.raises(AssertionError):
        compare(single, parts, "padded", "full", model_type)


def test_tied_embedding_copies_alone_do_not_match():
    """Negative control for the shared weight: without the all-reduce (each copy's own gradient) the comparison
    fails, so the sum above is what makes it pass."""
    tied = [r for r in ROWS if build(r).config.tie_word_embeddings]
    if not tied:
        pytest.skip("no tied row")
    single, parts = stages_of(tied[0], 2)
    from paddlenlp_ext.integrations.flashmask import cpu_flashmask
    from paddlenlp_ext.parallel.pp_sim import run_pipeline
    from paddlenlp_ext.training.loss import global_token_loss
    from paddlenlp_ext.training.pp_step import PipelineCriterion

    inputs, first, labels, n = batch("padded", single.config.vocab_size)
    with cpu_flashmask():
        global_token_loss(single, {**inputs, "labels": labels}, n, 1, 1).backward()
        run_pipeline(parts, first, (labels, paddle.to_tensor(n)), PipelineCriterion(1, 1))
    embed = f"{tied[0]}.embed_tokens.weight"
    want = single.state_dict()[embed].grad.numpy()
    first_copy = parts[0].state_dict()[embed].grad.numpy()
    assert np.abs(first_copy - want).max() > 1e-3 * np.abs(want).max()


def _tied_and_untied():
    tied = [r for r in ROWS if build(r).config.tie_word_embeddings]
    untied = [r for r in ROWS if not build(r).config.tie_word_embeddings]
    return tied[:1] + untied[:1]


@pytest.mark.parametrize("model_type", _tied_and_untied())
def test_stages_stream_a_transformers_checkpoint_and_save_one_single_device_checkpoint(model_type, tmp_path):
    """A transformers-layout checkpoint (saved by transformers itself) streams into each stage by the plain names
    (a tied head copies the table); the stages' full fine-tuning save is one checkpoint our single-device loader
    reads back to the same weights."""
    import json

    import torch
    from test_decoder_parity import BASE, KNOBS

    from paddlenlp_ext.integrations.paddlenlp_pipe import pipeline_stage_construction
    from paddlenlp_ext.models.decoder import classes_for
    from paddlenlp_ext.models.decoder.pipe import pipe_class_for
    from paddlenlp_ext.models.loading import load_model_streaming
    from paddlenlp_ext.adapters.pp_stage import attach_pipeline_group, save_stage_weights
    from paddlenlp_ext.parallel.pp_sim import SimulatedPipelineGroup, run_stages_in_threads

    hf_cfg = transformers.AutoConfig.for_model(
        model_type, **{**BASE, **KNOBS.get(model_type, {}), "num_hidden_layers": LAYERS}
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    hf.save_pretrained(str(tmp_path / "hf"))
    config_cls, _, lm_cls = classes_for(model_type)
    single = load_model_streaming(
        str(tmp_path / "hf"), config_cls.from_pretrained(str(tmp_path / "hf")), "float32", model_class=lm_cls
    )[0]
    want = {k: v.numpy() for k, v in single.state_dict().items()}
    parts = []
    for s in range(2):
        with pipeline_stage_construction(2, s):
            parts.append(
                load_model_streaming(
                    str(tmp_path / "hf"),
                    config_cls.from_pretrained(str(tmp_path / "hf")),
                    "float32",
                    model_class=pipe_class_for(model_type),
                )[0]
            )
    seen = set()
    for stage in parts:
        for k, v in stage.state_dict().items():
            np.testing.assert_array_equal(v.numpy(), want[k], err_msg=k)
            seen.add(k)
    assert seen == set(want)
    group = SimulatedPipelineGroup(2)
    for s, stage in enumerate(parts):
        attach_pipeline_group(stage, group.view(s))
    run_stages_in_threads(2, lambda s: save_stage_weights(parts[s], str(tmp_path / "out")))
    assert json.load(open(tmp_path / "out" / "config.json"))["architectures"] == [lm_cls.__name__]
    config = config_cls.from_pretrained(str(tmp_path / "out"))
    back = load_model_streaming(str(tmp_path / "out"), config, "float32", model_class=lm_cls)[0]
    for k, v in back.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want[k], err_msg=k)


def test_a_run_builds_and_wires_its_decoder_stage(tmp_path):
    """What build_model does under pipeline_parallel_degree 2 on the last rank, for a decoder row: our stage class
    streamed from a transformers-layout checkpoint, our inputs and criterion, the pipeline group, adapters by the
    plain names."""
    from types import SimpleNamespace

    import torch
    from test_decoder_parity import BASE, KNOBS

    from paddlenlp_ext.adapters import AdapterConfig, apply_adapters
    from paddlenlp_ext.adapters.api import iter_adapter_layers
    from paddlenlp_ext.integrations.paddlenlp_pipe import pipeline_stage_construction
    from paddlenlp_ext.models.decoder.pipe import DecoderForCausalLMPipe
    from paddlenlp_ext.models.model_config import load_model_config
    from paddlenlp_ext.training.model_build import load_pipeline_stage, prepare_pipeline_stage
    from paddlenlp_ext.training.pp_step import PipelineCriterion

    model_type = ROWS[-1]
    hf_cfg = transformers.AutoConfig.for_model(
        model_type, **{**BASE, **KNOBS.get(model_type, {}), "num_hidden_layers": LAYERS}
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(str(tmp_path))
    from paddlenlp_ext.models.registration import register_decoder

    register_decoder()  # as load_model does: our rows known to PaddleNLP's AutoConfig
    config = load_model_config(str(tmp_path), dtype="float32")
    config.seq_length = 64
    args = SimpleNamespace(pipeline_parallel_degree=2, dataset_world_size=1, gradient_accumulation_steps=2)
    with pipeline_stage_construction(2, 1):
        stage = load_pipeline_stage(
            SimpleNamespace(continue_training=True, model_name_or_path=str(tmp_path)), config, "float32", args, "c.json"
        )
        names = prepare_pipeline_stage(stage, args)
    assert isinstance(stage, DecoderForCausalLMPipe) and isinstance(stage._loss_fn[0], PipelineCriterion)
    assert any(k.startswith(f"{model_type}.layers.{LAYERS - 1}.") for k in stage.state_dict())
    assert not any(k.startswith(f"{model_type}.layers.0.") for k in stage.state_dict())
    apply_adapters(stage, AdapterConfig(method="lora", r=4, alpha=8), layer_names=names)
    assert {n.split(".")[2] for n, _ in iter_adapter_layers(stage)} == {str(LAYERS // 2), str(LAYERS - 1)}


def test_config_accepts_pipeline_on_dense_rows_and_on_moe_rows_without_the_aux_loss(tmp_path):
    """MoE rows: pipeline stages without the aux loss (tests/test_moe_parallel.py); with it, refused."""
    from test_decoder_tp import _config_problems

    for model_type in ROWS:
        assert _config_problems(tmp_path, model_type, "--pipeline_parallel_degree", "2", "--lora", "true") == []
        assert _config_problems(tmp_path, model_type, "--pipeline_parallel_degree", "2") == []
    moe = [k for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp == "moe"]
    for model_type in moe[:1]:
        assert _config_problems(tmp_path, model_type, "--pipeline_parallel_degree", "2", "--lora", "true") == []
        found = _config_problems(
            tmp_path, model_type, "--pipeline_parallel_degree", "2", "--lora", "true", "--router_aux_loss_coef", "0.01"
        )
        assert any("load-balancing loss on" in p and "set router_aux_loss_coef=0" in p for p in found), found
