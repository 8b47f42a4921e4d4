"""``--batching continuous``: requests that arrive while others generate join the running batch at the next
step and leave it when they end, and each gets exactly the answer it gets alone (greedy, seeded sampling,
logprobs, echo), judged against the same server answering one request at a time; rows for the base and for
4 per-row LoRA adapters share the running batch (the official openai client)."""

import concurrent.futures
import json
import time
import urllib.request

import pytest

from paddlenlp_ext.serve.process import ServerProcess, post

pytestmark = pytest.mark.slow

PROMPTS = [f"type#dress*color#{w}" for w in ["blue", "red", "green", "black", "white", "long", "silk", "loose"]]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from test_serve_e2e import make_lora

    root = tmp_path_factory.mktemp("continuous_loras")
    loras = [
        x for i in range(4) for x in ("--lora_path", f"a{i}={make_lora(tiny_model_dir, str(root / f'a{i}'), 10 + i)}")
    ]
    with ServerProcess(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--served_model_name",
            "base",
            "--max_length",
            "512",
            "--batching",
            "continuous",
            "--max_batch_size",
            "6",
            "--batch_wait_ms",
            "0",
        ]
        + loras
    ) as srv:
        yield srv


def body(i):
    b = {"model": "base", "prompt": PROMPTS[i], "max_tokens": 6 + 7 * i}
    b.update({"temperature": 0} if i % 2 == 0 else {"temperature": 1.2, "top_p": 0.9, "seed": i})
    if i % 3 == 0:
        b.update(logprobs=2, echo=True)
    return b


def test_rows_join_at_the_next_step_and_get_their_own_answer(server):
    alone = [post(server.url + "/v1/completions", body(i))[1]["choices"][0] for i in range(len(PROMPTS))]

    def staggered(i):
        time.sleep(0.04 * i)  # each arrives while earlier ones are generating
        return post(server.url + "/v1/completions", body(i))[1]["choices"][0]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
        together = list(ex.map(staggered, range(len(PROMPTS))))
    for i, (a, b) in enumerate(zip(alone, together)):
        assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"], i
        if a["logprobs"]:
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
            assert (
                max(
                    abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"][1:], b["logprobs"]["token_logprobs"][1:])
                )
                < 1e-4
            )
    health = json.load(urllib.request.urlopen(server.url + "/health"))
    assert 2 <= health["largest_batch"] <= 6, health  # rows shared steps, never over --max_batch_size
    log = server.log()
    assert "new tokens in" in log


def test_sigterm_drains_the_running_batch(tiny_model_dir):
    with ServerProcess(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--served_model_name",
            "base",
            "--max_length",
            "512",
            "--batching",
            "continuous",
        ]
    ) as srv:
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            futs = [
                ex.submit(
                    post,
                    srv.url + "/v1/chat/completions",
                    {"model": "base", "messages": [{"role": "user", "content": p}], "max_tokens": 60, "temperature": 0},
                )
                for p in PROMPTS[:3]
            ]
            time.sleep(1.0)
            assert srv.terminate() == 0
            assert [f.result()[0] for f in futs] == [200, 200, 200]


def test_base_and_adapter_rows_share_the_running_batch_through_the_openai_client(server):
    """4 per-row LoRA adapters and the base: concurrent requests share the running batch (rows of several
    adapters in one decode step, serve.multilora) and each gets the greedy text it gets alone."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    asks = [(m, PROMPTS[i % len(PROMPTS)]) for i, m in enumerate(["base", "a0", "a1", "a2", "a3"] * 2)]

    def ask(m, p):
        return client.completions.create(model=m, prompt=p, max_tokens=12, temperature=0).choices[0].text

    alone = [ask(m, p) for m, p in asks]
    assert len(set(alone[:5])) == 5  # each adapter answers its own way
    before = json.load(urllib.request.urlopen(server.url + "/health"))
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as ex:
        together = list(ex.map(lambda a: ask(*a), asks))
    after = json.load(urllib.request.urlopen(server.url + "/health"))
    assert together == alone
    assert after["batches"] - before["batches"] < len(asks), "the requests ran one after another"
