"""``--batching continuous``: requests that arrive while others generate join the running batch at the next
step and leave it when they end, and each gets exactly the answer it gets alone (greedy, seeded sampling,
logprobs, echo), judged against the same server answering one request at a time."""

import concurrent.futures
import json
import time
import urllib.request

import pytest

from paddlenlp_ext.serve.process import ServerProcess, post

pytestmark = pytest.mark.slow

PROMPTS = [f"type#dress*color#{w}" for w in ["blue", "red", "green", "black", "white", "long", "silk", "loose"]]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(["--model_name_or_path", tiny_model_dir, "--served_model_name", "base", "--max_length", "512",
                        "--batching", "continuous", "--max_batch_size", "6", "--batch_wait_ms", "0"]) as srv:
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
            assert max(abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"][1:],
                                                  b["logprobs"]["token_logprobs"][1:])) < 1e-4
    health = json.load(urllib.request.urlopen(server.url + "/health"))
    assert 2 <= health["largest_batch"] <= 6, health  # rows shared steps, never over --max_batch_size
    log = server.log()
    assert "new tokens in" in log


def test_sigterm_drains_the_running_batch(tiny_model_dir):
    with ServerProcess(["--model_name_or_path", tiny_model_dir, "--served_model_name", "base", "--max_length", "512",
                        "--batching", "continuous"]) as srv:
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            futs = [ex.submit(post, srv.url + "/v1/chat/completions", {
                "model": "base", "messages": [{"role": "user", "content": p}], "max_tokens": 60, "temperature": 0})
                for p in PROMPTS[:3]]
            time.sleep(1.0)
            assert srv.terminate() == 0
            assert [f.result()[0] for f in futs] == [200, 200, 200]
