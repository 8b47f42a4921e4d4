"""The OpenAI surface real clients use, through the official ``openai`` client against the server process:
logprobs (judged by transformers on the HF export), echo, prompt lists and token ids, n and seed,
models.retrieve, vLLM's tokenizer routes, --api_key (401 / 200, and the chat page asking once in
headless Chromium) and /metrics in Prometheus' format (parsed by prometheus-client's own parser)."""

import json
import os
import urllib.error
import urllib.request

import numpy as np
import pytest

pytestmark = pytest.mark.slow

KEY = "s3cret-key"
PROMPT = "type#dress*color#blue"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from paddlenlp_ext.serve.process import ServerProcess

    with ServerProcess(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--served_model_name",
            "base",
            "--max_length",
            "256",
            "--api_key",
            KEY,
            "--batch_wait_ms",
            "20",
        ]
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(tiny_model_dir, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from paddlenlp_ext.export import export_hf_model

    out = str(tmp_path_factory.mktemp("hf_export_api") / "model")
    export_hf_model(tiny_model_dir, out, log=lambda *a, **k: None)
    return AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()


def call(server, path, body=None, key=KEY):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        server.url + path, data=data, headers=headers, method="GET" if body is None else "POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if r.headers.get_content_type() == "application/json" else raw.decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def hf_logprobs(hf, ids):
    """log p(ids[j] | ids[:j]) for j >= 1 and the log-softmax rows, from transformers in float32."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [S, V]
    return [float(logp[j - 1, t]) for j, t in enumerate(ids) if j], logp


def test_api_key_401_without_and_200_with(server, client):
    import openai

    for path, body in (
        ("/v1/models", None),
        ("/v1/completions", {"model": "base", "prompt": "a"}),
        ("/tokenize", {"prompt": "a"}),
        ("/tokenizer_info", None),
    ):
        status, err = call(server, path, body, key=None)
        assert status == 401 and err["error"]["code"] == "invalid_api_key", (path, status, err)
        assert call(server, path, body, key="wrong")[0] == 401
    assert call(server, "/health", key=None)[0] == 200 and call(server, "/", key=None)[0] == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert [m.id for m in client.models.list().data] == ["base"]
    assert client.models.retrieve("base").id == "base"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_completion_logprobs_and_echo_equal_transformers(server, client, hf):
    ids = call(server, "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    r = client.completions.create(model="base", prompt=ids, max_tokens=3, temperature=0, logprobs=3, echo=True)
    lp = r.choices[0].logprobs
    n = len(ids)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == n + 3
    seq = list(ids)
    for _ in range(3):  # transformers' own greedy continuation
        seq.append(int(hf_logprobs(hf, seq)[1][-1].argmax()))
    theirs, logp = hf_logprobs(hf, seq)
    assert np.allclose(lp.token_logprobs[1:], theirs, atol=1e-4), "not the model's log-softmax"
    # the top alternatives are transformers' top 3 at each generated position, most likely first
    top = lp.top_logprobs[n]
    assert np.allclose(sorted(top.values(), reverse=True), logp[n - 1].topk(3).values.numpy(), atol=1e-4)
    assert max(top.values()) == pytest.approx(lp.token_logprobs[n], abs=1e-6), "greedy took the most likely token"
    # echo with max_tokens 0 (lm-eval's scoring shape, OpenAI's legacy API): the prompt only
    z = call(server, "/v1/completions", {"model": "base", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0})[
        1
    ]
    assert (
        z["usage"]["completion_tokens"] == 0 and z["choices"][0]["logprobs"]["token_logprobs"] == lp.token_logprobs[:n]
    )


def test_chat_logprobs_n_and_seed(client):
    msgs = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(
        model="base", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content), "greedy == top-1"
    s = dict(model="base", messages=msgs, max_tokens=8, temperature=1.5, n=3, seed=11)
    a, b = client.chat.completions.create(**s), client.chat.completions.create(**s)
    texts = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.message.content for c in sorted(b.choices, key=lambda c: c.index)], "seeded n not repeatable"
    assert len(set(texts)) > 1, "the n choices of a sampled request are all the same"
    # OpenAI's defaults, as an SDK may send them
    d = client.chat.completions.create(
        model="base",
        messages=msgs,
        max_tokens=2,
        response_format={"type": "text"},
        logprobs=False,
        n=1,
        presence_penalty=0,
        frequency_penalty=0,
    )
    assert d.choices[0].logprobs is None


def test_prompt_lists_and_token_ids(server, client):
    ids = call(server, "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    alone = client.completions.create(model="base", prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text
    assert client.completions.create(model="base", prompt=ids, max_tokens=5, temperature=0).choices[0].text == alone
    r = client.completions.create(model="base", prompt=[PROMPT, "hi", PROMPT], max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert r.choices[0].text == r.choices[1].text == r.choices[4].text == alone
    r = client.completions.create(model="base", prompt=[ids, ids[:3]], max_tokens=5, temperature=0)
    assert r.choices[0].text == alone and r.usage.prompt_tokens == len(ids) + 3
    # streamed, with logprobs
    chunks = list(
        client.completions.create(model="base", prompt=PROMPT, max_tokens=5, temperature=0, stream=True, logprobs=1)
    )
    assert "".join(c.choices[0].text for c in chunks) == alone
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == 5


def test_tokenizer_routes_as_lm_eval_reads_them(server):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(server.url + "/v1/completions", auth_token=KEY)
    tok = RemoteTokenizer(server.url + "/v1/completions", auth_token=KEY)
    ids = tok.encode("blue dress")
    assert tok.decode(ids) == "blue dress" and tok.eos_token == "</s>" and tok.eos_token_id == 2
    st, r = call(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert st == 200 and r["count"] == len(r["tokens"]) > 0
    assert call(server, "/detokenize", {"tokens": [10**9]})[0] == 400


def test_metrics_in_prometheus_format(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="base", prompt="hi", max_tokens=3, temperature=0)
    status, text = call(server, "/metrics", key=None)
    assert status == 200
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert samples[("paddlenlp_ext_serve_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 1
    assert samples[("paddlenlp_ext_serve_generation_tokens_total", (("model", "base"),))] >= 3
    assert samples[("paddlenlp_ext_serve_batch_size_rows_count", ())] >= 1
    assert (
        "paddlenlp_ext_serve_e2e_request_latency_seconds_bucket",
        (("endpoint", "/v1/completions"), ("le", "+Inf")),
    ) in samples
    assert (
        "paddlenlp_ext_serve_num_requests_waiting" in fams and "paddlenlp_ext_serve_time_to_first_token_seconds" in fams
    )


def test_chat_page_asks_for_the_key_once(server, tmp_path):
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        driver.get(server.url + "/")
        wait = WebDriverWait(driver, 60)
        # the prompt opens only after the page's first fetch comes back 401: poll until it is there
        alert = WebDriverWait(driver, 60, ignored_exceptions=(NoAlertPresentException,)).until(
            lambda d: d.switch_to.alert
        )
        alert.send_keys(KEY)
        alert.accept()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) == 1)
        driver.find_element(By.ID, "input").send_keys(PROMPT)
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text.startswith("done"))
        driver.refresh()  # asked once: the key is kept
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model option")) == 1)
    finally:
        driver.quit()
