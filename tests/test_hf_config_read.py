"""config.json in transformers 4.x and 5.x spelling read as one canonical config (models/hf_config_read.py),
refused (exit 2 at config time, naming the key) when it cannot be read exactly.  Pure dict tests; the
parity of the models these configs build is judged in tests/test_hf5_judge.py."""

import json
import os
import subprocess
import sys

import pytest

from conftest import DATA_DIR, ROOT
from paddlenlp_ext.models.hf_config_read import canonical_config, read_problems, sliding_layers

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
BASE = {"num_hidden_layers": 2, "max_position_embeddings": 256}


def test_llama3_in_rope_parameters_becomes_rope_theta_and_rope_scaling():
    raw = {
        "model_type": "llama",
        **BASE,
        "rope_parameters": {**LLAMA3, "rope_theta": 500000.0},
        "rope_scaling": None,
        "rope_theta": None,
        "dtype": "bfloat16",
    }
    c, p = canonical_config(raw)
    assert p == [] and c["rope_theta"] == 500000.0 and c["rope_scaling"] == LLAMA3
    assert "rope_parameters" not in c and c["torch_dtype"] == "bfloat16" and "rope_parameters" in raw
    # the 4.x spelling of the same model reads the same
    old, p = canonical_config(
        {
            "model_type": "llama",
            **BASE,
            "rope_theta": 500000.0,
            "rope_scaling": {**{k: v for k, v in LLAMA3.items() if k != "rope_type"}, "type": "llama3"},
        }
    )
    assert p == [] and old["rope_theta"] == 500000.0 and old["rope_scaling"] == LLAMA3
    # 5.x fills original_max_position_embeddings from max_position_embeddings
    no_omax = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    c, _ = canonical_config({"model_type": "llama", **BASE, "rope_parameters": {**no_omax, "rope_theta": 5e5}})
    assert c["rope_scaling"]["original_max_position_embeddings"] == 256


def test_default_rope_parameters_give_theta_and_no_scaling():
    c, p = canonical_config(
        {"model_type": "qwen2", **BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert p == [] and c["rope_theta"] == 1e6 and c["rope_scaling"] is None
    c, p = canonical_config(
        {"model_type": "qwen2", **BASE, "rope_parameters": {"rope_type": "default"}, "rope_theta": 5e4}
    )  # 5.x: the top-level theta is the default of the dict's
    assert p == [] and c["rope_theta"] == 5e4
    c, p = canonical_config({"model_type": "mistral", **BASE})  # no RoPE keys at all: untouched
    assert p == [] and "rope_theta" not in c and "rope_scaling" not in c


def test_per_layer_type_rope_is_collapsed_only_when_equal():
    lt = ["full_attention", "sliding_attention"]
    same = {t: {"rope_type": "default", "rope_theta": 1e6} for t in lt}
    c, p = canonical_config({"model_type": "qwen2", **BASE, "layer_types": lt, "rope_parameters": same})
    assert p == [] and c["rope_theta"] == 1e6 and c["layer_types"] == lt
    gemma = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    _, p = canonical_config({"model_type": "qwen2", **BASE, "layer_types": lt, "rope_parameters": gemma})
    assert len(p) == 1 and "rope_parameters gives a different RoPE per attention type" in p[0]


def test_gemma3_per_attention_type_rope_lands_on_the_local_theta_knob():
    """5.x's Gemma 3 spelling: the global RoPE (theta + scaling) and the sliding layers' own theta, which the
    row reads as rope_local_base_freq (4.x's key); a scaled local RoPE is not computed here: refused."""
    lt = ["sliding_attention", "full_attention"]
    rp = {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    c, p = canonical_config({"model_type": "gemma3_text", **BASE, "layer_types": lt, "rope_parameters": rp})
    assert p == [] and c["rope_theta"] == 1e6 and c["rope_local_base_freq"] == 1e4
    assert c["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    scaled = {**rp, "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    _, p = canonical_config({"model_type": "gemma3_text", **BASE, "layer_types": lt, "rope_parameters": scaled})
    assert len(p) == 1 and "rope_parameters.sliding_attention=" in p[0] and "rope_local_base_freq" in p[0]
    _, p = canonical_config(
        {"model_type": "gemma3_text", **BASE, "layer_types": lt, "rope_parameters": rp, "rope_local_base_freq": 5e3}
    )
    assert len(p) == 1 and "rope_local_base_freq=5000.0 and rope_parameters.sliding_attention.rope_theta" in p[0]


def test_partial_rotary_factor_inside_rope_parameters_moves_to_the_top_level_on_decoder_rows():
    """5.x keeps GLM-4's / Phi-3's partial_rotary_factor in rope_parameters; 4.x (and the decoder) read it at the top."""
    c, p = canonical_config(
        {
            "model_type": "glm4",
            **BASE,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        }
    )
    assert p == [] and c["partial_rotary_factor"] == 0.25 and c["rope_scaling"] is None
    _, p = canonical_config(
        {
            "model_type": "phi3",
            **BASE,
            "partial_rotary_factor": 0.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75},
        }
    )
    assert len(p) == 1 and "partial_rotary_factor=0.5 and rope_parameters.partial_rotary_factor=0.75 differ" in p[0]


@pytest.mark.parametrize(
    "raw, key",
    [
        (
            {"model_type": "llama", "rope_parameters": {"rope_type": "su", "rope_theta": 1e4}},
            "rope_parameters.rope_type='su'",
        ),
        (  # llama / qwen2 / qwen3 are decoder rows: the decoder computes yarn, linear, llama3, longrope
            {
                "model_type": "qwen2",
                **BASE,
                "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0},
            },
            "rope_parameters.rope_type='dynamic' is not implemented by the decoder",
        ),
        (
            {"model_type": "qwen2", "rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
            "rope_theta=10000.0 and rope_parameters.rope_theta=1000000.0 differ",
        ),
        (
            {
                "model_type": "llama",
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            },
            "both rope_scaling=",
        ),
        (
            {
                "model_type": "mistral",
                "num_hidden_layers": 2,
                "sliding_window": 64,
                "layer_types": ["full_attention", "full_attention"],
            },
            "layer_types marks no layer sliding_attention",
        ),
        ({"model_type": "qwen2", "num_hidden_layers": 2, "layer_types": ["full_attention"]}, "layer_types="),
        (
            {"model_type": "qwen", "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "rope_parameters.rope_type='linear': RoPE scaling written by transformers 5.x is read for",
        ),
        (
            {
                "model_type": "gpt_oss",
                "max_position_embeddings": 256,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "original_max_position_embeddings": 128,
                },
            },
            "yarn factor=4.0 with original_max_position_embeddings=128 and max_position_embeddings=256",
        ),
    ],
)
def test_what_cannot_be_read_exactly_is_a_problem_naming_the_key(raw, key):
    problems = read_problems(raw)
    assert problems and key in problems[0], problems


def test_yarn_saved_by_transformers5_reads_as_5x_scales_it():
    """5.x scales yarn by ``factor``; 4.55 (whose spelling the decoder reads) by max / original whenever
    original_max_position_embeddings is set, which 5.x writes (= max_position_embeddings): gpt_oss saved by 5.24
    read as 4.55 reads it had a RoPE factor of 1 (tests/test_decoder_hf5.py judges the logits)."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 1.5e5,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    }
    for omax in ({"original_max_position_embeddings": 256}, {}):  # as 5.x saves it; as a user may write it
        c, p = canonical_config({"model_type": "gpt_oss", **BASE, "rope_parameters": {**yarn, **omax}})
        assert p == [] and c["rope_theta"] == 1.5e5
        assert c["rope_scaling"] == {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        }
    # a real gpt-oss: factor == max / original, so both readings agree and the key stays
    c, p = canonical_config(
        {
            "model_type": "gpt_oss",
            **BASE,
            "rope_parameters": {**yarn, "factor": 32.0, "original_max_position_embeddings": 8},
        }
    )
    assert p == [] and c["rope_scaling"]["original_max_position_embeddings"] == 8
    # factor null: 5.x takes the ratio, as 4.55 does
    c, p = canonical_config(
        {
            "model_type": "gpt_oss",
            **BASE,
            "rope_parameters": {**yarn, "factor": None, "original_max_position_embeddings": 64},
        }
    )
    assert (
        p == [] and c["rope_scaling"]["factor"] == 4.0 and c["rope_scaling"]["original_max_position_embeddings"] == 64
    )


def test_other_families_keep_paddlenlp_own_rope_keys():
    """Families outside the transformers-layout four keep whatever rope_scaling PaddleNLP's model reads."""
    raw = {"model_type": "chatglm_v2", "rope_scaling": {"type": "ntk", "factor": 2.0}, "rope_ratio": 1.0}
    assert read_problems(raw) == []
    c, _ = canonical_config({"model_type": "gemma", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert c["rope_theta"] == 1e4 and c["rope_scaling"] is None


def test_sliding_layers_as_transformers_reads_them():
    q = {"model_type": "qwen2", "num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 8}
    assert sliding_layers({**q, "max_window_layers": 1}) == [False, True]
    assert sliding_layers({**q, "max_window_layers": 2}) == [False, False]
    assert sliding_layers({**q, "layer_types": ["sliding_attention", "full_attention"]}) == [True, False]
    assert sliding_layers({**q, "use_sliding_window": False}) is None
    m = {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 8}
    assert sliding_layers(m) == [True, True]
    assert sliding_layers({**m, "layer_types": ["full_attention", "sliding_attention"]}) == [False, True]


def test_unsupported_rope_type_exits_2_at_config_time_naming_the_key(tiny_model_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for name in os.listdir(tiny_model_dir):
        os.symlink(os.path.join(tiny_model_dir, name), d / name)
    cfg = json.load(open(os.path.join(tiny_model_dir, "config.json")))
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}  # not computed by the decoder
    os.remove(d / "config.json")
    (d / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "llm", "run_finetune.py"),
            os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json"),
            "--model_name_or_path",
            str(d),
            "--dataset_name_or_path",
            DATA_DIR,
            "--output_dir",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "rope_parameters.rope_type='dynamic'" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


def test_the_decoder_rows_llama_qwen2_qwen3_read_the_rope_scalings_it_computes():
    """Since llama, qwen2 and qwen3 moved onto our decoder, yarn, linear, llama3 and longrope scalings and partial
    rotary are computed (tests/test_decoder_parity.py judges the decoder's RoPE against transformers), not refused as
    PaddleNLP's classes had to."""
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    for model_type in ("llama", "qwen2", "qwen3"):
        assert read_problems({"model_type": model_type, **BASE, "rope_parameters": yarn}) == []
        assert (
            read_problems({"model_type": model_type, **BASE, "rope_scaling": {"type": "linear", "factor": 2.0}}) == []
        )
