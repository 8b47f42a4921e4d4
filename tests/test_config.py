import dataclasses
import json
import os
import subprocess
import sys

import pytest

from paddlenlp_ext.config.fields import all_fields
from paddlenlp_ext.config.parse import ConfigError, load_config, parse_overrides

from conftest import DATA_DIR, ROOT


def write(tmp_path, obj, name="cfg.json"):
    p = tmp_path / name
    p.write_text(json.dumps(obj, indent=1) if not isinstance(obj, str) else obj)
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
    return e.value.problems


def test_valid_config_types_and_derived(tmp_path, base):
    cfg = load_config(write(tmp_path, {**base, "lora": True, "lora_rank": 4}), ["--learning_rate", "1e-3", "--do_eval"])
    assert cfg.model.lora_rank == 4 and cfg.model.lora_alpha == 8  # derived: 2 x rank
    assert "lora_alpha" in cfg.derived
    assert cfg.training["learning_rate"] == 1e-3 and cfg.training["do_eval"] is True
    assert cfg.adapter_method == "lora"
    assert cfg.data.src_length == 1024 and cfg.data.max_length == 2048  # documented defaults
    assert cfg.model.neftune_noise_alpha == 5.0 and cfg.model.vera_rank == 8
    assert cfg.generate.top_k == 1 and cfg.generate.top_p == 1.0


def test_unknown_key_suggests_nearest(tmp_path, base):
    p = problems(write(tmp_path, {**base, "lora_rnak": 4}))
    assert len(p) == 1 and "unknown key 'lora_rnak'" in p[0] and "'lora_rank'" in p[0]


def test_every_problem_reported_together(tmp_path, base):
    cfg = {
        **base,
        "flash_mask": True,
        "greedy_zero_padding": True,
        "lora": True,
        "vera": True,
        "src_length": 4096,
        "lora_rank": 0,
        "learning_rate": "fast",
        "dataset_name_or_path": str(tmp_path),
        "per_device_train_batch_size": 0,
        "evaluation_strategy": "sometimes",
        "reft": True,
    }
    p = "\n".join(problems(write(tmp_path, cfg)))
    for needle in (
        "flash_mask=true needs use_flash_attention",
        "greedy_zero_padding=true needs zero_padding",
        "only one adapter method",
        "lora_rank: must be > 0",
        "learning_rate: expected a number",
        "has no train.json",
        "per_device_train_batch_size: must be > 0",
        "evaluation_strategy: must be one of",
        "reft=True is not supported yet",
    ):
        assert needle in p, needle
    assert "src_length (4096) must not exceed max_length (2048)" in p


def test_json_syntax_error_names_line(tmp_path):
    p = problems(write(tmp_path, '{\n  "lora": true,\n  "lora_rank": 8,,\n}'))
    assert ":3:" in p[0] and "invalid JSON" in p[0]


def test_duplicate_key_is_an_error(tmp_path):
    p = problems(write(tmp_path, '{"lora": true, "lora": false}'))
    assert "duplicate key 'lora'" in p[0]


def test_missing_required_and_nothing_to_do(tmp_path):
    p = "\n".join(problems(write(tmp_path, {})))
    assert "'model_name_or_path' is missing" in p and "'output_dir' is missing" in p and "nothing to do" in p


def test_override_parsing():
    assert parse_overrides(["--a", "1", "--b=x y", "--flag", "--c", "2"]) == [
        ("a", "1"),
        ("b", "x y"),
        ("flag", None),
        ("c", "2"),
    ]
    with pytest.raises(ConfigError):
        parse_overrides(["positional"])


def test_override_wrong_type(tmp_path, base):
    p = problems(write(tmp_path, base), ["--lora_rank", "four", "--lora", "maybe"])
    assert any("lora_rank: expected an integer" in x for x in p)
    assert any("lora: expected true or false" in x for x in p)


def test_training_fields_match_paddlenlp():
    """The ast-read field list equals PaddleNLP's real TrainingArguments dataclass."""
    from paddlenlp.trainer import TrainingArguments

    ours = {k: s for k, s in all_fields().items() if s.group == "training"}
    real = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    missing = set(real) - set(ours)
    assert not missing, missing
    for name in ("learning_rate", "per_device_train_batch_size", "fp16", "max_steps", "seed", "warmup_steps"):
        default = real[name].default
        assert ours[name].default == default, name
    assert ours["learning_rate"].kind == "float" and ours["max_steps"].kind == "int" and ours["fp16"].kind == "bool"


def test_cli_exits_2_fast_without_loading_paddle(tmp_path, base):
    path = write(tmp_path, {**base, "lora_rnak": 4, "src_length": 9999, "zero_padding": "yes"})
    # -X importtime lists every module the CLI imported: the config error must come before paddle loads
    # (a deterministic stand-in for "fast"; a wall-time bound would depend on the machine).
    r = subprocess.run(
        [sys.executable, "-X", "importtime", os.path.join(ROOT, "llm", "run_finetune.py"), path, "--bogus", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "paddlenlp_ext.config.parse" in imported
    assert not [m for m in imported if m.split(".")[0] in ("paddle", "paddlenlp")], "config errors must not load paddle"
    assert "4 problems" in r.stderr and "lora_rnak" in r.stderr and "bogus" in r.stderr
    # validation itself never imports paddle
    code = (
        "import sys; from paddlenlp_ext.config.parse import load_config, ConfigError\n"
        f"try: load_config({path!r})\nexcept ConfigError: pass\nprint('paddle' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_config_docs_are_current():
    from paddlenlp_ext.config.docs import render

    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        assert f.read() == render(), "docs/config.md is stale: run python llm/tools/config_docs.py"


def test_lora_path_settings_must_match_saved_adapter(tmp_path, base):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"method": "lora", "r": 8, "alpha": 16, "rslora": False, "pissa": False, "lora_plus_scale": 1.0})
    )
    ok = load_config(write(tmp_path, {**base, "lora": True, "lora_path": str(adapter)}))
    assert ok.model.lora_path == str(adapter)
    p = "\n".join(problems(write(tmp_path, {**base, "vera": True, "lora_path": str(adapter)})))
    assert "lora/vera says 'vera'" in p
    p = problems(write(tmp_path, {**base, "lora": True, "rslora": True, "lora_rank": 4, "lora_path": str(adapter)}))
    assert len(p) == 2 and "lora_rank says 4" in p[0] + p[1]


def test_generation_keys_need_eval_with_do_generation(tmp_path, base):
    p = "\n".join(problems(write(tmp_path, {**base, "top_k": 5, "save_generation_output": True})))
    assert "top_k/top_p only apply with eval_with_do_generation" in p
    assert "save_generation_output=true needs eval_with_do_generation" in p
    p = "\n".join(problems(write(tmp_path, {**base, "eval_with_do_generation": True})))
    assert "eval_with_do_generation=true needs do_eval=true" in p


def test_target_modules_alias(tmp_path, base):
    cfg = load_config(write(tmp_path, {**base, "lora": True, "target_modules": [".*q_proj"]}))
    assert cfg.model.lora_target_modules == [".*q_proj"] and "lora_target_modules" in cfg.derived
    p = problems(write(tmp_path, {**base, "lora": True, "target_modules": ["a"], "lora_target_modules": ["b"]}))
    assert "aliases but differ" in p[0]


def test_batch_padding_keys_conflict_with_zero_padding(tmp_path, base):
    p = problems(write(tmp_path, {**base, "zero_padding": True, "pad_to_multiple_of": 8}))
    assert "apply to batch padding" in p[0]


def test_dropout_keys_apply_or_fail_never_ignored(tmp_path, base):
    """Llama reads no dropout key: setting one is an error, not a silent no-op; Qwen2 reads
    attention dropout (as its attention_dropout), except in the flash attention path."""
    ps = problems(write(tmp_path, {**base, "hidden_dropout_prob": 0.1}))
    assert len(ps) == 1 and "llama models have no dropout that hidden_dropout_prob controls" in ps[0]
    ps = problems(write(tmp_path, {**base, "attention_probs_dropout_prob": 0.2}))
    assert len(ps) == 1 and "attention_probs_dropout_prob" in ps[0]
    load_config(write(tmp_path, {**base, "hidden_dropout_prob": 0.0}))  # "none" is what llama does anyway

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    cfg = load_config(write(tmp_path, {**base, "model_name_or_path": str(qwen), "attention_probs_dropout_prob": 0.2}))
    from paddlenlp_ext.models.dropout import dropout_config_updates

    assert dropout_config_updates(
        "qwen2", {"attention_probs_dropout_prob": cfg.model.attention_probs_dropout_prob, "hidden_dropout_prob": None}
    ) == {"attention_dropout": 0.2}
    ps = problems(
        write(
            tmp_path,
            {**base, "model_name_or_path": str(qwen), "attention_probs_dropout_prob": 0.2, "use_flash_attention": True},
        )
    )
    assert len(ps) == 1 and "flash attention path" in ps[0]
