"""The adapter methods beyond plain LoRA on the dense rows of our decoder, through llm/run_finetune.py.

Every family-table row built with our decoder (``Family.decoder``) and a dense MLP is picked up without
edits.  Each gets a transformers-saved fp32 checkpoint with the row's non-default knobs
(``test_decoder_cli.save_row``), then, through the CLI:

* LoRA with rsLoRA scaling, LoRA+ (B learns 16x faster) and NEFTune noise at once (each reported in
  run_summary.json's method string);
* PiSSA (A, B from the top singular triplets of W; randomized SVD);
* VeRA (lr 1: it trains only r + out scalars per layer) and LoKr (the tiny lokr config);

each with a loss that falls.  The VeRA and LoKr adapters then merge through llm/merge_lora_params.py with its
verification passing at the fp32 default tolerance (merged model == base + adapter).  One test loops over the
rows (one CLI call per row and run) and reports every failure at once.
"""

import functools
import json
import os

import pytest

from conftest import DATA_DIR, ROOT, run_jobs
from paddlenlp_ext.models.family_table import FAMILIES

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

DENSE_ROWS = [k for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp != "moe"]
CONFIG = os.path.join(ROOT, "llm", "config", "tiny")
#: run -> (config, CLI overrides, run_summary.json's method)
RUNS = {
    "rslora_loraplus_neftune": (
        "lora_argument.json",
        ("--rslora", "true", "--lora_plus_scale", "16", "--neftune", "true"),
        "lora+rslora+lora_plus_scale=16+neftune",
    ),
    "pissa": ("lora_argument.json", ("--pissa", "true", "--pissa_niter", "2"), "lora+pissa"),
    "vera": ("lora_argument.json", ("--vera", "true", "--lora", "false", "--learning_rate", "1"), "vera"),
    "lokr": ("lokr_argument.json", (), "lokr"),  # its lr 0.1
}
MERGED = ("vera", "lokr")


def _train(run, base, out, config, extra, method):
    run(
        [
            os.path.join(ROOT, "llm", "run_finetune.py"),
            os.path.join(CONFIG, config),
            "--model_name_or_path",
            base,
            "--dataset_name_or_path",
            DATA_DIR,
            "--output_dir",
            out,
            "--max_steps",
            "12",
            "--per_device_train_batch_size",
            "8",
            "--logging_steps",
            "1",
            "--do_eval",
            "false",
            "--eval_before_train",
            "false",
            "--src_length",
            "64",
            "--max_length",
            "128",
            "--warmup_steps",
            "0",
            *extra,
        ]
    )
    with open(os.path.join(out, "trainer_state.json")) as f:
        loss = [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]
    with open(os.path.join(out, "run_summary.json")) as f:
        got = json.load(f)["method"]
    assert got == method, (got, method)
    assert len(loss) == 12 and all(x == x for x in loss), loss
    assert sum(loss[-3:]) < 0.9 * sum(loss[:3]), ("the loss does not fall", loss)


def _merge(run, base, adapter, out):
    r = run(
        [
            os.path.join(ROOT, "llm", "merge_lora_params.py"),
            "--model_name_or_path",
            base,
            "--lora_path",
            adapter,
            "--merge_model_path",
            out,
            "--device",
            "cpu",
        ]
    )
    assert "verify: passed" in r.stdout, r.stdout[-1500:]


def test_rslora_loraplus_neftune_pissa_vera_lokr_train_and_merge_on_every_dense_decoder_row(tmp_path):
    from test_decoder_cli import run, save_row

    assert len(DENSE_ROWS) >= 7, DENSE_ROWS

    def job(base, out, config, extra, method, merged):
        _train(run, base, out, config, extra, method)
        if merged:
            _merge(run, base, out, merged)

    jobs = {}
    for model_type in DENSE_ROWS:
        # fp32: the merge's verification then judges the merge itself, not bf16 rounding of W + delta
        base = save_row(model_type, str(tmp_path / model_type / "base"), dtype="float32")
        for name, (config, extra, method) in RUNS.items():
            out = str(tmp_path / model_type / name)
            merged = str(tmp_path / model_type / f"{name}_merged") if name in MERGED else None
            jobs[f"{model_type} {name}"] = functools.partial(job, base, out, config, extra, method, merged)
    failures = run_jobs(jobs)
    assert not failures, json.dumps(failures, indent=1)
