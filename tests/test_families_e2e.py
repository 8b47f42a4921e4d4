"""The per-family matrix through the real CLIs, on tiny random models built with PaddleNLP's own classes.

The CLIs' ``main(argv)`` run in this process (one Paddle import for the whole matrix); the refusals run
as subprocesses (they exit 2 before Paddle is imported).

For each family the table (paddlenlp_ext/models/family_table.py) marks trainable: LoRA with zero padding
and full fine-tuning train (loss falls), QLoRA (nf4) trains where the table allows it,
``llm/tools/check_packing.py`` is exact where packing is allowed, the LoRA adapter merges
(``llm/merge_lora_params.py``, with its own verification) and the merged model predicts.  Every cell the
table refuses exits 2 before loading, with the family and the key in the message.
docs/models.md names these tests.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from family_models import build_family_model

from paddlenlp_ext.models.family_table import row

pytestmark = pytest.mark.slow

FAMILIES = ["mistral", "gemma", "chatglm_v2", "qwen", "gpt", "opt", "codegen"]
DPO_CFG = os.path.join(ROOT, "llm", "config", "tiny", "dpo_lora_argument.json")
LORA_CFG = os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json")
SFT_CFG = os.path.join(ROOT, "llm", "config", "tiny", "sft_argument.json")
FAST = [
    "--max_steps",
    "12",
    "--per_device_train_batch_size",
    "8",
    "--logging_steps",
    "2",
    "--eval_before_train",
    "false",
    "--do_eval",
    "false",
    "--src_length",
    "96",
    "--max_length",
    "128",
]
#: Linear layers inside the 2 decoder blocks of each tiny model (q/k/v/o + 3 MLP; fused qkv + dense + 2 MLP; ...)
DECODER_LINEARS = {"mistral": 14, "gemma": 14, "chatglm_v2": 8, "qwen": 10, "gpt": 12, "opt": 12, "codegen": 8}
#: gpt also evaluates: its criterion must skip our -100 label padding (the run sets config.ignore_index)
#: codegen also evaluates: it shifts labels itself, so the run computes its eval loss without handing it labels
EXTRA = {"gpt": ("--do_eval", "true"), "codegen": ("--do_eval", "true")}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def cli(script, *args, timeout=120):
    """The script as a subprocess (for the exit-2 refusals)."""
    cmd = [sys.executable, os.path.join(ROOT, *script.split("/")), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=timeout)


_SCRIPTS = {}


def main(script, *args) -> int:
    """``script``'s ``main(argv)`` in this process; its exit code (a SystemExit's code included)."""
    if script not in _SCRIPTS:
        spec = importlib.util.spec_from_file_location(script.replace("/", "_")[:-3], os.path.join(ROOT, script))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _SCRIPTS[script] = mod
    try:
        return _SCRIPTS[script].main([str(a) for a in args])
    except SystemExit as e:
        return e.code


def losses(out):
    """Logged training losses of a run (train.log's step lines via trainer_state.json)."""
    with open(os.path.join(out, "trainer_state.json"), encoding="utf-8") as f:
        return [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("families")
    return {f: build_family_model(f, str(base / f), tiny_model_dir) for f in FAMILIES + ["bloom"]}


@pytest.fixture(scope="module")
def lora_runs(models, tmp_path_factory):
    """family -> output dir of a LoRA run (zero padding where the family packs), trained once per module."""
    base, cache = tmp_path_factory.mktemp("family_lora"), {}

    def get(family):
        if family not in cache:
            out = base / family
            packing = row(family).supports("packing")
            rc = main(
                "llm/run_finetune.py",
                LORA_CFG,
                "--model_name_or_path",
                models[family],
                "--output_dir",
                out,
                "--zero_padding",
                str(packing).lower(),
                *FAST,
                *EXTRA.get(family, ()),
            )
            assert rc == 0, family
            cache[family] = str(out)
        return cache[family]

    return get


def assert_learns(out):
    loss = losses(out)
    assert len(loss) >= 5 and min(loss[-2:]) < loss[0], loss


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_trains(lora_runs, family):
    out = lora_runs(family)
    assert_learns(out)
    if family in EXTRA:
        with open(os.path.join(out, "eval_results.json"), encoding="utf-8") as f:
            # evaluated on the same kind of data, so close to the last training loss (a label shifted twice, or the
            # padding scored, would be far off)
            assert abs(json.load(f)["eval_loss"] - losses(out)[-1]) < 1.0
    from safetensors import safe_open

    with safe_open(os.path.join(out, "adapter_model.safetensors"), "np") as f:
        adapted = {k.rsplit(".", 1)[0] for k in f.keys()}
    # every decoder Linear of the family's 2 blocks, nothing outside them (embeddings, lm_head)
    assert len(adapted) == DECODER_LINEARS[family], sorted(adapted)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_finetune_trains(models, tmp_path, family):
    assert (
        main(
            "llm/run_finetune.py",
            SFT_CFG,
            "--model_name_or_path",
            models[family],
            "--output_dir",
            tmp_path / "o",
            *FAST,
        )
        == 0
    )
    assert_learns(tmp_path / "o")


@pytest.mark.parametrize("family", [f for f in FAMILIES if row(f).supports("qlora")])
def test_qlora_nf4_trains(models, tmp_path, family):
    assert (
        main(
            "llm/run_finetune.py",
            LORA_CFG,
            "--model_name_or_path",
            models[family],
            "--output_dir",
            tmp_path / "o",
            "--weight_quantize_algo",
            "nf4",
            *FAST,
        )
        == 0
    )
    assert_learns(tmp_path / "o")
    with open(tmp_path / "o" / "run_summary.json", encoding="utf-8") as f:
        assert json.load(f)["method"] == "lora+nf4"


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_dpo_trains_and_packs_exactly(models, capsys, tmp_path, family):
    """LoRA DPO learns the preferences (packed pair rows, dense mask) and check_packing's pair mode is exact."""
    args = (DPO_CFG, "--model_name_or_path", models[family], "--max_seq_len", "128", "--max_prompt_len", "64")
    if not row(family).supports("dpo"):
        r = cli("llm/run_dpo.py", *args, "--output_dir", tmp_path / "o")
        assert r.returncode == 2 and f"{family} models" in r.stderr and "llm/run_finetune.py" in r.stderr, r.stderr[
            -2000:
        ]
        return
    assert main("llm/run_dpo.py", *args, "--output_dir", tmp_path / "o", "--max_steps", "12", "--do_eval", "false") == 0
    logs = [h for h in json.loads((tmp_path / "o" / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert abs(logs[0]["loss"] - 0.6931) < 1e-3 and logs[-1]["loss"] < 0.5, logs  # starts at log 2, learns
    capsys.readouterr()
    assert main("llm/tools/check_packing.py", *args, "--check_examples", "8") == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{") :])["ok"]


@pytest.mark.parametrize("family", FAMILIES)
def test_check_packing_exact_or_refused(models, capsys, family):
    args = (
        LORA_CFG,
        "--model_name_or_path",
        models[family],
        "--zero_padding",
        "true",
        "--src_length",
        "96",
        "--max_length",
        "256",
        "--check_examples",
        "12",
    )
    if row(family).supports("packing"):
        capsys.readouterr()
        assert main("llm/tools/check_packing.py", *args) == 0
        out = capsys.readouterr().out
        result = json.loads(out[out.index("{") :])
        assert result["ok"] and result["packs"] < result["examples"], result  # several examples share a row
        assert result["loss_abs_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-5, result
        if row(family).supports("flash_attention"):  # its use_flash_attention path honours the dense mask too
            assert main("llm/tools/check_packing.py", *args, "--use_flash_attention", "true") == 0
            out = capsys.readouterr().out
            result = json.loads(out[out.index("{") :])
            assert result["ok"] and result["grad_max_rel_diff"] <= 1e-5, result
    else:
        r = cli("llm/tools/check_packing.py", *args)
        assert r.returncode == 2 and "set zero_padding=false" in r.stderr and family in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_then_predict(models, lora_runs, tmp_path, family):
    merged = tmp_path / "merged"
    assert (
        main(
            "llm/merge_lora_params.py",
            "--model_name_or_path",
            models[family],
            "--lora_path",
            lora_runs(family),
            "--merge_model_path",
            merged,
        )
        == 0
    )  # with its verification (logits vs adapter)
    prompts = tmp_path / "prompts.json"
    prompts.write_text('{"src": "Hello"}\n{"src": "Write an ad for a dress"}\n', encoding="utf-8")
    assert (
        main(
            "llm/predict/predictor.py",
            "--model_name_or_path",
            merged,
            "--data_file",
            prompts,
            "--output_file",
            tmp_path / "pred.json",
            "--decode_strategy",
            "greedy_search",
            "--src_length",
            "32",
            "--max_length",
            "40",
        )
        == 0
    )
    rows = [json.loads(x) for x in (tmp_path / "pred.json").read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 2 and all(isinstance(x["output"], str) for x in rows)


@pytest.mark.parametrize(
    "family, args, needle",
    [
        (
            "qwen",
            ["--use_flash_attention", "true", "--flash_mask", "true", "--zero_padding", "true"],
            "set flash_mask=false",
        ),
        ("opt", ["--zero_padding", "true"], "set zero_padding=false"),
        ("gpt", ["--tensor_parallel_degree", "2"], "set tensor_parallel_degree=1"),
        ("bloom", [], "bloom blocks pass no gradient"),
        ("codegen", ["--zero_padding", "true"], "codegen models take no position_ids"),
    ],
)
def test_refused_cells_exit_2_before_loading(models, tmp_path, family, args, needle):
    r = cli(
        "llm/run_finetune.py", LORA_CFG, "--model_name_or_path", models[family], "--output_dir", tmp_path / "o", *args
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and "nothing was loaded" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
