"""llm/predict/predictor.py + paddlenlp_ext.predict: batch prediction, chat, adapters, bad input.

Adapters of every type are built on the tiny Llama with RANDOM non-zero weights (so an adapter that
was ignored, applied twice or merged wrongly changes the greedy outputs), saved with the library's own
save functions (PaddleNLP's LoRAModel.save_pretrained for the PaddleNLP-format one) and merged into a
checkpoint with paddlenlp_ext.merge.  The CLI runs in-process (its ``main(argv)``); the runs through a
real subprocess that import paddle are marked slow.
"""

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import DATA_DIR, ROOT

SCRIPT = os.path.join(ROOT, "llm", "predict", "predictor.py")
DEMO_PROMPTS = os.path.join(ROOT, "llm", "data", "demo_prompts.json")
ALL_LINEARS = [f".*{n}.*" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]
GREEDY = ["--decode_strategy", "greedy_search", "--src_length", "48", "--max_length", "80"]

#: our adapter kinds: flat config keys (adapter_config_from_args) and the std of their random weights
OURS = {
    "lora": ({"lora": True, "lora_rank": 8}, 0.2),
    "rslora": ({"lora": True, "lora_rank": 8, "rslora": True}, 0.2),
    "pissa": ({"lora": True, "lora_rank": 8, "pissa": True}, 0.2),
    "vera": ({"vera": True, "vera_rank": 8}, 1.0),
    "lokr": ({"lokr": True, "lokr_dim": 4}, 0.2),
    "nf4": (
        {
            "lora": True,
            "lora_rank": 8,
            "quantization": {
                "weight_quantize_algo": "nf4",
                "weight_blocksize": 16,
                "weight_double_quant": False,
                "weight_double_quant_block_size": 256,
            },
        },
        0.2,
    ),
}
MERGEABLE = ["lora", "rslora", "pissa", "vera", "lokr", "paddlenlp_lora"]


def load_script():
    spec = importlib.util.spec_from_file_location("predictor_cli", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def cli():
    return load_script()


@pytest.fixture
def predict(cli, capsys, tmp_path):
    """predict(argv) -> (exit code, output rows, stdout, stderr), running the CLI in this process."""
    counter = iter(range(1000))

    def run(argv, output=True):
        argv = [str(a) for a in argv]
        out_file = None
        if output and "--output_file" not in argv:
            out_file = tmp_path / f"out{next(counter)}.json"
            argv += ["--output_file", str(out_file)]
        capsys.readouterr()
        rc = cli.main(argv)
        captured = capsys.readouterr()
        rows = None
        if rc == 0 and out_file is not None and out_file.exists():
            rows = [json.loads(line) for line in out_file.read_text().splitlines()]
        return rc, rows, captured.out, captured.err

    return run


def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def dev_rows(n, skip=0):
    with open(os.path.join(DATA_DIR, "dev.json")) as f:
        return [json.loads(line) for line in f][skip : skip + n]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """Prompts of different token lengths: the demo's two, a short one, a multi-turn one, one with a system."""
    d = dev_rows(3)
    rows = [json.loads(line) for line in open(DEMO_PROMPTS)]
    rows += [
        {"src": "type#coat"},
        {"src": [d[0]["src"], "type#skirt*color#blue"], "tgt": [d[0]["tgt"]]},
        {"src": d[1]["src"] + "*extra#words", "context": {"system": "Write one sentence."}},
    ]
    return write_lines(tmp_path_factory.mktemp("prompts") / "prompts.json", rows)


# ------------------------------------------------------------------- adapters
def _base(path):
    from paddlenlp.transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="float32")


def _randomize(params, std, seed):
    import paddle

    rng = np.random.default_rng(seed)
    for p in params:
        p.set_value(paddle.to_tensor((std * rng.standard_normal(p.shape)).astype("float32")))


def _save_ours(kind, base_dir, out):
    from paddlenlp_ext.adapters import apply_adapters, save_adapter
    from paddlenlp_ext.adapters.config import adapter_config_from_args
    from paddlenlp_ext.models.quantize import quantize_model

    keys, std = OURS[kind]
    cfg = adapter_config_from_args({**keys, "model_name_or_path": base_dir})
    model = _base(base_dir)
    if cfg.quantization:
        quantize_model(model, "nf4", block_size=16)
    apply_adapters(model, cfg)
    _randomize([p for p in model.parameters() if not p.stop_gradient], std, seed=len(kind))
    save_adapter(model, cfg, out)
    model.config.save_pretrained(out)  # as the trainer saves it next to the adapter


def _save_paddlenlp_lora(base_dir, out):
    from paddlenlp.peft import LoRAConfig, LoRAModel

    lm = LoRAModel(
        _base(base_dir), LoRAConfig(r=4, lora_alpha=8, target_modules=ALL_LINEARS, base_model_name_or_path=base_dir)
    )
    _randomize([p for n, p in lm.model.named_parameters() if n.endswith(("lora_A", "lora_B"))], 0.2, seed=7)
    lm.save_pretrained(out)


def _save_prefix(base_dir, out):
    from paddlenlp_ext.prefix.config import ModelFacts, prefix_config_for_model
    from paddlenlp_ext.prefix.io import save_prefix
    from paddlenlp_ext.prefix.model import PrefixModel

    model = _base(base_dir)
    pm = PrefixModel(model, prefix_config_for_model(ModelFacts.of(model.config), num_prefix_tokens=8))
    _randomize(pm.prefix_encoder.parameters(), 1.0, seed=3)
    save_prefix(pm, out)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """{kind: directory} for every adapter kind --lora_path takes."""
    root = tmp_path_factory.mktemp("predict_adapters")
    out = {}
    for kind in OURS:
        out[kind] = str(root / kind)
        _save_ours(kind, tiny_model_dir, out[kind])
    out["paddlenlp_lora"] = str(root / "paddlenlp_lora")
    _save_paddlenlp_lora(tiny_model_dir, out["paddlenlp_lora"])
    out["prefix"] = str(root / "prefix")
    _save_prefix(tiny_model_dir, out["prefix"])
    return out


@pytest.fixture(scope="module")
def base_rows(cli, tiny_model_dir, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "base.json"
    assert (
        cli.main(
            [
                "--model_name_or_path",
                tiny_model_dir,
                "--data_file",
                prompts_file,
                "--batch_size",
                "5",
                "--output_file",
                str(out),
            ]
            + GREEDY
        )
        == 0
    )
    return [json.loads(line) for line in out.read_text().splitlines()]


# ------------------------------------------------------------------- adapters: base + adapter == merged
@pytest.mark.parametrize("kind", MERGEABLE)
def test_adapter_predictions_equal_merged_model(
    kind, adapters, base_rows, predict, tiny_model_dir, prompts_file, tmp_path
):
    from paddlenlp_ext.merge import merge_adapter_checkpoint

    merged = tmp_path / "merged"
    res = merge_adapter_checkpoint(tiny_model_dir, adapters[kind], str(merged), verify=False, log=lambda m: None)
    assert res.exit_code == 0
    rc, with_adapter, _, err = predict(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--lora_path",
            adapters[kind],
            "--data_file",
            prompts_file,
            "--batch_size",
            5,
        ]
        + GREEDY
    )
    assert rc == 0, err
    assert "merged in memory" in err
    rc, from_merged, _, err = predict(
        ["--model_name_or_path", merged, "--data_file", prompts_file, "--batch_size", 5] + GREEDY
    )
    assert rc == 0, err
    outputs = [r["output"] for r in with_adapter]
    assert outputs == [r["output"] for r in from_merged]
    changed = sum(a != b["output"] for a, b in zip(outputs, base_rows))
    assert changed >= 4, f"the {kind} adapter barely changes the predictions ({changed}/5): the test would be weak"


def test_prefix_adapter_runs_and_changes_predictions(adapters, base_rows, predict, tiny_model_dir, prompts_file):
    args = ["--model_name_or_path", tiny_model_dir, "--lora_path", adapters["prefix"], "--data_file", prompts_file]
    rc, batched, _, err = predict(args + ["--batch_size", 5] + GREEDY)
    assert rc == 0, err
    assert "prefix tuning" in err and "8 prefix tokens" in err
    assert sum(r["output"] != b["output"] for r, b in zip(batched, base_rows)) >= 4
    rc, single, _, err = predict(args + ["--prefix_path", adapters["prefix"], "--batch_size", 1] + GREEDY)
    assert rc == 0, err
    assert [r["output"] for r in single] == [r["output"] for r in batched]  # prefix masks with left padding


def test_qlora_adapter_runs_on_the_quantized_base(adapters, base_rows, predict, tiny_model_dir, prompts_file):
    rc, rows, _, err = predict(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--lora_path",
            adapters["nf4"],
            "--data_file",
            prompts_file,
            "--batch_size",
            5,
        ]
        + GREEDY
    )
    assert rc == 0, err
    assert "on a nf4 base" in err and "merged" not in err
    assert sum(r["output"] != b["output"] for r, b in zip(rows, base_rows)) >= 4


# ------------------------------------------------------------------- batching
@pytest.mark.parametrize("family,penalty", [("llama", "1.3"), ("qwen2", "1.0")])
def test_batched_equals_one_by_one(family, penalty, request, predict, prompts_file, tiny_tokenizer):
    """batch_size 4 (left-padded rows of different lengths) == batch_size 1; with a repetition penalty, which
    PaddleNLP applies to every id of a row, padding included."""
    model_dir = request.getfixturevalue("tiny_model_dir" if family == "llama" else "tiny_qwen2_dir")
    lengths = {
        len(
            tiny_tokenizer(
                json.loads(line)["src"] if isinstance(json.loads(line)["src"], str) else json.loads(line)["src"][-1]
            )["input_ids"]
        )
        for line in open(prompts_file)
    }
    assert len(lengths) >= 4  # rows of different lengths: the batch really is left-padded
    args = ["--model_name_or_path", model_dir, "--data_file", prompts_file, "--repetition_penalty", penalty] + GREEDY
    rc, batched, _, err = predict(args + ["--batch_size", 4])
    assert rc == 0, err
    assert "batch 2/2: 1 prompt(s)" in err and err.count("[predict] batch") == 2  # one progress line per batch
    rc, single, _, err = predict(args + ["--batch_size", 1])
    assert rc == 0, err
    assert [r["output"] for r in batched] == [r["output"] for r in single]
    assert len({r["output"] for r in batched}) == 5


def test_docstring_examples():
    import doctest

    from paddlenlp_ext.predict import generate, inputs, prompts, run

    for mod in (generate, inputs, prompts, run):
        result = doctest.testmod(mod)
        assert result.failed == 0 and result.attempted > 0, mod.__name__


def test_left_padding_layout():
    from paddlenlp_ext.predict.generate import cut_answer, left_padded

    ids, mask, pos = left_padded([[1, 5, 6, 7], [1, 8]])
    assert ids.tolist() == [[1, 5, 6, 7], [1, 1, 1, 8]]  # padded with the row's own first token
    assert mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert pos.tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]
    assert cut_answer([4, 2, 9], 5, [2]) == [4] and cut_answer([4, 5, 6], 2, [2]) == [4, 5]


# ------------------------------------------------------------------- the output file and the prompt format
def test_output_file_and_training_prompt_format(predict, tiny_model_dir, tiny_tokenizer, tmp_path):
    """Each row: src/tgt as given + output; the output is the plain greedy continuation of the prompt
    that training's own generation_prompt (data.tokenize) builds."""
    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM

    from paddlenlp_ext.data.reader import Example
    from paddlenlp_ext.data.tokenize import generation_prompt
    from paddlenlp_ext.predict.inputs import PromptRecord
    from paddlenlp_ext.predict.prompts import build_prompt

    d = dev_rows(2, skip=5)
    rows = [
        {"src": d[0]["src"], "tgt": d[0]["tgt"]},
        {"src": [d[0]["src"], d[1]["src"]], "tgt": [d[0]["tgt"], d[1]["tgt"]]},
        {"src": "type#hoodie*color#gray"},
    ]
    path = write_lines(tmp_path / "p.json", rows)
    out_file = tmp_path / "sub" / "pred.json"
    rc, got, stdout, err = predict(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--data_file",
            path,
            "--batch_size",
            3,
            "--output_file",
            out_file,
            "--decode_strategy",
            "greedy_search",
            "--src_length",
            160,
            "--max_length",
            256,
        ],
        output=False,
    )
    assert rc == 0, err
    got = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [sorted(r) for r in got] == [["output", "src", "tgt"], ["output", "src", "tgt"], ["output", "src"]]
    assert [(r["src"], r.get("tgt")) for r in got] == [(r["src"], r.get("tgt")) for r in rows]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    model.eval()
    for row, pred in zip(rows[:2], got[:2]):
        src = row["src"] if isinstance(row["src"], list) else [row["src"]]
        tgt = row["tgt"] if isinstance(row["tgt"], list) else [row["tgt"]]
        ids, _ = generation_prompt(Example(src=src, tgt=tgt), tiny_tokenizer, 160, 256, False)
        rec = PromptRecord(src=src, history=tgt[:-1])
        assert build_prompt(rec, tiny_tokenizer, 160, 256, False).ids == ids
        assert len(ids) > 60 or len(src) == 1  # the multi-turn row keeps its first round
        with paddle.no_grad():
            out, _ = model.generate(
                paddle.to_tensor([ids]),
                attention_mask=paddle.ones([1, len(ids)], dtype="int64"),
                max_new_tokens=256 - len(ids),
                decode_strategy="greedy_search",
                eos_token_id=tiny_tokenizer.eos_token_id,
            )
        tokens = [int(t) for t in out[0].numpy()]
        tokens = tokens[: tokens.index(2)] if 2 in tokens else tokens
        assert pred["output"] == tiny_tokenizer.decode(
            tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
    # the console shows each prompt and answer in a few lines
    assert stdout.count("\n> ") + stdout.startswith("> ") == 3 and stdout.count("\n< ") == 3
    assert "> [1 earlier turn(s)] " + d[1]["src"] in stdout
    assert "wrote 3 prediction(s)" in err


def test_prompt_truncation_rules(tiny_tokenizer):
    from paddlenlp_ext.predict.inputs import PredictInputError, PromptRecord
    from paddlenlp_ext.predict.prompts import build_prompt, fit_prompt

    assert fit_prompt([1], [([5, 5], [6, 2])], [7], 4) == ([1, 7], 1, True)
    assert fit_prompt([1], [([5, 5], [6, 2])], [7], 6) == ([1, 5, 5, 6, 2, 7], 0, False)
    assert fit_prompt([1], [], [7, 8, 9], 2) == (
        [1, 8, 9],
        0,
        True,
    )  # each src keeps its last tokens (cut from the left, as training)
    rec = PromptRecord(src=["type#coat*color#red"], history=[], origin="f.json:3", system="x " * 40)
    with pytest.raises(PredictInputError, match=r"f.json:3: the prompt is \d+ tokens .* raise --max_length"):
        build_prompt(rec, tiny_tokenizer, src_length=8, max_length=16, use_template=False)


# ------------------------------------------------------------------- chat
class Recorder(io.StringIO):
    """stdout that remembers every write (to see the answer arrive in pieces)."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


def _chat(cli, argv, lines, monkeypatch):
    """(transcript, writes) of a chat session fed ``lines``."""
    out = Recorder()
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(x + "\n" for x in lines)))
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main([str(a) for a in argv]) == 0
    monkeypatch.undo()
    return out.getvalue(), out.writes


@pytest.mark.parametrize("template", [None, "jinja"])
def test_chat_is_multi_turn_streamed_and_matches_batch(
    template, cli, predict, adapters, tiny_model_dir, tmp_path, monkeypatch
):
    """The chat answers what a prompt file with the same turns answers (earlier answers as tgt), token by token."""
    args = ["--model_name_or_path", tiny_model_dir, "--lora_path", adapters["lora"]] + GREEDY
    if template:
        path = tmp_path / "template.jinja"
        path.write_text(
            "{% for m in messages %}{% if m['role'] == 'user' %}user: {{ m['content'] }}\nbot: "
            "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
        )
        args += ["--chat_template", path]
    q1, q2 = "type#coat*color#red", "type#skirt*color#blue*style#elegant"
    saved = tmp_path / "chat.json"
    transcript, writes = _chat(
        cli, args + ["--chat", "--output_file", saved], [q1, q2, "/reset", q1, "/exit"], monkeypatch
    )
    turns = [json.loads(line) for line in saved.read_text().splitlines()]
    a1, a2 = turns[0]["output"], turns[1]["output"]
    assert [{k: v for k, v in t.items() if k != "output"} for t in turns] == [
        {"src": q1},
        {"src": [q1, q2], "tgt": [a1]},
        {"src": q1},
    ]
    # the saved turns are a prompt file: predicting it gives the chat's answers
    rc, rows, _, err = predict(args + ["--data_file", saved, "--batch_size", 3])
    assert rc == 0, err
    assert [r["output"] for r in rows] == [a1, a2, a1]
    # a long first answer leaves no room for the first round within --src_length: the chat says so
    from paddlenlp_ext.predict.inputs import PromptRecord
    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.predict.prompts import build_prompt
    from paddlenlp_ext.predict.session import load_tokenizer

    tok, use_template = load_tokenizer(PredictOptions(tiny_model_dir, chat_template=template and str(path)))
    dropped = build_prompt(PromptRecord([q1, q2], [a1]), tok, 48, 80, use_template).dropped_rounds
    note = f"[chat] ({dropped} earlier turn(s) left out to fit --src_length 48)\n" if dropped else ""
    header, body = transcript.split("\n", 2)[:2], transcript.split("\n", 2)[2]
    assert ("chat template" in header[1]) == bool(template)
    from paddlenlp_ext.predict.run import terminal_safe  # the console shows control bytes escaped

    s1, s2 = terminal_safe(a1), terminal_safe(a2)
    assert body == (
        f"user> {q1}\nmodel> {s1}\nuser> {q2}\n{note}model> {s2}\nuser> /reset\n"
        f"[chat] new conversation\nuser> {q1}\nmodel> {s1}\nuser> /exit\n"
    )  # /reset forgot turn 1
    assert a1 != a2 and len(a1) > 20
    first, shown, pieces = writes.index("model> "), "", 0
    while shown != s1:  # the first answer arrives in many writes, one per decodable token
        pieces += 1
        shown += writes[first + pieces]
    assert pieces > 5


class ScriptedModel:
    """Stands in for the model in a chat: answers each prompt with fixed tokens + EOS (through the streamer)
    and records the prompt ids it was given, so the history the chat sends can be checked exactly."""

    def __init__(self, answers, eos):
        self.answers, self.eos, self.prompts = list(answers), eos, []

    def generate(self, input_ids, attention_mask, position_ids, generation_config, streamer=None):
        import paddle

        assert attention_mask.numpy().all() and generation_config.max_new_tokens > 0
        self.prompts.append([int(t) for t in input_ids.numpy()[0]])
        tokens = self.answers.pop(0) + [self.eos]
        for t in tokens:
            streamer.put(paddle.to_tensor([[t]]))
        streamer.end()
        return paddle.to_tensor([tokens]), None


def test_chat_sends_the_conversation_in_the_training_layout(tiny_tokenizer):
    from paddlenlp_ext.data.reader import Example
    from paddlenlp_ext.data.tokenize import generation_prompt
    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.predict.run import chat
    from paddlenlp_ext.predict.session import Session

    tok = tiny_tokenizer
    a1, a2 = "A red coat.", "A blue skirt."
    model = ScriptedModel([tok(a, add_special_tokens=False)["input_ids"] for a in (a1, a2)], tok.eos_token_id)
    session = Session(
        model=model,
        tokenizer=tok,
        use_template=False,
        eos_ids=[tok.eos_token_id],
        pad_id=0,
        device="cpu",
        description="scripted",
    )
    out = io.StringIO()
    o = PredictOptions("unused", src_length=64, max_length=128, decode_strategy="greedy_search")
    assert chat(session, o, io.StringIO("type#coat\ntype#skirt\n"), out) == 2
    assert "model> A red coat.\nuser> type#skirt\nmodel> A blue skirt.\n" in out.getvalue()
    # turn 2 = [bos] + turn 1 + its answer + eos + turn 2, exactly what training builds before an answer
    want, _ = generation_prompt(Example(src=["type#coat", "type#skirt"], tgt=[a1, a2]), tok, 64, 128, False)
    assert model.prompts[1] == want and len(model.prompts[1]) > len(model.prompts[0]) + 5


def test_token_printer_holds_back_incomplete_characters(tiny_tokenizer):
    from paddlenlp_ext.predict.generate import TokenPrinter

    ids = tiny_tokenizer("Meet the red coat. é", add_special_tokens=False)["input_ids"]
    shown = []
    printer = TokenPrinter(tiny_tokenizer, [2], shown.append)
    for t in ids + [2, 7]:  # after EOS nothing more is shown
        printer.put(np.array([[t]]))
    printer.end()
    assert "".join(shown) == tiny_tokenizer.decode(ids) + "\n"
    assert not any("\ufffd" in s for s in shown)


# ------------------------------------------------------------------- bad input: exit 2 and the message
def test_bad_prompt_lines_name_file_and_line(predict, tiny_model_dir, tmp_path):
    path = write_lines(
        tmp_path / "bad.json",
        [{"src": "ok"}, {"tgt": "no src"}, "{not json", "", {"src": ["a", "b", "c"], "tgt": ["x"]}],
    )
    rc, _, _, err = predict(["--model_name_or_path", tiny_model_dir, "--data_file", path])
    assert rc == 2
    assert f"{path}:2: missing key 'src'" in err
    assert f"{path}:3: invalid JSON" in err
    assert f"{path}:5: 3 src turn(s) and 1 tgt answer(s)" in err
    assert ":1:" not in err and ":4:" not in err and "Traceback" not in err


def test_prompt_file_not_utf8(predict, tiny_model_dir, tmp_path):
    path = tmp_path / "gbk.json"
    path.write_bytes(b'{"src": "ok"}\n' + '{"src": "连衣裙"}\n'.encode("gbk"))
    rc, _, _, err = predict(["--model_name_or_path", tiny_model_dir, "--data_file", path])
    assert rc == 2 and f"{path}:2: not UTF-8" in err and "iconv -f gbk" in err, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--data_file", "nowhere.json"], "--data_file nowhere.json: no such file"),
        (
            ["--data_file", DEMO_PROMPTS, "--src_length", "64", "--max_length", "64"],
            "--max_length 64 must be greater than --src_length 64",
        ),
        (["--data_file", DEMO_PROMPTS, "--max_length", "4096"], "exceeds max_position_embeddings=1024"),
        ([], "nothing to do: give --data_file FILE"),
        (["--data_file", DEMO_PROMPTS, "--chat"], "--data_file and --chat are two modes"),
        (["--data_file", DEMO_PROMPTS, "--lora_path", DATA_DIR], "holds none of adapter_config.json"),
        (["--data_file", DEMO_PROMPTS, "--top_p", "0"], "--top_p 0.0: must be in (0, 1]"),
        (["--data_file", DEMO_PROMPTS, "--output_file", DATA_DIR], f"--output_file {DATA_DIR} is a directory"),
    ],
)
def test_bad_arguments(argv, message, predict, tiny_model_dir):
    rc, _, _, err = predict(["--model_name_or_path", tiny_model_dir] + argv)
    assert rc == 2 and message in err, err


def _cuda():
    import paddle

    return paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dtype", "float16"], "--dtype float16: this Paddle build has no float16 matmul kernel on cpu"),
        (["--dtype", "bfloat16"], "--dtype bfloat16: this Paddle build has no bfloat16 matmul kernel on cpu"),
        (["--device", "gpu"], "--device gpu: this Paddle build has no usable GPU"),
    ],
)
def test_cpu_only_refusals(argv, message, predict, tiny_model_dir):
    if _cuda():
        pytest.skip("a GPU is available: these settings are valid here")
    rc, _, _, err = predict(["--model_name_or_path", tiny_model_dir, "--data_file", DEMO_PROMPTS] + argv)
    assert rc == 2 and message in err, err


def test_sampling_flags_and_seed(predict, tiny_model_dir, base_rows, prompts_file):
    """--decode_strategy sampling --top_k 0 samples (seeded: reproducible); with top_k 1 it is greedy."""
    args = [
        "--model_name_or_path",
        tiny_model_dir,
        "--data_file",
        prompts_file,
        "--batch_size",
        5,
        "--src_length",
        48,
        "--max_length",
        80,
    ]
    runs = []
    for seed in (1, 1, 2):
        rc, rows, _, err = predict(args + ["--top_k", 0, "--top_p", 0.9, "--temperature", 0.8, "--seed", seed])
        assert rc == 0, err
        runs.append([r["output"] for r in rows])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert runs[0] != [r["output"] for r in base_rows]
    rc, rows, _, err = predict(args + ["--temperature", 0.5])  # the defaults: sampling with top_k 1
    assert rc == 0 and [r["output"] for r in rows] == [r["output"] for r in base_rows]
    assert "decoding is greedy" in err and "--temperature and --top_p change nothing" in err


def test_unknown_decode_strategy(predict, tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as e:
        predict(["--model_name_or_path", tiny_model_dir, "--data_file", DEMO_PROMPTS, "--decode_strategy", "beam"])
    assert e.value.code == 2
    assert "invalid choice: 'beam' (choose from 'greedy_search', 'sampling')" in capsys.readouterr().err


@pytest.fixture(scope="module")
def narrow_model(tiny_model_dir, tmp_path_factory):
    """A tiny Llama with hidden_size 32 (the tiny one has 64) and the same tokenizer."""
    from paddlenlp_ext.models.tiny import build_tiny_model

    out = str(tmp_path_factory.mktemp("narrow") / "narrow-llama")
    return build_tiny_model(
        out,
        None,
        spm_model=os.path.join(tiny_model_dir, "sentencepiece.bpe.model"),
        hidden_size=32,
        intermediate_size=88,
    )


def test_adapter_of_another_base_names_tensor_and_shapes(predict, adapters, narrow_model):
    rc, _, _, err = predict(
        ["--model_name_or_path", narrow_model, "--lora_path", adapters["lora"], "--data_file", DEMO_PROMPTS]
    )
    assert rc == 2, err
    assert f"--lora_path {adapters['lora']} does not fit the base model {narrow_model}" in err
    assert (
        "adapter weight 'llama.layers.0.self_attn.q_proj.lora_A': shape [64, 8] does not match the model's "
        "[32, 8]" in err
    )
    rc, _, _, err = predict(
        ["--model_name_or_path", narrow_model, "--lora_path", adapters["prefix"], "--data_file", DEMO_PROMPTS]
    )
    assert rc == 2 and "does not fit the base model" in err and "hidden_size=64" in err, err


def test_bad_input_fails_fast_without_traceback(tiny_model_dir, tmp_path):
    """Through the real script: a bad line is reported before paddle is even imported."""
    path = write_lines(tmp_path / "bad.json", [{"src": "ok"}, "[1, 2"])
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--model_name_or_path", tiny_model_dir, "--data_file", path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"{path}:2: invalid JSON" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--model_name_or_path", tiny_model_dir], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "nothing to do" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_shape_mismatch_exit_2_without_traceback(adapters, narrow_model):
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--model_name_or_path",
            narrow_model,
            "--lora_path",
            adapters["lora"],
            "--data_file",
            DEMO_PROMPTS,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "shape [64, 8] does not match the model's [32, 8]" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------- end to end: train, then predict (the demo)
@pytest.mark.slow
def test_demo_train_lora_then_predict(tiny_model_dir, tmp_path):
    """run_finetune.py trains a LoRA adapter for a few steps; the predictor answers the demo prompts with it,
    and its greedy predictions equal those of the merged model (llm/merge_lora_params.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = tmp_path / "lora"
    train = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "llm", "run_finetune.py"),
            os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json"),
            "--output_dir",
            out,
            "--model_name_or_path",
            tiny_model_dir,
            "--max_steps",
            "20",
            "--eval_before_train",
            "false",
            "--do_eval",
            "false",
            "--per_device_train_batch_size",
            "8",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    common = [
        "--data_file",
        DEMO_PROMPTS,
        "--decode_strategy",
        "greedy_search",
        "--max_length",
        "128",
        "--src_length",
        "64",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--model_name_or_path",
            tiny_model_dir,
            "--lora_path",
            out,
            "--output_file",
            tmp_path / "pred.json",
        ]
        + common,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [x[:2] for x in lines if not x.startswith("  ")] == ["> ", "< ", "> ", "< "] and len(lines) <= 12
    assert "lora adapter" in proc.stderr and "batch 1/2" in proc.stderr and "Warning" not in proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "pred.json").read_text().splitlines()]
    assert len(rows) == 2 and all(r["output"] for r in rows)
    merged = tmp_path / "merged"
    merge = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "llm", "merge_lora_params.py"),
            "--model_name_or_path",
            tiny_model_dir,
            "--lora_path",
            out,
            "--merge_model_path",
            merged,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert merge.returncode == 0, merge.stdout[-3000:] + merge.stderr[-3000:]
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--model_name_or_path", merged, "--output_file", tmp_path / "merged.json"] + common,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(x)["output"] for x in (tmp_path / "merged.json").read_text().splitlines()] == [
        r["output"] for r in rows
    ]
    shutil.rmtree(tmp_path, ignore_errors=True)
