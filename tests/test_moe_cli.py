"""MoE rows through llm/run_finetune.py with the router's load-balancing loss (slow).

Every decoder MoE row (family table: ``decoder`` and ``Arch.mlp == "moe"``) gets a transformers-saved
checkpoint (tests/test_decoder_cli.save_row: bf16, sharded, tokenizer.json).  LoRA with
``router_aux_loss_coef`` > 0 trains with a falling loss (and so do nf4 QLoRA and full fine-tuning); the aux loss and the per-layer expert load
are logged on their own (trainer_state.json's log_history, run_summary.json's ``moe``) and finite;
the alias gives the same run; what is not wired is refused at config time (exit 2, naming the key).
Independent CLI runs go two at a time (conftest.run_jobs), every failing row and run reported at once.
"""

import functools
import json
import math
import os

import pytest

from paddlenlp_ext.models.family_table import FAMILIES
from conftest import DATA_DIR, run_jobs, selected_params
from test_decoder_cli import LORA_CONFIG, failed, finetune, losses, save_row

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

MOE_ROWS = [k for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp == "moe"]


def _logged(out):
    with open(os.path.join(out, "trainer_state.json")) as f:
        return [h for h in json.load(f)["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def row_base(tmp_path_factory):
    """A row's transformers-saved checkpoint (bf16), built on first use and shared by this module's tests (they
    only read it)."""
    root, built = tmp_path_factory.mktemp("rows"), {}

    def get(model_type):
        if model_type not in built:
            built[model_type] = save_row(model_type, str(root / model_type))
        return built[model_type]

    return get


def _lora_with_aux(model_type, base, out):
    r = finetune(base, out, "--router_aux_loss_coef", "0.05")
    got = losses(out)
    assert len(got) == 20 and sum(got[-3:]) < 0.9 * sum(got[:3]), (model_type, got)
    logs = _logged(out)
    assert all(math.isfinite(h["aux_loss"]) and h["aux_loss"] > 0 for h in logs), logs
    n_layers = len([k for k in logs[0] if k.startswith("expert_load_max_over_mean/")])
    assert n_layers >= 1, logs[0]
    for h in logs:
        loads = [h[f"expert_load_max_over_mean/moe_layer_{i}"] for i in range(n_layers)]
        assert all(math.isfinite(v) and v >= 1.0 for v in loads), h
    assert "aux loss" in r.stdout and "expert load max/mean" in r.stdout, r.stdout[-2000:]
    with open(os.path.join(out, "run_summary.json")) as f:
        moe = json.load(f)["moe"]
    assert moe["router_aux_loss_coef"] == 0.05 and len(moe["logged"]) == 20, moe


@pytest.fixture(scope="module")
def aux_runs(request, row_base, tmp_path_factory):
    """{"<row> <run>": failure text} of the selected rows' 20-step runs with the aux loss (LoRA; nf4 and full), all
    at once, two at a time across rows, on the first test that asks."""
    root, jobs = tmp_path_factory.mktemp("aux"), {}
    for p in selected_params(request, "test_lora_with_router_aux_loss_trains_and_logs_it"):
        model_type = p["model_type"]
        jobs[f"{model_type} lora"] = functools.partial(
            _lora_with_aux, model_type, row_base(model_type), str(root / model_type / "lora")
        )
    for p in selected_params(request, "test_qlora_and_full_with_router_aux_loss_train"):
        model_type, method = p["model_type"], p["method"]
        jobs[f"{model_type} {method}"] = functools.partial(
            _method_with_aux, model_type, method, row_base(model_type), str(root / model_type / method)
        )
    return run_jobs(jobs)


@pytest.mark.parametrize("model_type", MOE_ROWS)
def test_lora_with_router_aux_loss_trains_and_logs_it(aux_runs, model_type):
    job = f"{model_type} lora"
    assert job not in aux_runs, failed({job: aux_runs[job]})


#: nf4 QLoRA (experts quantized while streaming) and full fine-tuning, each with the aux loss in the training loss
_METHODS = {
    "nf4": (("--weight_quantize_algo", "nf4"), "lora+nf4"),
    "full": (("--lora", "false", "--learning_rate", "3e-3"), "full"),
}


def _method_with_aux(model_type, method, base, out):
    extra, name = _METHODS[method]
    finetune(base, out, "--router_aux_loss_coef", "0.05", *extra)
    got = losses(out)
    assert len(got) == 20 and sum(got[-3:]) < 0.9 * sum(got[:3]), (model_type, method, got)
    logs = _logged(out)
    assert all(math.isfinite(h["aux_loss"]) and h["aux_loss"] > 0 for h in logs), (model_type, method, logs)
    with open(os.path.join(out, "run_summary.json")) as f:
        summary = json.load(f)
    assert summary["method"] == name and summary["moe"]["router_aux_loss_coef"] == 0.05, (model_type, method, summary)


@pytest.mark.parametrize("method", sorted(_METHODS))
@pytest.mark.parametrize("model_type", MOE_ROWS)
def test_qlora_and_full_with_router_aux_loss_train(aux_runs, model_type, method):
    job = f"{model_type} {method}"
    assert job not in aux_runs, failed({job: aux_runs[job]})


def _refused(base, out, extra, key):
    r = finetune(base, out, *extra, check=False)
    assert r.returncode == 2 and key in (r.stdout + r.stderr), (key, r.stdout[-2000:], r.stderr[-2000:])


def test_alias_no_coef_and_refusals(row_base, tmp_path):
    base = row_base(MOE_ROWS[0])

    def alias():
        # the alias is the same key: the same first step's aux loss
        out = str(tmp_path / "alias")
        finetune(base, out, "--moe_aux_loss_coef", "0.05", "--max_steps", "2")
        assert _logged(out)[0]["aux_loss"] > 0, _logged(out)[0]

    def no_coef():
        # no key and a checkpoint without output_router_logits: no aux loss (as transformers), nothing logged
        out = str(tmp_path / "none")
        finetune(base, out, "--max_steps", "2")
        assert "aux_loss" not in _logged(out)[0], _logged(out)[0]
        with open(os.path.join(out, "run_summary.json")) as f:
            assert "moe" not in json.load(f)

    jobs = {"alias": alias, "no coef": no_coef}
    for extra, key in (
        (("--moe_router_bias_update_rate", "0.001"), "moe_router_bias_update_rate"),  # no bias
        (("--freeze_router", "true", "--lora_target_modules", r".*mlp\.gate,.*q_proj"), "freeze_router"),
        (("--router_aux_loss_coef", "0.1", "--moe_aux_loss_coef", "0.2"), "moe_aux_loss_coef"),
        (("--tensor_parallel_degree", "2"), "tensor_parallel_degree"),
    ):
        jobs[f"refused {key}"] = functools.partial(_refused, base, str(tmp_path / key), extra, key)
    failures = run_jobs(jobs)
    assert not failures, failed(failures)


def test_moe_keys_refused_on_a_dense_model(tmp_path):
    base = save_row("ernie4_5", str(tmp_path / "base"))
    jobs = {
        key: functools.partial(_refused, base, str(tmp_path / key), (f"--{key}", value, "--lora", "false"), key)
        for key, value in (
            ("router_aux_loss_coef", "0.01"),
            ("moe_router_bias_update_rate", "0.001"),
            ("freeze_router", "true"),
        )
    }
    failures = run_jobs(jobs)
    assert not failures, failed(failures)


def _weights(directory):
    """Every tensor of a safetensors directory (float32 torch tensors)."""
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(os.path.join(str(directory), "*.safetensors")):
        out.update({k: v.float() for k, v in load_file(f).items()})
    return out


def _bias(weights, layer, prefix="ernie4_5_moe"):
    return weights[f"{prefix}.layers.{layer}.mlp.moe_statics.e_score_correction_bias"].reshape(-1)


FULL = ("--lora", "false", "--learning_rate", "3e-3")
MOE_LAYERS = (1, 3)  # tests/test_decoder_parity.KNOBS: ernie4_5_moe's MoE layers from 1 every 2


def test_bias_update_and_frozen_router_in_full_fine_tuning(row_base, tmp_path):
    """ernie4_5_moe (its router has an e_score_correction_bias), full fine-tuning with the bias update and
    freeze_router: the router weights are bit-identical to the checkpoint's, the experts moved, the bias moved
    and is saved in the weights; a resume from a step-2 checkpoint gives the same bias; the per-layer load is
    in run_summary.json.  Negative control: without freeze_router the router moves.  The negative control runs
    beside the frozen run and its resume (conftest.run_jobs)."""
    import shutil

    import torch

    base = row_base("ernie4_5_moe")
    before = _weights(base)
    run_keys = (
        *FULL,
        "--max_steps",
        "4",
        "--moe_router_bias_update_rate",
        "0.01",
        "--freeze_router",
        "true",
        "--gradient_accumulation_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--weight_decay",
        "0.1",
    )  # decoupled weight decay must not reach a frozen router either

    def frozen_and_resumed():
        out = tmp_path / "full"
        r = finetune(base, str(out), *run_keys, "--save_strategy", "steps", "--save_steps", "2")
        after = _weights(out)
        for i in MOE_LAYERS:
            hf = f"model.layers.{i}.mlp"
            # transformers stores Linear weights [out, in], ours [in, out]
            assert torch.equal(after[f"ernie4_5_moe.layers.{i}.mlp.gate.weight"], before[f"{hf}.gate.weight"].T), i
            assert not torch.equal(
                after[f"ernie4_5_moe.layers.{i}.mlp.experts.0.up_proj.weight"],
                before[f"{hf}.experts.0.up_proj.weight"].T,
            ), i
            assert not torch.equal(_bias(after, i), _bias(before, i, "model")), i
        with open(out / "run_summary.json") as f:
            moe = json.load(f)["moe"]
        assert moe["moe_router_bias_update_rate"] == 0.01 and moe["bias_updates"] == 4, moe
        assert "aux_loss" not in moe["logged"][0], moe["logged"][0]  # no aux loss asked for: the load only
        for entry in moe["logged"]:
            assert len(entry["expert_load"]) == len(MOE_LAYERS), entry
            for layer in entry["expert_load"]:
                assert len(layer["fraction"]) == 4 and abs(sum(layer["fraction"]) - 1) < 1e-3, layer
                assert layer["max_over_mean"] >= 1.0 and layer["mean"] == 0.25, layer
        assert "expert load max/mean" in r.stdout and "aux loss" not in r.stdout, r.stdout[-2000:]
        # the step-2 checkpoint holds the bias of 2 updates; resuming from it ends with the same bias
        ckpt = _weights(out / "checkpoint-2")
        assert any(not torch.equal(_bias(ckpt, i), _bias(after, i)) for i in MOE_LAYERS)
        resumed = tmp_path / "resumed"
        shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
        finetune(
            base,
            str(resumed),
            *run_keys,
            "--save_strategy",
            "steps",
            "--save_steps",
            "2",
            "--resume_from_checkpoint",
            str(resumed / "checkpoint-2"),
        )
        again = _weights(resumed)
        for i in MOE_LAYERS:
            assert torch.equal(_bias(again, i), _bias(after, i)), (i, _bias(again, i), _bias(after, i))

    def negative_control():
        # the same run without freeze_router moves the router
        free = tmp_path / "free"
        finetune(base, str(free), *FULL, "--max_steps", "1")
        moved = _weights(free)
        assert not torch.equal(
            moved["ernie4_5_moe.layers.1.mlp.gate.weight"], before["model.layers.1.mlp.gate.weight"].T
        ), "the router did not move"

    failures = run_jobs({"frozen + resumed": frozen_and_resumed, "without freeze_router": negative_control})
    assert not failures, failed(failures)


def test_lora_leaves_the_router_out_and_refusals(row_base, tmp_path):
    """LoRA's default targets never adapt the router; freeze_router with LoRA is accepted (the router is not
    trained anyway); the bias update with an adapter is refused (the adapter would not save the bias)."""
    from paddlenlp_ext.adapters import read_adapter_tensors

    base = row_base("ernie4_5_moe")

    def default_targets():
        out = tmp_path / "lora"
        finetune(base, str(out), "--max_steps", "1", "--freeze_router", "true")
        names = list(read_adapter_tensors(str(out)))
        assert any(".mlp.experts.0." in n for n in names) and not any(".mlp.gate." in n for n in names), names

    def router_named():
        # named in lora_target_modules without freeze_router, the router is adapted (the user asked)
        out = tmp_path / "router"
        finetune(base, str(out), "--max_steps", "1", "--lora_target_modules", r".*mlp\.gate,.*q_proj")
        names = list(read_adapter_tensors(str(out)))
        assert any(".mlp.gate." in n for n in names), names

    jobs = {"default targets": default_targets, "router named": router_named}
    for extra, key in (
        (("--moe_router_bias_update_rate", "0.001"), "moe_router_bias_update_rate"),
        (("--freeze_router", "true", "--lora_target_modules", r".*mlp\.gate"), "freeze_router"),
    ):
        jobs[f"refused {key}"] = functools.partial(_refused, base, str(tmp_path / key), extra, key)
    failures = run_jobs(jobs)
    assert not failures, failed(failures)


def test_cli_merge_and_peft_export_of_an_moe_lora_load_in_transformers_and_peft(tmp_path):
    """A LoRA trained by llm/run_finetune.py with the aux loss on a transformers-saved qwen3_moe (which trains on the
    decoder's MoE row; its experts adapted): llm/merge_lora_params.py --output_format hf passes its verification and loads in
    transformers, the PEFT export (llm/tools/export.py --format peft) loads in peft.PeftModel on the same base, and
    the two give the
    same logits within 1e-4 (fp32 base: the merge rounds nothing) -- the judges are transformers and peft."""
    import numpy as np
    import torch
    import transformers

    peft = pytest.importorskip("peft")
    from test_decoder_cli import run

    base = save_row("qwen3_moe", str(tmp_path / "base"), dtype="float32")
    out = str(tmp_path / "lora")
    finetune(base, out, "--max_steps", "2", "--learning_rate", "5e-2", "--router_aux_loss_coef", "0.05")
    assert any(".mlp.experts.3." in n for n in _adapter_names(out))  # the routed experts are adapted
    assert all(math.isfinite(h["aux_loss"]) and h["aux_loss"] > 0 for h in _logged(out))  # the decoder's aux loss
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = run(
        [
            os.path.join(root, "llm", "merge_lora_params.py"),
            "--model_name_or_path",
            base,
            "--lora_path",
            out,
            "--merge_model_path",
            tmp_path / "merged",
            "--output_format",
            "hf",
            "--device",
            "cpu",
        ]
    )
    assert "verify: passed" in r.stdout, r.stdout[-2000:]
    from paddlenlp_ext.export import export_peft_adapter  # llm/tools/export.py --format peft's function

    export_peft_adapter(out, str(tmp_path / "peft"), log=lambda *a: None)

    def hf(path):
        return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()

    ids = torch.tensor([[1, 17, 50, 3, 99, 42, 7, 100, 12, 5], [5, 9, 8, 7, 6, 5, 4, 3, 2, 1]])
    with torch.no_grad():
        merged = hf(str(tmp_path / "merged"))(ids).logits.numpy()
        plain = hf(base)(ids).logits.numpy()
        wrapped = peft.PeftModel.from_pretrained(hf(base), str(tmp_path / "peft")).eval()(ids).logits.numpy()
    assert np.abs(wrapped - plain).max() > 1e-2  # the trained adapter matters, so the check below can fail
    np.testing.assert_allclose(merged, wrapped, atol=1e-4, rtol=0)


def _adapter_names(out):
    from paddlenlp_ext.adapters import read_adapter_tensors

    return list(read_adapter_tensors(out))


def test_bias_update_equals_across_accumulation_and_data_parallel(row_base, tmp_path):
    """The bias update takes the counts of the whole optimizer step: batch 4 in one process, 2 x 2 gradient
    accumulation and data parallel 2 (gloo on CPU, the counts summed over the ranks) end with the same
    e_score_correction_bias on every MoE layer."""
    import glob
    import subprocess
    import sys

    import torch

    base = row_base("ernie4_5_moe")

    def run(name, procs, batch, accumulation):
        out = str(tmp_path / name)
        script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "llm", "run_finetune.py")
        args = [
            LORA_CONFIG,
            "--model_name_or_path",
            base,
            "--output_dir",
            out,
            "--dataset_name_or_path",
            DATA_DIR,
            *FULL,
            "--warmup_steps",
            "0",
            "--max_steps",
            "4",
            "--logging_steps",
            "1",
            "--do_eval",
            "false",
            "--src_length",
            "64",
            "--max_length",
            "128",
            "--per_device_train_batch_size",
            str(batch),
            "--gradient_accumulation_steps",
            str(accumulation),
            "--moe_router_bias_update_rate",
            "0.01",
        ]
        cmd = (
            [sys.executable, script, *args]
            if procs == 1
            else [
                sys.executable,
                "-m",
                "paddle.distributed.launch",
                "--nproc_per_node",
                str(procs),
                "--log_dir",
                out + "_launch",
                script,
                *args,
            ]
        )
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        logs = "".join(open(f).read()[-3000:] for f in glob.glob(out + "_launch/workerlog.*"))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:] + logs
        with open(os.path.join(out, "run_summary.json")) as f:
            assert json.load(f)["moe"]["bias_updates"] == 4
        return _weights(out)

    # one process each, two at a time; then the two-process run alone (its ranks have the two cores)
    got = {}

    def one_process(name, batch, accumulation):
        got[name] = run(name, 1, batch, accumulation)

    failures = run_jobs(
        {
            name: functools.partial(one_process, name, batch, accumulation)
            for name, batch, accumulation in (("single", 4, 1), ("accumulation", 2, 2))
        }
    )
    assert not failures, failed(failures)
    single, accumulated, parallel = got["single"], got["accumulation"], run("dp2", 2, 2, 1)
    for i in MOE_LAYERS:
        assert _bias(single, i).abs().max() > 0
        assert torch.equal(_bias(accumulated, i), _bias(single, i)), (i, _bias(accumulated, i), _bias(single, i))
        assert torch.equal(_bias(parallel, i), _bias(single, i)), (i, _bias(parallel, i), _bias(single, i))


def _short_with_aux(base, name, out):
    extra = ("--weight_quantize_algo", "nf4") if name == "nf4" else FULL
    finetune(base, out, *extra, "--router_aux_loss_coef", "0.05", "--max_steps", "3")
    logs = _logged(out)
    assert len(logs) == 3 and all(math.isfinite(h["aux_loss"]) and h["aux_loss"] > 0 for h in logs), logs
    assert all(math.isfinite(h["expert_load_max_over_mean"]) and h["expert_load_max_over_mean"] >= 1 for h in logs), (
        logs
    )
    with open(os.path.join(out, "run_summary.json")) as f:
        summary = json.load(f)
    assert summary["method"] == ("lora+nf4" if name == "nf4" else "full"), summary["method"]
    for entry in summary["moe"]["logged"]:
        for layer in entry["expert_load"]:
            assert all(math.isfinite(v) and v >= 0 for v in layer["fraction"]), layer
            assert abs(sum(layer["fraction"]) - 1) < 1e-3, layer


@pytest.fixture(scope="module")
def short_aux_runs(request, row_base, tmp_path_factory):
    """{"<row> <method>": failure text} of the selected rows' 3-step nf4 and full runs, all at once, two at a time."""
    root = tmp_path_factory.mktemp("short_aux")
    rows = [p["model_type"] for p in selected_params(request, "test_nf4_and_full_with_router_aux_loss_log_finite_load")]
    return run_jobs(
        {
            f"{model_type} {name}": functools.partial(
                _short_with_aux, row_base(model_type), name, str(root / model_type / name)
            )
            for model_type in rows
            for name in ("nf4", "full")
        }
    )


@pytest.mark.parametrize("model_type", MOE_ROWS)
def test_nf4_and_full_with_router_aux_loss_log_finite_load(short_aux_runs, model_type):
    """The other two methods of every MoE row with an aux loss (LoRA: above): nf4 QLoRA and full fine-tuning
    train and log a finite aux loss and per-layer load, in trainer_state.json and run_summary.json."""
    mine = {job: text for job, text in short_aux_runs.items() if job.split()[0] == model_type}
    assert not mine, failed(mine)


def _paddlenlp_layout_lora(model_type, base, out):
    finetune(base, out, "--router_aux_loss_coef", "0.05")
    got = losses(out)
    assert len(got) == 20 and sum(got[-3:]) < 0.9 * sum(got[:3]), (model_type, got)
    assert all(math.isfinite(h["aux_loss"]) and h["aux_loss"] > 0 for h in _logged(out)), (model_type, _logged(out))
    with open(os.path.join(out, "run_summary.json")) as f:
        layout = json.load(f)["load"]["layout"]
    assert layout == "paddlenlp", (model_type, layout)


@pytest.fixture(scope="module")
def paddlenlp_layout_runs(request, tmp_path_factory):
    """{row: failure text} of the selected rows' LoRA runs on PaddleNLP-saved checkpoints, two at a time."""
    from hf_tokenizers import build as build_tokenizer
    from test_moe_parity import save_paddlenlp_moe

    root, jobs = tmp_path_factory.mktemp("paddlenlp_layout"), {}
    for p in selected_params(request, "test_paddlenlp_layout_checkpoint_trains_with_the_aux_loss"):
        model_type = p["model_type"]
        base = str(root / model_type / "base")
        save_paddlenlp_moe(model_type, base, vocab_size=704, std=0.05)
        build_tokenizer(base, "llama3")
        jobs[model_type] = functools.partial(_paddlenlp_layout_lora, model_type, base, str(root / model_type / "lora"))
    return run_jobs(jobs)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "mixtral", "qwen2_moe"])
def test_paddlenlp_layout_checkpoint_trains_with_the_aux_loss(paddlenlp_layout_runs, model_type):
    """A checkpoint saved by PaddleNLP's own MoE class (PaddleNLP layout; its forward crashes on Paddle 3.3) trains
    on the decoder row with LoRA and the aux loss, as the transformers-layout one does."""
    assert model_type not in paddlenlp_layout_runs, failed({model_type: paddlenlp_layout_runs[model_type]})
