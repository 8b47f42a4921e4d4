"""Checkpoints saved by transformers 5.x through llm/predict/predictor.py: 20 greedy tokens equal to
transformers 5.24's ``generate``, and a RoPE we do not compute refused with exit 2 naming the key.

transformers 5.24 (its own venv, tests/hf5_judge.py) builds, saves and re-saves the tokenizer of each
directory, so config.json and tokenizer_config.json are in 5.x's spelling."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from hf5_judge import judge
from hf_models import TINY
from test_hf5_judge import CASES, NAMES

pytestmark = pytest.mark.slow

PREDICT = os.path.join(ROOT, "llm", "predict", "predictor.py")
TOKENIZER_STYLE = {"llama": "llama3", "qwen2": "qwen2", "mistral": "llama3", "qwen3": "qwen2"}
PROMPTS = ["type#shirt*color#red", "你好，世界"]
NEW = 20


def run(cmd):
    return subprocess.run([sys.executable, *map(str, cmd)], capture_output=True, text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """case -> a transformers 5.x directory: weights, config.json and a tokenizer.json-only tokenizer."""
    from hf_tokenizers import build

    root = tmp_path_factory.mktemp("hf5e2e")
    jobs, out = [], {}
    for case in ("llama", "qwen2", "qwen3", "mistral"):
        family, kw5, _ = CASES[case]
        d, tok = str(root / case), str(root / f"{case}_tok4")
        build(tok, TOKENIZER_STYLE[family])
        jobs.append(
            [
                "save",
                dict(
                    config_class=f"{NAMES[family]}Config",
                    model_class=f"{NAMES[family]}ForCausalLM",
                    config={**TINY, **kw5, "vocab_size": 704},
                    out_dir=d,
                ),
            ]
        )
        jobs.append(["tokenizer", dict(src=tok, dst=d, texts=[])])
        out[case] = d
    judge("batch", str(root), jobs=jobs)
    return out


def our_prompts(model_dir, data_file, max_length):
    """The prompt ids llm/predict/predictor.py builds (its own code), and its tokenizer and eos ids."""
    from paddlenlp_ext.predict.inputs import read_prompts
    from paddlenlp_ext.predict.options import PredictOptions, check_options
    from paddlenlp_ext.predict.run import build_prompts
    from paddlenlp_ext.predict.session import load_tokenizer

    opts, problems, _ = check_options(
        PredictOptions(
            model_name_or_path=model_dir,
            data_file=data_file,
            src_length=max_length // 2,
            max_length=max_length,
            decode_strategy="greedy_search",
            device="cpu",
        )
    )
    assert not problems, problems
    tokenizer, use_template = load_tokenizer(opts)
    return [p.ids for p in build_prompts(read_prompts(data_file), tokenizer, opts, use_template)], tokenizer


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "mistral"])
def test_predictor_greedy_tokens_equal_transformers5(dirs, case, tmp_path):
    import numpy as np

    from paddlenlp_ext.predict.run import decode

    d = dirs[case]
    assert json.load(open(os.path.join(d, "config.json")))["transformers_version"].startswith("5.")
    data = tmp_path / "prompts.json"
    data.write_text("".join(json.dumps({"src": s}, ensure_ascii=False) + "\n" for s in PROMPTS), encoding="utf-8")
    ids, tokenizer = our_prompts(d, str(data), 64)
    # every prompt gets exactly NEW tokens: one predictor run per prompt with max_length = len(prompt) + NEW
    np.save(tmp_path / "ids.npy", np.zeros((1, 4), dtype=np.int64))
    eos = [tokenizer.eos_token_id]
    jobs = [
        [
            "run",
            dict(
                model_dir=d,
                ids=str(tmp_path / "ids.npy"),
                logits_out=str(tmp_path / f"l{i}.npy"),
                prompt=p,
                max_new_tokens=NEW,
                eos=eos,
            ),
        ]
        for i, p in enumerate(ids)
    ]
    want = judge("batch", str(tmp_path), jobs=jobs)
    produced_all = 0
    for i, (src, p) in enumerate(zip(PROMPTS, ids)):
        one = tmp_path / f"p{i}.json"
        one.write_text(json.dumps({"src": src}, ensure_ascii=False) + "\n", encoding="utf-8")
        out = tmp_path / f"o{i}.json"
        r = run(
            [
                PREDICT,
                "--model_name_or_path",
                d,
                "--data_file",
                one,
                "--output_file",
                out,
                "--decode_strategy",
                "greedy_search",
                "--src_length",
                str(len(p)),
                "--max_length",
                str(len(p) + NEW),
                "--device",
                "cpu",
            ]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(out.read_text(encoding="utf-8").splitlines()[0])["output"]
        greedy = want[i]["greedy"]
        greedy = greedy[: greedy.index(eos[0])] if eos[0] in greedy else greedy
        produced_all += len(greedy) == NEW
        assert got == decode(tokenizer, greedy), (case, src)
    assert produced_all  # at least one prompt ran the full 20 tokens (no early eos)


def test_unsupported_rope_type_in_rope_parameters_exits_2_before_loading(dirs, tmp_path):
    import shutil

    # dynamic NTK scaling changes with the sequence length; the decoder computes default, linear, llama3,
    # yarn and longrope (yarn on this qwen2 trains: tests/test_hf_checkpoint.py), not this one
    d = tmp_path / "dynamic"
    shutil.copytree(dirs["qwen2"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    data = tmp_path / "p.json"
    data.write_text(json.dumps({"src": "hi"}) + "\n")
    r = run(
        [
            PREDICT,
            "--model_name_or_path",
            d,
            "--data_file",
            data,
            "--output_file",
            tmp_path / "o.json",
            "--src_length",
            "16",
            "--max_length",
            "32",
            "--device",
            "cpu",
        ]
    )
    assert r.returncode == 2 and "rope_parameters.rope_type='dynamic'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o.json").exists()
