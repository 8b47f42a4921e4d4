"""paddlenlp_ext.serve, fast: request checks, text streaming, flags (exit 2 before paddle), and the
scheduler's batches on the tiny Llama in process (batched rows == each row alone, early end, cancel).
The server over HTTP is tests/test_serve_e2e.py (slow)."""

import asyncio
import doctest
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from paddlenlp_ext.serve import models as serve_models
from paddlenlp_ext.serve import completions, constrain, decode, logprobs, protocol, textstream, tools
from paddlenlp_ext.serve.completions import parse_completion
from paddlenlp_ext.serve.protocol import ApiError, Sampling, parse_chat

MODELS = ["base", "sql"]
GREEDY = Sampling()
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "module", [protocol, completions, textstream, serve_models, decode, logprobs, tools, constrain]
)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def refusal(body, parse=parse_chat):
    with pytest.raises(ApiError) as e:
        parse(body, MODELS, GREEDY)
    return e.value


@pytest.mark.parametrize(
    "body,status,param,code",
    [
        ("text", 400, None, "invalid_type"),
        ({"messages": USER}, 400, "model", "missing_required_parameter"),
        ({"model": "other", "messages": USER}, 404, "model", "model_not_found"),
        ({"model": "base"}, 400, "messages", "missing_required_parameter"),
        ({"model": "base", "messages": []}, 400, "messages", "invalid_type"),
        ({"model": "base", "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
        ({"model": "base", "messages": [{"role": "user"}]}, 400, "messages[0].content", "missing_required_parameter"),
        ({"model": "base", "messages": USER * 2}, 400, "messages[1].role", "invalid_value"),
        (
            {"model": "base", "messages": USER + [{"role": "system", "content": "s"}] + USER},
            400,
            "messages[1].role",
            "invalid_value",
        ),
        (
            {"model": "base", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0].content[0]",
            "invalid_value",
        ),
        ({"model": "base", "messages": USER, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ({"model": "base", "messages": USER, "max_tokens": True}, 400, "max_tokens", "invalid_type"),
        ({"model": "base", "messages": USER, "temperature": -0.1}, 400, "temperature", "invalid_value"),
        ({"model": "base", "messages": USER, "temperature": "hot"}, 400, "temperature", "invalid_type"),
        ({"model": "base", "messages": USER, "top_p": 1.5}, 400, "top_p", "invalid_value"),
        ({"model": "base", "messages": USER, "seed": 1.5}, 400, "seed", "invalid_type"),
        ({"model": "base", "messages": USER, "stop": [""]}, 400, "stop", "invalid_type"),
        ({"model": "base", "messages": USER, "logprobs": 2}, 400, "logprobs", "invalid_type"),
        ({"model": "base", "messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
        (
            {"model": "base", "messages": USER, "logprobs": True, "top_logprobs": 21},
            400,
            "top_logprobs",
            "invalid_value",
        ),
        ({"model": "base", "messages": USER, "n": 0}, 400, "n", "invalid_value"),
        (
            {"model": "base", "messages": USER, "response_format": {"type": "xml"}},
            400,
            "response_format",
            "invalid_type",
        ),
        (
            {"model": "base", "messages": USER, "frequency_penalty": 0.5},
            400,
            "frequency_penalty",
            "unsupported_parameter",
        ),
        (
            {"model": "base", "messages": USER, "stream_options": {"include_usage": "y"}},
            400,
            "stream_options",
            "invalid_type",
        ),
        ({"model": "base", "messages": USER, "prompt": "x"}, 400, "prompt", "unknown_parameter"),
    ],
)
def test_chat_refusals_name_the_parameter(body, status, param, code):
    e = refusal(body)
    assert (e.status, e.param, e.code) == (status, param, code), e.message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"} and e.message


def test_completion_refusals():
    assert refusal({"model": "base"}, parse_completion).param == "prompt"
    assert refusal({"model": "base", "prompt": ["a", [1, "b"]]}, parse_completion).param == "prompt[1]"
    assert refusal({"model": "base", "prompt": []}, parse_completion).code == "invalid_type"
    assert refusal({"model": "base", "prompt": "a", "messages": USER}, parse_completion).code == "unknown_parameter"
    assert refusal({"model": "base", "prompt": "a", "echo": True, "stream": True}, parse_completion).param == "echo"
    assert refusal({"model": "base", "prompt": "a", "max_tokens": 0}, parse_completion).param == "max_tokens"
    assert refusal({"model": "base", "prompt": "a", "best_of": 3}, parse_completion).param == "best_of"
    r = parse_completion({"model": "base", "prompt": ["only"], "stop": "\n", "max_tokens": 3}, MODELS, GREEDY)
    assert (r.prompt, r.stop, r.max_tokens, r.kind) == (["only"], ["\n"], 3, "completion")
    r = parse_completion(
        {"model": "base", "prompt": [[1, 2], [3]], "echo": True, "max_tokens": 0, "logprobs": 1, "n": 2}, MODELS, GREEDY
    )
    assert (r.prompt, r.echo, r.max_tokens, r.logprobs, r.n) == ([[1, 2], [3]], True, 0, 1, 2)


def test_tool_requests_and_tool_call_parsing():
    t = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = parse_chat(
        {
            "model": "base",
            "messages": USER
            + [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
                },
                {"role": "tool", "tool_call_id": "1", "content": "2"},
            ],
            "tools": t,
        },
        MODELS,
        GREEDY,
    )
    assert r.tool_choice == "auto" and r.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert refusal({"model": "base", "messages": USER, "tool_choice": "required"}).param == "tool_choice"
    assert (
        refusal(
            {
                "model": "base",
                "messages": USER + [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "x"}],
            }
        ).param
        == "messages[2].role"
    )
    text = (
        'x <tool_call>\n{"name": "f", "arguments": {"a": [1]}}\n</tool_call>\n<tool_call>{"name": "g", '
        '"arguments": {}}</tool_call>'
    )
    content, calls = tools.parse_tool_calls(text, "hermes")
    assert content == "x" and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert tools.parse_tool_calls("<tool_call>{not json}</tool_call>", "hermes") == (
        "<tool_call>{not json}</tool_call>",
        [],
    ), "a broken call stays text"
    assert (
        tools.parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"q": 1}}', "llama3")[1][0]["function"][
            "arguments"
        ]
        == '{"q": 1}'
    )
    assert tools.parse_tool_calls("plain answer", "llama3") == ("plain answer", [])


def test_openai_defaults_are_accepted():
    """What the openai client or an SDK may send as OpenAI's own defaults: no behaviour, no refusal."""
    r = parse_chat(
        {
            "model": "base",
            "messages": USER,
            "response_format": {"type": "text"},
            "logprobs": False,
            "n": 1,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
            "tools": [],
            "parallel_tool_calls": True,
            "modalities": ["text"],
            "top_logprobs": None,
            "store": False,
            "metadata": {},
            "service_tier": "auto",
        },
        MODELS,
        GREEDY,
    )
    assert r.logprobs is None and r.response_format is None and r.n == 1
    r = parse_completion(
        {"model": "base", "prompt": "a", "logprobs": None, "echo": False, "best_of": 1, "n": 1, "suffix": None},
        MODELS,
        GREEDY,
    )
    assert r.logprobs is None and not r.echo


def test_accepted_chat_request():
    r = parse_chat(
        {
            "model": "sql",
            "messages": [{"role": "developer", "content": "Be brief."}]
            + USER
            + [{"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]
            + USER,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 9,
            "n": 1,
            "user": "me",
            "seed": 3,
            "temperature": 0.5,
        },
        MODELS,
        GREEDY,
    )
    assert r.conversation.system == "Be brief." and r.conversation.src == ["hi", "hi"]
    assert r.conversation.history == ["yo"] and r.include_usage and r.max_tokens == 9
    assert r.sampling == Sampling(greedy=False, temperature=0.5, top_p=1.0, top_k=0, seed=3)
    server_default = Sampling(greedy=False, temperature=0.7, top_p=0.8, top_k=5)
    assert parse_chat({"model": "base", "messages": USER}, MODELS, server_default).sampling == server_default


def test_text_assembler_holds_back_stop_prefixes_and_broken_characters():
    a = textstream.TextAssembler(["END"])
    sent = [a.update(t) for t in ("Hello E", "Hello EN", "Hello ENx", "Hello ENx \ufffd", "Hello ENx é E")]
    assert [d for d, _ in sent] == ["Hello ", "", "ENx", " ", "é "]
    assert a.update("Hello ENx é END and more") == ("", True) and a.text == "Hello ENx é "
    b = textstream.TextAssembler([])
    assert b.update("tail \ufffd", final=True) == ("tail \ufffd", False)


def test_incremental_decoding_equals_the_whole_decoding(tiny_tokenizer):
    """Byte-fallback, word-initial spaces, special tokens: the deltas add up to the predictor's decode."""
    rng = np.random.default_rng(0)
    tok = tiny_tokenizer

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    for _ in range(20):
        ids = [int(x) for x in rng.integers(0, tok.vocab_size, size=40)]
        d = textstream.IncrementalDecoder(decode)
        text = "".join(d.add(t) for t in ids)
        full = decode(ids)
        assert full.startswith(text) and set(full[len(text) :]) <= {"\ufffd"}, (text, full)  # held back: U+FFFD
        a = textstream.TextAssembler([])
        a.update(text)
        assert a.text + a.update(full, final=True)[0] == full


def test_lora_arg_and_model_plan_checks(tiny_model_dir, tmp_path):
    from paddlenlp_ext.predict.options import PredictOptions

    base = PredictOptions(model_name_or_path=tiny_model_dir, max_length=128)
    (tmp_path / "empty").mkdir()
    models, problems = serve_models.plan_models(
        base,
        "base",
        [f"a={tmp_path / 'missing'}", f"b={tmp_path / 'empty'}", f"base={tmp_path / 'empty'}", f"bad name={tmp_path}"],
    )
    text = "\n".join(problems)
    assert "missing: no such directory" in text and "holds none of adapter_config.json" in text
    assert "'base' is served twice" in text and "'bad name'" in text
    assert [m.name for m in models] == ["base", "a", "b", "base", "bad name"] and models[1].parent == "base"


def test_cli_refuses_bad_flags_before_paddle_loads(tiny_model_dir, tmp_path):
    code = (
        "import sys; from paddlenlp_ext.serve.cli import main; rc = main(sys.argv[1:]); "
        "assert 'paddle' not in sys.modules, 'paddle was imported'; sys.exit(rc)"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--model_name_or_path",
            tiny_model_dir,
            "--lora_path",
            f"x={tmp_path / 'nope'}",
            "--max_batch_size",
            "0",
            "--max_length",
            "99999",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    for part in ("--max_batch_size 0: must be at least 1", "no such directory", "exceeds max_position_embeddings"):
        assert part in r.stderr


# ------------------------------------------------------------------ the scheduler on the tiny model, in process
@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from paddlenlp_ext.predict.options import PredictOptions

    models, problems = serve_models.plan_models(
        PredictOptions(model_name_or_path=tiny_model_dir, max_length=128), "base", []
    )
    assert not problems
    serve_models.load_models(models)
    return models[0]


def run_jobs(served, specs, cancel=()):
    """Run chat requests [(question, max_tokens, stop)] as ONE batch; (events per job, scheduler stats)."""
    from paddlenlp_ext.serve.engine import Job, Scheduler

    loop = asyncio.new_event_loop()
    jobs = []
    for question, max_tokens, stop in specs:
        req = parse_chat(
            {
                "model": "base",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens,
                "stop": stop,
            },
            ["base"],
            GREEDY,
        )
        jobs.append(Job(req, served, serve_models.prompt_ids(req, served), max_tokens, loop))
    for i in cancel:
        jobs[i].cancel()
    sched = Scheduler([served])
    sched._run(jobs)  # noqa: SLF001 -- the worker's step, run here synchronously
    loop.run_until_complete(asyncio.sleep(0.01))
    events = []
    for j in jobs:
        evs = []
        while not j.queue.empty():
            evs.append(j.queue.get_nowait())
        events.append(evs)
    loop.close()
    return events, sched.stats


def answer(events):
    deltas = "".join(e[1] for e in events if e[0] == "delta")
    done = [e for e in events if e[0] == "done"]
    return deltas, done[0] if done else None


def test_batched_rows_equal_each_row_alone(served):
    specs = [("type#dress", 12, None), ("a much longer question about a blue casual dress", 20, None), ("hi", 5, None)]
    together, stats = run_jobs(served, specs)
    assert stats["largest_batch"] == 3
    for spec, evs in zip(specs, together):
        alone = answer(run_jobs(served, [spec])[0][0])
        streamed, done = answer(evs)
        assert (streamed, done) == alone
        assert streamed == done[4] and done[3] == spec[1] and done[1] == "length"  # random weights: no EOS


def test_stop_sequence_and_cancel_end_rows_early(served):
    (evs,), _ = run_jobs(served, [("type#dress", 30, None)])
    full = answer(evs)[1][4]
    stop = full[6:9]
    (evs, cancelled), stats = run_jobs(served, [("type#dress", 30, [stop]), ("hi", 30, None)], cancel=[1])
    streamed, done = answer(evs)
    assert streamed == done[4] == full[: full.find(stop)] and done[1] == "stop"
    assert done[3] < 30 and cancelled == [], "the cancelled row still got events"
    assert stats["rows"] == 2


# ------------------------------------------------------------------ the HTTP layer in process (no model)
class _BrokenTokenizer:
    def __call__(self, text, **kw):
        raise RuntimeError("tokenizer exploded")


def test_http_errors_are_openai_shaped_even_for_bugs(tiny_model_dir):
    """Routes, bad bodies and an internal failure (a tokenizer that raises) all answer OpenAI's error JSON."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.serve.app import build_app
    from paddlenlp_ext.serve.engine import Scheduler

    model = serve_models.ServedModel(
        name="m",
        options=PredictOptions(tiny_model_dir, max_length=64),
        session=SimpleNamespace(tokenizer=_BrokenTokenizer(), use_template=False),
    )
    client = TestClient(build_app([model], Scheduler([model]), GREEDY), raise_server_exceptions=False)
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"
    for method, path, body, status in (
        ("post", "/v1/chat/completions", b"[", 400),
        ("post", "/v1/completions", b'{"model": "x", "prompt": "a"}', 404),
        ("get", "/v1/chat/completions", None, 405),
        ("get", "/nowhere", None, 404),
        ("post", "/v1/completions", b'{"model": "m", "prompt": "a"}', 500),
    ):
        r = getattr(client, method)(path, content=body) if body is not None else getattr(client, method)(path)
        assert r.status_code == status, (path, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    assert "tokenizer exploded" in r.json()["error"]["message"]
    assert "chat.js" in client.get("/").text and "getReader" in client.get("/static/chat.js").text
