"""LLaMA-Factory's dataset_info.json (paddlenlp_ext/data/dataset_info.py): an alpaca entry, a ShareGPT entry with
custom tags and a ranking entry drive fine-tuning and DPO by name; remote-only entries are refused (exit 2).
Fast tests build the data with the tiny tokenizer; the CLI runs are slow."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

COLORS = ["red", "blue", "green", "white", "black", "yellow", "pink", "gray"]


def make_dataset_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "qa.json").write_text(
        json.dumps(
            [
                {"question": f"What color is item {i}?", "ctx": "", "answer": f"Item {i} is {COLORS[i % 8]}."}
                for i in range(48)
            ]
        )
    )
    (d / "chat.jsonl").write_text(
        "\n".join(
            json.dumps(
                {
                    "turns": [
                        {"speaker": "sys", "text": "Be brief."},
                        {"speaker": "u", "text": f"Color of item {i}?"},
                        {"speaker": "bot", "text": f"{COLORS[i % 8]}."},
                    ]
                }
            )
            for i in range(48)
        )
        + "\n"
    )
    (d / "pairs.json").write_text(
        json.dumps(
            [
                {
                    "chat": [{"role": "human", "content": f"Color of item {i}?"}],
                    "good": {"role": "gpt", "content": f"Item {i} is {COLORS[i % 8]}."},
                    "bad": {"role": "gpt", "content": "I do not know."},
                }
                for i in range(48)
            ]
        )
    )
    (d / "dataset_info.json").write_text(
        json.dumps(
            {
                "qa": {"file_name": "qa.json", "columns": {"prompt": "question", "query": "ctx", "response": "answer"}},
                "chat": {
                    "file_name": "chat.jsonl",
                    "formatting": "sharegpt",
                    "columns": {"messages": "turns"},
                    "tags": {
                        "role_tag": "speaker",
                        "content_tag": "text",
                        "user_tag": "u",
                        "assistant_tag": "bot",
                        "system_tag": "sys",
                    },
                },
                "prefs": {
                    "file_name": "pairs.json",
                    "formatting": "sharegpt",
                    "ranking": True,
                    "columns": {"messages": "chat", "chosen": "good", "rejected": "bad"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "human", "assistant_tag": "gpt"},
                },
                "hub_only": {"hf_hub_url": "llamafactory/alpaca_en"},
            }
        )
    )
    return str(d)


def sft_cfg(tiny_model_dir, tmp_path, data_dir, name, *extra):
    from paddlenlp_ext.config.parse import load_config

    return load_config(
        None,
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--dataset_dir",
            data_dir,
            "--dataset_name_or_path",
            name,
            "--output_dir",
            str(tmp_path / "out"),
            "--do_train",
            "true",
            "--max_length",
            "64",
            "--src_length",
            "32",
            *extra,
        ],
    )


def test_lookup_honours_file_name_formatting_columns_tags_ranking(tmp_path):
    from paddlenlp_ext.data.dataset_info import DatasetInfoError, lookup

    d = make_dataset_dir(tmp_path)
    e = lookup("chat", d)
    assert e.files == [os.path.join(d, "chat.jsonl")] and e.format == "sharegpt" and not e.ranking
    assert e.columns == {
        "messages": "turns",
        "role_tag": "speaker",
        "content_tag": "text",
        "user_tag": "u",
        "assistant_tag": "bot",
        "system_tag": "sys",
    }
    assert lookup("qa", d).format == "alpaca" and lookup("prefs", d).ranking
    with pytest.raises(DatasetInfoError, match=r"'hub_only' has only hf_hub_url .*local files only"):
        lookup("hub_only", d)


def test_sft_by_name_alpaca_and_sharegpt_with_custom_tags(tiny_model_dir, tiny_tokenizer, tmp_path):
    from paddlenlp_ext.data.build import build_datasets

    d = make_dataset_dir(tmp_path)
    for name, first_user in (("qa", "What color is item 0?"), ("chat", "Color of item 0?"), ("qa,chat", None)):
        cfg = sft_cfg(tiny_model_dir, tmp_path, d, name)
        built = build_datasets(cfg, tiny_tokenizer, do_train=True, do_eval=False, seed=0)
        assert built.reports["train"]["examples"] == 48 * len(name.split(","))
        if first_user:  # no template: the same ids as the src/tgt form of the record
            from paddlenlp_ext.data.reader import Example
            from paddlenlp_ext.data.tokenize import tokenize_example

            system = "Be brief." if name == "chat" else None
            ref, _, _ = tokenize_example(
                Example([first_user], [built_answer(name)], system), tiny_tokenizer, 32, 64, False
            )
            assert built.train[0] == ref


def built_answer(name):
    return "Item 0 is red." if name == "qa" else "red."


def test_config_refusals_exit_2_naming_the_entry(tiny_model_dir, tmp_path):
    from paddlenlp_ext.config.parse import ConfigError, load_config

    d = make_dataset_dir(tmp_path)
    for name, text in (
        ("hub_only", "has only hf_hub_url"),
        ("prefs", "is a preference dataset (ranking: true)"),
        ("nope", "is not a directory or a data file"),
    ):
        with pytest.raises(ConfigError) as e:
            sft_cfg(tiny_model_dir, tmp_path, d, name)
        assert text in "\n".join(e.value.problems), e.value.problems
    base = [
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_dir",
        d,
        "--output_dir",
        str(tmp_path / "o"),
        "--do_train",
        "true",
        "--lora",
        "true",
    ]
    load_config(None, base + ["--train_dataset_path", "prefs"], mode="dpo")
    with pytest.raises(ConfigError) as e:
        load_config(None, base + ["--train_dataset_path", "qa"], mode="dpo")
    assert "'qa' in " in "\n".join(e.value.problems) and "not a preference dataset" in "\n".join(e.value.problems)
    with pytest.raises(ConfigError) as e:
        load_config(None, base + ["--train_dataset_path", os.path.join(d, "pairs.json")], mode="kto")
    assert "remove dataset_dir" in "\n".join(e.value.problems)


def test_dpo_by_name_ranking_entry(tiny_tokenizer, tmp_path):
    from types import SimpleNamespace

    from paddlenlp_ext.dpo.data import build_preference_datasets

    d = make_dataset_dir(tmp_path)
    args = SimpleNamespace(
        train_dataset_path="prefs",
        dev_dataset_path=None,
        max_seq_len=64,
        max_prompt_len=32,
        zero_padding=True,
        greedy_zero_padding=False,
        lazy=False,
        chat_template=None,
        dataset_dir=d,
    )
    data = build_preference_datasets(args, tiny_tokenizer, do_train=True, do_eval=False, flash_mask=False)
    assert data.reports["train"]["pairs"] == 48 and data.reports["train"]["files"] == [os.path.join(d, "pairs.json")]


def run_cli(script, *args):
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *map(str, args)], capture_output=True, text=True, cwd=ROOT
    )
    return r


@pytest.mark.slow
def test_cli_sft_and_dpo_by_dataset_name(tiny_model_dir, tmp_path):
    d = make_dataset_dir(tmp_path)
    common = [
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_dir",
        d,
        "--max_steps",
        "4",
        "--logging_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--do_eval",
        "false",
        "--eval_before_train",
        "false",
        "--report_to",
        "none",
    ]
    for name in ("qa", "chat"):
        out = tmp_path / f"sft_{name}"
        r = run_cli(
            "llm/run_finetune.py",
            "llm/config/tiny/lora_argument.json",
            "--dataset_name_or_path",
            name,
            "--output_dir",
            out,
            *common,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert json.loads((out / "run_summary.json").read_text())["data"]["train"]["examples"] == 48
    out = tmp_path / "dpo"
    r = run_cli(
        "llm/run_dpo.py",
        "llm/config/tiny/dpo_argument.json",
        "--train_dataset_path",
        "prefs",
        "--output_dir",
        out,
        "--max_seq_len",
        "128",
        "--max_prompt_len",
        "64",
        *common,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert json.loads((out / "run_summary.json").read_text())["data"]["train"]["pairs"] == 48
    r = run_cli(
        "llm/run_finetune.py",
        "llm/config/tiny/lora_argument.json",
        "--dataset_name_or_path",
        "hub_only",
        "--output_dir",
        tmp_path / "x",
        *common,
    )
    assert r.returncode == 2 and "local files only" in r.stdout + r.stderr
