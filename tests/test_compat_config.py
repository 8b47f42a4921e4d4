"""PaddleNLP config compatibility that is decided before anything loads (config/parse, config/environment)
and the llm-meta keys' effect on the model config (training/run.apply_llm_meta)."""

import glob
import json
import os
import shutil
from types import SimpleNamespace

import pytest

from paddlenlp_ext.config.environment import paddle_build
from paddlenlp_ext.config.parse import ConfigError, load_config

from conftest import DATA_DIR, ROOT

CPU_BUILD = not paddle_build()["cuda"]


def edit_json(path, **changes):
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**d, **changes}, f)


@pytest.fixture(scope="module")
def paddlenlp_class_model(tmp_path_factory, tiny_model_dir):
    """A tiny qwen (v1) model: a family still on PaddleNLP's classes, which read recompute_granularity and
    recompute_use_reentrant themselves (our decoder's rows refuse all but full, non-reentrant recompute)."""
    from family_models import build_family_model

    return build_family_model("qwen", str(tmp_path_factory.mktemp("qwen") / "qwen"), tiny_model_dir)


def write(tmp_path, obj, name="cfg.json"):
    p = tmp_path / name
    p.write_text(json.dumps(obj, indent=1))
    return str(p)


@pytest.fixture
def base(tmp_path, tiny_model_dir):
    return {
        "model_name_or_path": tiny_model_dir,
        "dataset_name_or_path": DATA_DIR,
        "output_dir": str(tmp_path / "out"),
        "do_train": True,
    }


def problems(path, overrides=()):
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return "\n".join(e.value.problems)


def test_src_length_equal_to_max_length_is_allowed(tmp_path, base):
    cfg = load_config(write(tmp_path, {**base, "src_length": 512, "max_length": 512}))
    assert cfg.data.src_length == cfg.data.max_length == 512
    assert "must not exceed max_length" in problems(write(tmp_path, {**base, "src_length": 513, "max_length": 512}))


def test_intokens_is_the_old_name_of_zero_padding(tmp_path, base):
    cfg = load_config(write(tmp_path, {**base, "intokens": True}))
    assert cfg.data.zero_padding is True and "zero_padding" in cfg.derived
    p = problems(write(tmp_path, {**base, "intokens": True, "zero_padding": False}))
    assert "keep only zero_padding" in p


def test_benchmark_mode_does_what_paddlenlp_does_and_says_so(tmp_path, base):
    cfg = load_config(
        write(
            tmp_path,
            {
                **base,
                "benchmark": True,
                "do_eval": True,
                "load_best_model_at_end": True,
                "save_strategy": "steps",
                "max_steps": 3,
            },
        )
    )
    t = cfg.training
    assert (t["do_eval"], t["load_best_model_at_end"], t["save_strategy"], t["evaluation_strategy"]) == (
        False,
        False,
        "no",
        "no",
    )
    assert {"do_eval", "load_best_model_at_end", "save_strategy"} <= set(cfg.derived)
    cfg = load_config(write(tmp_path, {**base, "autotuner_benchmark": True, "max_steps": 100}))
    assert cfg.training["max_steps"] == 5


def test_dpo_keys_point_to_preference_training(tmp_path, base):
    p = problems(write(tmp_path, {**base, "beta": 0.1, "loss_type": "sigmoid", "max_prompt_len": 64}))
    for key in ("'beta'", "'loss_type'", "'max_prompt_len'"):
        assert f"{key} is a DPO (preference training) key" in p
    assert "unknown key" not in p


def test_unsupported_device_and_precision_reported_with_other_problems(tmp_path, base):
    p = problems(write(tmp_path, {**base, "device": "npu", "lora_rank": 0, "lora": True}))
    assert "device='npu': paddlenlp_ext runs on cpu and gpu" in p and "lora_rank: must be > 0" in p
    assert "is not a Paddle device" in problems(write(tmp_path, {**base, "device": "tpu"}))
    p = problems(write(tmp_path, {**base, "device": "cpu", "bf16": True, "fp16_opt_level": "O2"}))
    assert "bf16=true with fp16_opt_level=O2 needs a GPU" in p
    p = problems(write(tmp_path, {**base, "device": "cpu", "fp16": True}))
    assert "fp16=true needs a GPU" in p
    # bf16 autocast (O1) keeps fp32 weights and runs on CPU
    assert load_config(write(tmp_path, {**base, "device": "cpu", "bf16": True, "fp16_opt_level": "O1"}))


@pytest.mark.skipif(not CPU_BUILD, reason="checks the CPU build's refusal")
def test_explicit_gpu_on_a_cpu_build_is_refused(tmp_path, base):
    assert "is a CPU build" in problems(write(tmp_path, {**base, "device": "gpu"}))
    assert "bf16=true with fp16_opt_level=O2" in problems(
        write(tmp_path, {**base, "bf16": True, "fp16_opt_level": "O2"})
    )


def test_parallel_degree_larger_than_the_launch_says_how_to_launch(tmp_path, base, monkeypatch):
    monkeypatch.delenv("PADDLE_TRAINERS_NUM", raising=False)
    p = problems(write(tmp_path, {**base, "tensor_parallel_degree": 2}))
    assert "tensor_parallel_degree=2 needs a multiple of 2 processes but this run has 1" in p
    assert "paddle.distributed.launch --nproc_per_node 2" in p
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    cfg = load_config(write(tmp_path, {**base, "tensor_parallel_degree": 2}))
    assert cfg.training["tensor_parallel_degree"] == 2
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "3")
    assert "multiple of 2 processes but this run has 3" in problems(
        write(tmp_path, {**base, "tensor_parallel_degree": 2})
    )


def test_llm_meta_keys_are_accepted_and_pipeline_ones_refused(tmp_path, base, paddlenlp_class_model):
    meta = {"recompute": True, "recompute_granularity": "core_attn", "recompute_use_reentrant": True}
    decoder = problems(write(tmp_path, {**base, **meta}))  # llama: our decoder recomputes whole layers
    assert "recompute_granularity 'core_attn' is not implemented on llama" in decoder
    assert "recompute_use_reentrant=true is not supported on llama" in decoder
    cfg = load_config(
        write(
            tmp_path,
            {
                **base,
                "model_name_or_path": paddlenlp_class_model,
                "recompute": True,
                "recompute_granularity": "core_attn",
                "recompute_use_reentrant": True,
                "use_fused_rms_norm": True,
                "use_fused_rope": True,
            },
        ),
        ["--no_recompute_layers", "0,1"],
    )
    assert cfg.training["no_recompute_layers"] == [0, 1]
    assert cfg.training["recompute_granularity"] == "core_attn"
    p = problems(
        write(tmp_path, {**base, "virtual_pp_degree": 2, "pp_recompute_interval": 2, "recompute_granularity": "half"})
    )
    assert "virtual_pp_degree=2 needs pipeline_parallel_degree > 2" in p
    assert "pp_recompute_interval=2 is not read by PaddleNLP's Llama/Qwen2 pipeline models" in p
    assert "recompute_granularity: must be one of full, full_attn, core_attn" in p


def test_llm_meta_applied_to_the_model_config_or_noticed(tmp_path, base, capsys, paddlenlp_class_model):
    """recompute keys always reach the model config (of a family on PaddleNLP's classes, which reads
    recompute_granularity); GPU fusions only on GPU (else a notice); GPT-only keys only get a notice.  No key is
    dropped without a word."""
    from paddlenlp_ext.training.llm_meta import apply_llm_meta, llm_meta_notices

    cfg = load_config(
        write(
            tmp_path,
            {
                **base,
                "model_name_or_path": paddlenlp_class_model,
                "recompute": True,
                "recompute_granularity": "full_attn",
                "use_fused_rms_norm": True,
                "use_fused_linear": True,
            },
        )
    )
    on_cpu = SimpleNamespace()
    applied = apply_llm_meta(cfg, on_cpu, on_gpu=False)
    assert on_cpu.recompute_granularity == "full_attn" and applied["recompute_granularity"] == "full_attn"
    assert not hasattr(on_cpu, "use_fused_rms_norm") and not hasattr(on_cpu, "use_fused_linear")
    notices = llm_meta_notices(cfg, on_gpu=False)
    assert len(notices) == 2, notices
    assert notices[0].startswith("notice: use_fused_rms_norm=True is a GPU-only fused kernel")
    assert notices[1].startswith("notice: use_fused_linear=True is read by PaddleNLP's GPT models only")
    on_gpu = SimpleNamespace()
    apply_llm_meta(cfg, on_gpu, on_gpu=True)
    assert on_gpu.use_fused_rms_norm is True and not hasattr(on_gpu, "use_fused_linear")
    assert llm_meta_notices(cfg, on_gpu=True) == [notices[1]]
    assert capsys.readouterr().err == ""  # the console lines are the run's (training/model_build.py)


def test_report_to_none_on_the_command_line_is_paddlenlps_none(tmp_path, base):
    """``--report_to none`` is PaddleNLP's "no integration", not null (null is its default: VisualDL)."""
    path = write(tmp_path, base)
    assert load_config(path, ["--report_to", "none"]).training["report_to"] == ["none"]
    assert load_config(path, ["--report_to", "null"]).training.get("report_to") is None
    assert load_config(path, ["--report_to", "visualdl"]).training["report_to"] == ["visualdl"]


DPO_DATA_DIR = os.path.join(ROOT, "llm", "data", "dpo_tiny")
KTO_DATA_DIR = os.path.join(ROOT, "llm", "data", "kto_tiny")


def zoo_configs():
    return sorted(glob.glob(os.path.join(ROOT, "llm", "config", "*", "*.json")))


@pytest.mark.parametrize("path", zoo_configs(), ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "llm", "config")))
def test_config_zoo_validates(tmp_path, tiny_model_dir, path, monkeypatch):
    """Every shipped config parses and passes the cross checks (GPU precision switched off on a CPU build,
    as a CPU user must; launched with as many processes as its parallel degrees ask; the method's
    adapter config builds)."""
    raw = json.load(open(path))
    monkeypatch.setenv(
        "PADDLE_TRAINERS_NUM", str(raw.get("tensor_parallel_degree", 1) * raw.get("pipeline_parallel_degree", 1))
    )
    # llm/run_dpo.py / llm/run_kto.py / llm/run_grpo.py / llm/run_reward.py configs: their keys (load_config modes "dpo", "kto", "grpo")
    mode = next((m for m in ("dpo", "kto", "grpo", "ppo", "reward") if os.path.basename(path).startswith(m)), "sft")
    dpo = mode != "sft"
    pref_data = KTO_DATA_DIR if mode == "kto" else DPO_DATA_DIR
    data = (
        ["--train_dataset_path", pref_data, "--dev_dataset_path", pref_data]
        if dpo
        else ["--dataset_name_or_path", DATA_DIR]
    )
    if mode in ("grpo", "ppo"):  # prompts only (GRPO and PPO have no dev set)
        data = ["--train_dataset_path", os.path.join(ROOT, "llm", "data", "grpo_tiny")]
    model_dir = tiny_model_dir
    tp = int(raw.get("tensor_parallel_degree", 1) or 1)
    if tp > 1 and 2 % tp:  # the hub models these configs name split their 32 (8) kv heads; the tiny one has 2
        model_dir = str(tmp_path / "model")
        shutil.copytree(tiny_model_dir, model_dir)
        edit_json(os.path.join(model_dir, "config.json"), num_key_value_heads=4)
    overrides = ["--model_name_or_path", model_dir, *data, "--output_dir", str(tmp_path)]
    if CPU_BUILD and (raw.get("bf16") or raw.get("fp16")):
        overrides += ["--bf16", "false", "--fp16", "false"]
    for key in ("lora_path", "prefix_path", "lokr_path"):
        if raw.get(key):
            overrides += [f"--{key}", "none"]
    cfg = load_config(path, overrides, mode=mode)
    assert cfg.training["do_train"] or cfg.training.get("do_eval")


#: llm/config/<dir> -> the model_type of the hub model its configs name (transformers layout, read by our loaders)
ZOO_FAMILIES = {
    "ernie4_5": ("ernie4_5", "baidu/ERNIE-4.5-0.3B-PT"),
    "gemma3": ("gemma3_text", "google/gemma-3-1b-it"),
    "phi3": ("phi3", "microsoft/Phi-3-mini-4k-instruct"),
    "qwen3": ("qwen3", "Qwen/Qwen3-0.6B"),
}


@pytest.mark.parametrize(
    "path",
    [p for p in zoo_configs() if os.path.basename(os.path.dirname(p)) in ZOO_FAMILIES],
    ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "llm", "config")),
)
def test_family_zoo_configs_validate_against_their_family(tmp_path, path, monkeypatch):
    """The family configs name the hub model (as PaddleNLP's do) and pass the family table's checks for its
    model_type: a tiny transformers-saved config.json of that family stands in for the hub download."""
    transformers = pytest.importorskip("transformers")
    raw = json.load(open(path))
    model_type, hub = ZOO_FAMILIES[os.path.basename(os.path.dirname(path))]
    assert raw["model_name_or_path"] == hub
    model_dir = tmp_path / "model"
    transformers.AutoConfig.for_model(
        model_type,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,  # the hub models' kv heads divide tensor_parallel_degree=4 (qwen3/sft_argument.json)
        max_position_embeddings=8192,
    ).save_pretrained(str(model_dir))
    monkeypatch.setenv(
        "PADDLE_TRAINERS_NUM", str(raw.get("tensor_parallel_degree", 1) * raw.get("pipeline_parallel_degree", 1))
    )
    mode = "dpo" if os.path.basename(path).startswith("dpo") else "sft"
    data = (
        ["--train_dataset_path", DPO_DATA_DIR, "--dev_dataset_path", DPO_DATA_DIR]
        if mode == "dpo"
        else ["--dataset_name_or_path", DATA_DIR]
    )
    overrides = ["--model_name_or_path", str(model_dir), *data, "--output_dir", str(tmp_path / "out")]
    if CPU_BUILD and (raw.get("bf16") or raw.get("fp16")):
        overrides += ["--bf16", "false", "--fp16", "false"]
    cfg = load_config(path, overrides, mode=mode)
    assert cfg.training["do_train"]
