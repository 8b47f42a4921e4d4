"""The packing-payoff notice (config/packing_payoff.py) and its place on the configuration line."""

import doctest
import subprocess
import sys
from types import SimpleNamespace

import pytest

from paddlenlp_ext.config import packing_payoff as mod
from paddlenlp_ext.config.packing_payoff import packing_payoff


def test_docstring_examples():
    assert doctest.testmod(mod).failed == 0


def test_rule():
    assert packing_payoff(False, False, 1, 4096, on_cpu=True) is None  # packing off: nothing to say
    assert packing_payoff(True, True, 1, 512, on_cpu=True) is None  # narrow model: fixed costs, packing pays
    wide = packing_payoff(True, True, 1, 2048, on_cpu=True)
    assert "batch 1" in wide and "hidden size 2048" in wide and "flash_mask" not in wide
    both = packing_payoff(True, False, 1, 1024, on_cpu=True)
    assert "batch 1" in both and "flash_mask=false" in both and both.endswith("kept as configured")
    assert packing_payoff(True, False, 8, 64, on_cpu=True).startswith("packing: expect no speed-up")


def test_config_module_does_not_import_paddle():
    code = "import sys, paddlenlp_ext.config.packing_payoff; print('paddle' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_notice_of_a_run(monkeypatch):
    """training/reporting.py reads the run's settings and the (LoRA-wrapped) model's width; DPO gets none."""
    import paddle

    from paddlenlp_ext.training.reporting import packing_notice

    monkeypatch.setattr(paddle, "get_device", lambda: "cpu")
    cfg = SimpleNamespace(
        alignment=None, data=SimpleNamespace(zero_padding=True), model=SimpleNamespace(flash_mask=True)
    )
    args = SimpleNamespace(per_device_train_batch_size=1)
    wrapped = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(hidden_size=1024)))
    assert "hidden size 1024" in packing_notice(cfg, args, wrapped)
    assert packing_notice(SimpleNamespace(**{**vars(cfg), "alignment": object()}), args, wrapped) is None
    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:0")
    assert packing_notice(cfg, args, wrapped) is None


@pytest.mark.slow
def test_configuration_line_says_so_and_changes_nothing(tiny_model_dir, tmp_path):
    from test_e2e import run_cli, summary

    dense, out = run_cli(
        "llm/config/tiny/sft_argument.json",
        tmp_path,
        "--max_steps",
        "2",
        "--zero_padding",
        "true",
        "--do_eval",
        "false",
        "--eval_before_train",
        "false",
        name="dense",
    )
    line = next(x for x in dense.stdout.splitlines() if x.startswith("model tiny-llama"))
    assert "packing: expect no speed-up on this CPU (flash_mask=false attends over the whole packed row" in line
    assert summary(out)["data"]["train"]["packing"] != "none"  # the user's choice stands
    fm, _ = run_cli(
        "llm/config/tiny/sft_argument.json",
        tmp_path,
        "--max_steps",
        "2",
        "--zero_padding",
        "true",
        "--use_flash_attention",
        "true",
        "--flash_mask",
        "true",
        "--do_eval",
        "false",
        "--eval_before_train",
        "false",
        name="fm",
    )
    line = next(x for x in fm.stdout.splitlines() if x.startswith("model tiny-llama"))
    assert "packing:" not in line  # tiny model (hidden 64), per-document attention: packing can pay off
