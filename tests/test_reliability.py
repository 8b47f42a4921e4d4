"""Runs that survive bad files, interruptions and failed writes (docs/reliability.md).

Fast tests: file encodings, exit codes, config checks of output_dir and resume, checkpoint
rotation / publishing, and in-process Trainer runs on the tiny model (resume totals, SIGTERM,
a write failure).  The CLI runs (kill -9, SIGTERM of the real script) are in
test_reliability_e2e.py.
"""

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import DATA_DIR, ROOT

from paddlenlp_ext.config.parse import ConfigError, load_config
from paddlenlp_ext.data.reader import DataError, read_examples, read_utf8_lines

GBK_LINE = '{"src": "你好", "tgt": "世界"}\n'
LATIN1_LINE = '{"src": "café", "tgt": "crème brûlée"}\n'
GOOD = '{"src": "a", "tgt": "b"}\n'


def write_bytes(tmp_path, name, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


@pytest.mark.parametrize(
    "module",
    [
        "paddlenlp_ext.data.reader",
        "paddlenlp_ext.config.resume",
        "paddlenlp_ext.config.checkpoints",
        "paddlenlp_ext.training.resume",
    ],
)
def test_docstring_examples(module):
    import doctest
    import importlib

    res = doctest.testmod(importlib.import_module(module), verbose=False)
    assert res.attempted >= 1 and res.failed == 0


# ------------------------------------------------------------------ file encodings
@pytest.mark.parametrize(
    "encoding,line,guess,offset",
    [
        ("gbk", GBK_LINE, "gbk", len(GOOD) + 9),  # 9 = len('{"src": "'): the first byte of 你
        ("latin-1", LATIN1_LINE, "latin1", len(GOOD) + 12),  # the é of café
    ],
)
def test_sft_data_not_utf8_names_file_line_offset_and_iconv(tmp_path, encoding, line, guess, offset):
    path = write_bytes(tmp_path, "train.json", (GOOD + line).encode(encoding))
    with pytest.raises(DataError) as e:
        read_examples([path])
    msg = str(e.value)
    assert f"{path}:2: not UTF-8" in msg and f"byte offset {offset} of the file" in msg, msg
    assert f"iconv -f {guess} -t utf-8 {path} > {path}.utf8 && mv {path}.utf8 {path}" in msg, msg


def test_utf8_bom_is_accepted_and_stripped(tmp_path):
    path = write_bytes(tmp_path, "train.json", b"\xef\xbb\xbf" + (GOOD + '{"src": "q", "tgt": "é"}\n').encode())
    examples = read_examples([path])
    assert [(e.src, e.tgt, e.origin) for e in examples] == [(["a"], ["b"], f"{path}:1"), (["q"], ["é"], f"{path}:2")]


def test_utf16_file_is_refused_with_its_encoding(tmp_path):
    path = write_bytes(tmp_path, "train.json", GOOD.encode("utf-16"))
    with pytest.raises(DataError, match=r"train.json:1: the file is UTF-16 .* iconv -f utf-16 -t utf-8"):
        read_examples([path])


def test_shared_line_reader_for_other_inputs(tmp_path):
    """read_utf8_lines is the helper the predictor's input reader uses too."""
    path = write_bytes(tmp_path, "prompts.txt", b"\xef\xbb\xbfhello\nw\xc3\xb6rld")
    assert list(read_utf8_lines(path)) == [(1, "hello\n"), (2, "wörld")]
    with pytest.raises(DataError, match="cannot read the file"):
        list(read_utf8_lines(str(tmp_path / "missing.txt")))


def _pref_line(prompt):
    return json.dumps({"src": prompt, "tgt": [], "response": ["good", "bad"], "sort": [1, 0]}, ensure_ascii=False)


@pytest.mark.parametrize("encoding,guess", [("gbk", "gbk"), ("latin-1", "latin1")])
def test_preference_data_not_utf8(tmp_path, encoding, guess):
    from paddlenlp_ext.dpo.data import read_preference_files

    text = _pref_line("q") + "\n" + _pref_line("你好" if encoding == "gbk" else "café") + "\n"
    path = write_bytes(tmp_path, "train.json", text.encode(encoding))
    with pytest.raises(DataError) as e:
        read_preference_files([path])
    assert f"{path}:2: not UTF-8" in str(e.value) and f"iconv -f {guess} -t utf-8" in str(e.value)


def test_preference_data_with_bom(tmp_path):
    from paddlenlp_ext.dpo.data import read_preference_files

    path = write_bytes(tmp_path, "train.json", b"\xef\xbb\xbf" + (_pref_line("q") + "\n").encode())
    (ex,) = read_preference_files([path])
    assert ex.src == ["q"] and ex.chosen == "good" and ex.origin == f"{path}:1"


def _stream(files):
    from paddlenlp_ext.data.streaming import StreamingPackedDataset

    def tokenize(ex):
        ids = [len(ex.src[0]), len(ex.tgt[0])]
        return {"input_ids": ids, "labels": ids}, False, 0

    return StreamingPackedDataset(files, tokenize, 8, 0, greedy=False, group_size=2, seed=0, packed=False)


def test_lazy_stream_reads_bom_and_refuses_gbk(tmp_path):
    bom = write_bytes(tmp_path, "bom.json", b"\xef\xbb\xbf" + (GOOD * 2).encode())
    rows = iter(_stream([bom]))
    assert [next(rows)["input_ids"] for _ in range(2)] == [[1, 1], [1, 1]]
    gbk = write_bytes(tmp_path, "gbk.json", (GOOD + GBK_LINE).encode("gbk"))
    with pytest.raises(DataError, match=r"gbk.json:2: not UTF-8: byte 0xc4 at byte offset 34 .* iconv -f gbk"):
        list(zip(range(10), _stream([gbk])))


def test_empty_target_is_an_error_naming_the_line(tmp_path):
    """Nothing to learn from a line is bad input (never dropped silently), like a missing key."""
    path = write_bytes(tmp_path, "train.json", (GOOD + '{"src": "a", "tgt": ""}\n{"src": "a", "tgt": []}\n').encode())
    with pytest.raises(DataError) as e:
        read_examples([path])
    assert f"{path}:2: empty target" in str(e.value) and f"{path}:3: 'tgt' must be" in str(e.value)


def test_config_file_encodings(tmp_path, tiny_model_dir):
    cfg = {
        "model_name_or_path": tiny_model_dir,
        "dataset_name_or_path": DATA_DIR,
        "output_dir": str(tmp_path / "o"),
        "do_train": True,
    }
    bom = write_bytes(tmp_path, "bom.json", b"\xef\xbb\xbf" + json.dumps(cfg).encode())
    assert load_config(bom).training["output_dir"] == str(tmp_path / "o")
    gbk = write_bytes(
        tmp_path, "gbk.json", json.dumps({**cfg, "logging_dir": "日志"}, ensure_ascii=False).encode("gbk")
    )
    with pytest.raises(ConfigError, match=r"gbk.json:1: not UTF-8: .* iconv -f gbk"):
        load_config(gbk)


# ------------------------------------------------------------------ exit codes
def test_exit_code_mapping():
    from paddlenlp_ext.cli.common import run_or_exit_code
    from paddlenlp_ext.training.errors import SaveError, TrainingInterrupted

    def raises(e):
        def run(cfg):
            raise e

        return run

    assert run_or_exit_code(lambda cfg: {"summary": 1}, None) == 0
    assert run_or_exit_code(lambda cfg, tool: 1, None, {}) == 1  # a tool's own verdict
    assert run_or_exit_code(raises(ConfigError(["bad key"])), None) == 2
    assert run_or_exit_code(raises(DataError(["f:3: missing key 'tgt'"])), None) == 2
    assert run_or_exit_code(raises(SaveError("disk full")), None) == 1
    assert run_or_exit_code(raises(TrainingInterrupted(signal.SIGTERM, "o/checkpoint-3", "python x")), None) == 143
    assert run_or_exit_code(raises(TrainingInterrupted(signal.SIGINT, "o/checkpoint-3", "python x")), None) == 130
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback (Python exits 1)
        run_or_exit_code(raises(ZeroDivisionError()), None)


def test_launched_workers_exit_without_teardown(monkeypatch, capsys):
    """Under the launcher (PADDLE_TRAINERS_NUM > 1) the script's code leaves through os._exit after a
    flush; alone, it is returned to sys.exit as before."""
    import types

    from paddlenlp_ext.cli import common

    runner = types.ModuleType("fake_runner_for_exit")
    runner.run = lambda cfg: print("ran") or {"summary": 1}
    monkeypatch.setitem(sys.modules, "fake_runner_for_exit", runner)
    monkeypatch.setattr(common, "config_or_exit", lambda argv, usage, mode: None)
    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.delenv("PADDLE_TRAINERS_NUM", raising=False)
    assert common.run_config_script([], "usage", "sft", "fake_runner_for_exit") == 0 and exits == []
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    with pytest.raises(SystemExit):
        common.run_config_script([], "usage", "sft", "fake_runner_for_exit")
    assert exits == [0] and capsys.readouterr().out == "ran\nran\n"
    runner.run = lambda cfg: (_ for _ in ()).throw(ConfigError(["bad key"]))
    with pytest.raises(SystemExit):
        common.run_config_script([], "usage", "sft", "fake_runner_for_exit")
    assert exits == [0, 2]


def test_output_dir_that_is_a_file_exits_2_before_loading(tmp_path, tiny_model_dir):
    (tmp_path / "taken").write_text("not a directory")
    for out in ("taken", "taken/run"):
        r = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "llm", "run_finetune.py"),
                os.path.join(ROOT, "llm/config/tiny/lora_argument.json"),
                "--output_dir",
                str(tmp_path / out),
                "--model_name_or_path",
                tiny_model_dir,
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert r.returncode == 2, r.stderr
        assert "nothing was loaded" in r.stderr and "Traceback" not in r.stderr
        assert ("is an existing file, not a directory" if out == "taken" else "is a file, not a directory") in r.stderr


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write anywhere")
def test_output_dir_not_writable(tmp_path):
    from paddlenlp_ext.config.resume import output_dir_problems

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert "permission denied" in output_dir_problems(str(ro / "run"), "cfg")[0]
    finally:
        ro.chmod(0o700)


# ------------------------------------------------------------------ resume checks (config, no paddle)
def fake_checkpoint(out, step, complete=True, settings=None):
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    if complete:
        (d / "CHECKPOINT_COMPLETE").write_text(f"global_step {step}\n")
    if settings is not None:
        (d / "resolved_config.json").write_text(json.dumps({"resume_settings": settings}))
    return d


@pytest.fixture
def cfg_file(tmp_path, tiny_model_dir):
    cfg = {
        "model_name_or_path": tiny_model_dir,
        "dataset_name_or_path": DATA_DIR,
        "output_dir": str(tmp_path / "o"),
        "do_train": True,
        "max_length": 64,
        "src_length": 32,
        "lora": True,
    }
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def test_resume_true_takes_the_newest_complete_checkpoint(tmp_path, cfg_file):
    out = tmp_path / "o"
    fake_checkpoint(out, 10)
    fake_checkpoint(out, 15, complete=False)
    (out / ".saving-checkpoint-20").mkdir()  # a staging directory is never a candidate
    cfg = load_config(cfg_file, ["--resume_from_checkpoint", "true"])
    assert cfg.training["resume_from_checkpoint"] == str(out / "checkpoint-10")
    assert (
        "skipped, cut short while being written: " + str(out / "checkpoint-15") in cfg.derived["resume_from_checkpoint"]
    )
    assert load_config(cfg_file, ["--resume_from_checkpoint"]).training["resume_from_checkpoint"] == str(
        out / "checkpoint-10"
    )  # a bare flag means true


def test_resume_true_without_complete_checkpoint_and_explicit_incomplete_one(tmp_path, cfg_file):
    fake_checkpoint(tmp_path / "o", 15, complete=False)
    with pytest.raises(ConfigError, match="holds no complete checkpoint-N directory"):
        load_config(cfg_file, ["--resume_from_checkpoint", "true"])
    with pytest.raises(ConfigError, match="is incomplete .*no CHECKPOINT_COMPLETE"):
        load_config(cfg_file, ["--resume_from_checkpoint", str(tmp_path / "o" / "checkpoint-15")])


def test_resume_with_changed_settings_is_refused_listing_the_keys(tmp_path, cfg_file):
    first = load_config(cfg_file)
    saved = first.to_dict()["resume_settings"]
    assert saved["max_length"] == 64 and saved["seed"] == 42 and saved["lora_alpha"] == 16
    ckpt = fake_checkpoint(tmp_path / "o", 10, settings=saved)
    assert load_config(cfg_file, ["--resume_from_checkpoint", str(ckpt)]).training["resume_from_checkpoint"] == str(
        ckpt
    )  # same settings (a relative and an absolute model path are the same setting)
    with pytest.raises(ConfigError) as e:
        load_config(
            cfg_file,
            ["--resume_from_checkpoint", str(ckpt), "--max_length", "128", "--seed", "7", "--learning_rate", "1e-4"],
        )
    (msg,) = e.value.problems
    assert "max_length: checkpoint 64, now 128" in msg and "seed: checkpoint 42, now 7" in msg
    assert "learning_rate" not in msg  # may change on a resume


# ------------------------------------------------------------------ checkpoints on disk
def test_save_total_limit_counts_complete_checkpoints_only(tmp_path):
    from paddlenlp_ext.training.resume import rotate_checkpoints

    out = tmp_path / "o"
    fake_checkpoint(out, 2)
    fake_checkpoint(out, 4, complete=False)
    fake_checkpoint(out, 6, complete=False)
    assert rotate_checkpoints(str(out), 1) == []  # the only complete checkpoint stays
    fake_checkpoint(out, 8)
    fake_checkpoint(out, 10)
    assert rotate_checkpoints(str(out), 2, best=str(out / "checkpoint-2")) == [str(out / "checkpoint-8")]
    assert sorted(os.listdir(out)) == ["checkpoint-10", "checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_publish_replaces_whole_and_stale_staging_is_cleaned(tmp_path):
    from paddlenlp_ext.training.resume import clean_stale_staging, publish_checkpoint, staging_root

    out = tmp_path / "o"
    old = fake_checkpoint(out, 4)
    (old / "old.bin").write_text("old")
    root = staging_root(str(old))
    new = fake_checkpoint(tmp_path / "o" / os.path.basename(root), 4)
    (new / "new.bin").write_text("new")
    publish_checkpoint(str(new), str(old))
    assert sorted(os.listdir(out)) == ["checkpoint-4"] and sorted(os.listdir(old)) == ["CHECKPOINT_COMPLETE", "new.bin"]
    (out / ".saving-checkpoint-6" / "checkpoint-6").mkdir(parents=True)  # killed while saving
    os.rename(old, out / ".replaced-checkpoint-4")  # killed between the two renames
    notes = clean_stale_staging(str(out))
    assert sorted(os.listdir(out)) == ["checkpoint-4"] and len(notes) == 2


def test_resume_command_replaces_the_resume_key():
    from paddlenlp_ext.training.resume import resume_command

    argv = ["llm/run_dpo.py", "c.json", "--resume_from_checkpoint", "true", "--output_dir", "my out"]
    assert (
        resume_command("my out/checkpoint-7", argv, python="python")
        == "python llm/run_dpo.py c.json --output_dir 'my out' --resume_from_checkpoint 'my out/checkpoint-7'"
    )


def test_second_signal_exits_at_once(monkeypatch, capsys):
    from paddlenlp_ext.training import signals

    exits = []
    monkeypatch.setattr(signals.os, "_exit", exits.append)
    request = signals.StopRequest()
    previous = signal.getsignal(signal.SIGTERM)
    with signals.stop_on_signals(request):
        handler = signal.getsignal(signal.SIGTERM)
        handler(signal.SIGTERM, None)
        assert request.signum == signal.SIGTERM and exits == []
        handler(signal.SIGINT, None)
        assert exits == [130]
    assert signal.getsignal(signal.SIGTERM) is previous  # restored after training
    assert "send SIGTERM again to exit at once" in capsys.readouterr().err


# ------------------------------------------------------------------ in-process training on the tiny model
def build_trainer(out, tiny_model_dir, max_steps=6, save_steps=3, **extra):
    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM, AutoTokenizer

    from paddlenlp_ext.adapters import AdapterConfig, apply_adapters
    from paddlenlp_ext.data.collate import PaddingCollator
    from paddlenlp_ext.data.tokenize import tokenize_examples
    from paddlenlp_ext.training.training_args import TrainingArguments
    from paddlenlp_ext.training.trainer import FinetuneTrainer

    paddle.seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = AdapterConfig(method="lora", r=4, alpha=8)
    apply_adapters(model, cfg)
    feats, _ = tokenize_examples(read_examples([f"{DATA_DIR}/dev.json"]), tok, 32, 64, False)
    args = TrainingArguments(
        output_dir=str(out),
        learning_rate=1e-2,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        report_to="none",
        logging_steps=1,
        save_strategy="steps",
        save_steps=save_steps,
        disable_tqdm=True,
        seed=42,
        **extra,
    )
    return FinetuneTrainer(
        model=model,
        args=args,
        train_dataset=feats,
        tokenizer=tok,
        data_collator=PaddingCollator(tok.pad_token_id),
        adapter_config=cfg,
    )


def fresh_names():
    """Parameter and optimizer-state names restart (as in a new process), so a second model in this
    process can load the first one's optimizer checkpoint."""
    import paddle

    return paddle.utils.unique_name.guard()


def losses(trainer):
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("full") / "o"
    with fresh_names():
        trainer = build_trainer(out_dir, tiny_model_dir)
        out = trainer.train()
    return out.training_loss, losses(trainer), trainer.trained_tokens, out_dir


def test_resume_continues_loss_sum_log_history_and_counters(tiny_model_dir, tmp_path, uninterrupted):
    """What a kill after checkpoint-3 leaves (checkpoint-3, a cut-short checkpoint-5), resumed with True."""
    import shutil

    train_loss, full_losses, tokens, full_dir = uninterrupted
    shutil.copytree(full_dir / "checkpoint-3", tmp_path / "o" / "checkpoint-3")
    fake_checkpoint(tmp_path / "o", 5, complete=False)
    totals = json.loads((tmp_path / "o" / "checkpoint-3" / "run_totals.json").read_text())
    assert totals["global_step"] == 3 and 0 < totals["counters"]["trained_tokens"] < tokens
    with fresh_names():
        resumed = build_trainer(tmp_path / "o", tiny_model_dir)
        out = resumed.train(resume_from_checkpoint=True)  # the newest complete checkpoint: checkpoint-3
    assert losses(resumed) == full_losses  # steps 1-3 from the checkpoint, 4-6 trained again: bit for bit
    assert out.training_loss == pytest.approx(train_loss, rel=1e-12)  # not (loss of 4-6) / 6
    assert out.metrics["train_loss"] == out.training_loss
    assert resumed.trained_tokens == tokens and resumed.train_time_s >= resumed.train_time_before > 0


def test_sigterm_saves_the_current_step_and_resumes_exactly(tiny_model_dir, tmp_path, uninterrupted):
    from paddlenlp.trainer import TrainerCallback

    from paddlenlp_ext.training.errors import TrainingInterrupted

    class SignalAtStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 3:  # during step 4, between the scheduled saves (3 and 6)
                os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    with fresh_names(), pytest.raises(TrainingInterrupted) as e:
        trainer = build_trainer(tmp_path / "o", tiny_model_dir)
        trainer.add_callback(SignalAtStep())
        trainer.train()
    assert e.value.checkpoint == str(tmp_path / "o" / "checkpoint-4") and e.value.exit_code == 143
    assert e.value.command.endswith(f"--resume_from_checkpoint {tmp_path / 'o' / 'checkpoint-4'}")
    assert signal.getsignal(signal.SIGTERM) is previous
    assert (tmp_path / "o" / "checkpoint-4" / "CHECKPOINT_COMPLETE").exists()
    with fresh_names():
        resumed = build_trainer(tmp_path / "o", tiny_model_dir)
        out = resumed.train(resume_from_checkpoint=str(tmp_path / "o" / "checkpoint-4"))
    assert losses(resumed) == uninterrupted[1] and out.training_loss == pytest.approx(uninterrupted[0], rel=1e-12)


def test_failed_write_keeps_the_previous_checkpoint(tiny_model_dir, tmp_path, monkeypatch, uninterrupted):
    """An OSError (disk full) injected into the weights writer while checkpoint-6 is written: a clear
    SaveError, checkpoint-3 complete (save_total_limit=1 did not remove it) and loadable, nothing half-written."""
    import paddlenlp_ext.adapters as adapter_api
    from paddlenlp_ext.training.errors import SaveError

    real_save = adapter_api.save_adapter

    def disk_full(model, config, directory):
        real_save(model, config, directory)  # the files are there, partly...
        if "checkpoint-6" in directory or "checkpoint" not in directory:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(directory, "optimizer.pdopt"))

    monkeypatch.setattr(adapter_api, "save_adapter", disk_full)
    out = tmp_path / "o"
    with fresh_names(), pytest.raises(SaveError) as e:
        trainer = build_trainer(out, tiny_model_dir, save_total_limit=1)
        trainer.train()
    msg = str(e.value)
    assert "could not write checkpoint" in msg and "No space left on device" in msg and "errno 28" in msg
    assert f"The previous checkpoint {out / 'checkpoint-3'} is complete and intact" in msg
    assert f"--resume_from_checkpoint {out / 'checkpoint-3'}" in msg
    assert sorted(os.listdir(out)) == ["checkpoint-3"]  # no checkpoint-6, no staging directory
    (out / "adapter_model.safetensors").write_bytes(b"earlier final weights")
    with pytest.raises(SaveError, match="could not write the final weights .* the files already there are unchanged"):
        trainer.save_model()
    assert (out / "adapter_model.safetensors").read_bytes() == b"earlier final weights"
    monkeypatch.setattr(adapter_api, "save_adapter", real_save)
    with fresh_names():
        resumed = build_trainer(out, tiny_model_dir)
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert losses(resumed) == uninterrupted[1]
