"""Many LoRA adapters on one base, applied per row (serve.multilora).

* In process: the per-row base+adapter logits equal the predictor's merged copy's (atol 1e-4), for a
  batch mixing the base and two adapters.
* Served: with 4 adapters, a batch mixing base and adapter rows gives each row exactly the greedy text
  it gets alone (with ``--batching continuous``: in process, and tests/test_serve_continuous.py through the
  openai client); ``/v1/models`` lists the adapters with ``parent``; ``--max_loras``.
* Runtime ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's shapes) behind
  ``--allow_runtime_lora_updating``; 404 without it.
* Memory: the server's peak RSS (VmHWM) with 4 adapters on a hidden-512 x 8-layer base is at most
  1.3x the base-only server's.
"""

import os
import threading

import numpy as np
import pytest
from test_serve_e2e import make_lora

from conftest import DATA_DIR, ROOT

PROMPTS = ["Write a poem about", "SELECT name FROM", "The blue dress"]


@pytest.fixture(scope="module")
def four(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("four_loras")
    return {f"a{i}": make_lora(tiny_model_dir, str(root / f"a{i}"), 10 + i) for i in range(4)}


def test_per_row_logits_equal_the_merged_copy(tiny_model_dir, four):
    import paddle

    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.predict.session import load_session, load_tokenizer
    from paddlenlp_ext.serve.models import ServedModel, add_row_adapter

    o = PredictOptions(model_name_or_path=tiny_model_dir, max_length=128)
    tok, use_template = load_tokenizer(o)
    base = ServedModel("base", o, session=load_session(o, tok, use_template))
    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 500, size=(3, 12)).astype("int64"))  # [3, 12]
    with paddle.no_grad():
        want_base = base.session.model(input_ids=ids)[0].numpy()
    merged = {}
    for name in ("a0", "a1"):
        s = load_session(
            PredictOptions(model_name_or_path=tiny_model_dir, max_length=128, lora_path=four[name]), tok, use_template
        )
        with paddle.no_grad():
            merged[name] = s.model(input_ids=ids)[0].numpy()
        add_row_adapter(
            base, ServedModel(name, PredictOptions(model_name_or_path=tiny_model_dir, lora_path=four[name]))
        )
    base.table.set_rows([0, -1, 1])  # row 0: a0, row 1: base, row 2: a1
    with paddle.no_grad():
        got = base.session.model(input_ids=ids)[0].numpy()
    np.testing.assert_allclose(got[0], merged["a0"][0], atol=1e-4)
    np.testing.assert_allclose(got[1], want_base[1], atol=1e-4)
    np.testing.assert_allclose(got[2], merged["a1"][2], atol=1e-4)
    assert np.abs(merged["a0"][0] - want_base[0]).max() > 1e-2  # the adapter changes the output
    base.table.set_rows([1, 1, 1])  # every row of the batch for a1
    with paddle.no_grad():
        got = base.session.model(input_ids=ids)[0].numpy()
    np.testing.assert_allclose(got, merged["a1"], atol=1e-4)
    base.table.remove("a0")
    base.table.set_rows([-1, -1, 1])
    with paddle.no_grad():
        got = base.session.model(input_ids=ids)[0].numpy()
    np.testing.assert_allclose(got[:2], want_base[:2], atol=1e-4)


def _served_with_four(tiny_model_dir, four):
    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.serve import models as serve_models

    models, problems = serve_models.plan_models(
        PredictOptions(model_name_or_path=tiny_model_dir, max_length=128),
        "base",
        [f"{n}={four[n]}" for n in sorted(four)],
    )
    assert not problems
    serve_models.load_models(models)
    assert all(m.slot is not None for m in models[1:])  # applied per row on the one base
    return {m.name: m for m in models}


def _job(models, name, prompt, max_tokens, loop):
    from paddlenlp_ext.serve import models as serve_models
    from paddlenlp_ext.serve.engine import Job
    from paddlenlp_ext.serve.protocol import Sampling, parse_chat

    req = parse_chat(
        {"model": name, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens},
        list(models),
        Sampling(),
    )
    return Job(req, models[name], serve_models.prompt_ids(req, models[name]), max_tokens, loop)


def _text(job):
    done = []
    while not job.queue.empty():
        e = job.queue.get_nowait()
        if e[0] == "done":
            done.append(e)
    assert len(done) == 1, done
    return done[0][1], done[0][4]  # (finish reason, text)


@pytest.mark.parametrize("max_loras", [4, 2])
def test_continuous_batch_mixes_base_and_adapter_rows(tiny_model_dir, four, max_loras):
    """--batching continuous: requests for the base and 4 per-row adapters, arriving in waves, share one running
    batch (several adapters in one decode step, never over --max_loras), and each gets exactly the greedy text
    it gets served alone."""
    import asyncio

    from paddlenlp_ext.serve.continuous import ContinuousLoop
    from paddlenlp_ext.serve.engine import Scheduler

    models = _served_with_four(tiny_model_dir, four)
    names = ["base"] + sorted(four)
    loop = asyncio.new_event_loop()
    specs = [(names[i % 5], PROMPTS[i % 3] + f" {i}", 3 + 4 * (i % 4)) for i in range(15)]
    alone = []
    for spec in specs:
        job = _job(models, *spec, loop)
        Scheduler(list(models.values()))._run([job])  # noqa: SLF001 -- one request alone, as the worker runs it
        loop.run_until_complete(asyncio.sleep(0))
        alone.append(_text(job))
    same = [_job(models, n, PROMPTS[0], 8, loop) for n in names]
    for job in same:
        Scheduler(list(models.values()))._run([job])  # noqa: SLF001
    loop.run_until_complete(asyncio.sleep(0))
    assert len({_text(j)[1] for j in same}) == len(names)  # each adapter answers its own way
    sched = Scheduler(list(models.values()), max_batch_size=8, batch_wait=0, continuous=True, max_loras=max_loras)
    worker = ContinuousLoop(sched)
    jobs = [_job(models, *spec, loop) for spec in specs]
    waves, mixed = [jobs[:6], jobs[6:11], jobs[11:]], 0
    for step in range(200):
        if step % 3 == 0 and waves:  # a wave arrives while earlier rows generate
            for j in waves.pop(0):
                sched.submit(j)
        if not sched.waiting and (worker.running is None or not len(worker.running)) and not waves:
            break
        assert worker.step()
        if worker.running is not None and len(worker.running):
            slots = {int(s) for s in worker.running.slots if s >= 0}
            assert len(slots) <= max_loras
            mixed = max(mixed, len(slots) + bool((worker.running.slots < 0).any()))
    loop.run_until_complete(asyncio.sleep(0))
    assert mixed >= min(max_loras, 4), "base and adapter rows never shared a decode step"
    assert [_text(j) for j in jobs] == alone
    assert models["base"].table.rows is None  # nothing left set for the next forward
    loop.close()


def complete(url, model, prompt):
    from paddlenlp_ext.serve.process import post

    status, body = post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.mark.slow
def test_mixed_batch_rows_equal_each_row_alone_and_runtime_updating(tiny_model_dir, four):
    import json
    import urllib.request

    from paddlenlp_ext.serve.process import ServerProcess, post

    names = ["base"] + sorted(four)
    args = [
        "--model_name_or_path",
        tiny_model_dir,
        "--served_model_name",
        "base",
        "--max_length",
        "128",
        "--batch_wait_ms",
        "1500",
        "--max_batch_size",
        "16",
    ]
    with ServerProcess(args + [x for n in sorted(four) for x in ("--lora_path", f"{n}={four[n]}")]) as srv:
        with urllib.request.urlopen(srv.url + "/v1/models") as r:
            cards = {c["id"]: c for c in json.load(r)["data"]}
        assert cards["base"]["parent"] is None and all(
            cards[n]["parent"] == "base" and cards[n]["per_row"] for n in four
        )
        alone = {(m, p): complete(srv.url, m, p) for m in names for p in PROMPTS}
        assert len({alone[(m, PROMPTS[0])] for m in names}) == len(names), alone  # each adapter answers its own way
        got, threads = {}, []
        for m in names:
            for p in PROMPTS:
                threads.append(
                    threading.Thread(target=lambda m=m, p=p: got.__setitem__((m, p), complete(srv.url, m, p)))
                )
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with urllib.request.urlopen(srv.url + "/health") as r:
            health = json.load(r)
        assert health["largest_batch"] >= 8, (health, srv.log())  # base and adapter rows shared a batch
        assert got == alone
        # no runtime updating without the flag
        assert post(srv.url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": four["a0"]})[0] == 404

    with ServerProcess(args + ["--allow_runtime_lora_updating", "--max_loras", "1"]) as srv:
        from paddlenlp_ext.serve.process import post as post_raw  # noqa: F401 -- JSON answers only

        req = urllib.request.Request(
            srv.url + "/v1/load_lora_adapter",
            method="POST",
            data=json.dumps({"lora_name": "a2", "lora_path": four["a2"]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req) as r:
            assert r.status == 200 and "added" in r.read().decode()
        with urllib.request.urlopen(srv.url + "/v1/models") as r:
            cards = {c["id"]: c for c in json.load(r)["data"]}
        assert cards["a2"]["parent"] == "base"
        assert complete(srv.url, "a2", PROMPTS[1]) == alone[("a2", PROMPTS[1])]
        assert complete(srv.url, "base", PROMPTS[1]) == alone[("base", PROMPTS[1])]
        status, body = post(srv.url + "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": four["a2"]})
        assert status == 400 and "already served" in body["error"]["message"]
        status, body = post(srv.url + "/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "/nonexistent"})
        assert status == 400 and "/nonexistent" in body["error"]["message"]
        req = urllib.request.Request(
            srv.url + "/v1/unload_lora_adapter",
            method="POST",
            data=json.dumps({"lora_name": "a2"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req) as r:
            assert r.status == 200 and "removed" in r.read().decode()
        status, body = post(srv.url + "/v1/completions", {"model": "a2", "prompt": "x", "max_tokens": 2})
        assert status in (400, 404) and "a2" in body["error"]["message"]
        assert post(srv.url + "/v1/unload_lora_adapter", {"lora_name": "a2"})[0] == 404
        assert complete(srv.url, "base", PROMPTS[1]) == alone[("base", PROMPTS[1])]


def vm_hwm_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.slow
def test_four_adapters_cost_at_most_1_3x_the_base_only_server(tmp_path_factory):
    from paddlenlp_ext.models.tiny import ensure_tiny_model
    from paddlenlp_ext.serve.process import ServerProcess

    big = ensure_tiny_model(
        os.path.join(ROOT, "build", "mid-llama-512x8"),
        DATA_DIR,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        initializer_range=0.02,
    )
    root = tmp_path_factory.mktemp("mid_loras")
    loras = [make_lora(big, str(root / f"m{i}"), 20 + i) for i in range(4)]
    args = ["--model_name_or_path", big, "--served_model_name", "base", "--max_length", "128"]
    peaks = {}
    for what, extra in (
        ("base", []),
        ("4 loras", [x for i, p in enumerate(loras) for x in ("--lora_path", f"m{i}={p}")]),
    ):
        with ServerProcess(args + extra) as srv:
            for m in ["base"] + [f"m{i}" for i in range(4) if extra]:
                complete(srv.url, m, PROMPTS[0])
            peaks[what] = vm_hwm_kb(srv.proc.pid)
    weights = sum(os.path.getsize(os.path.join(big, f)) for f in os.listdir(big) if f.endswith(".safetensors"))
    print(
        f"VmHWM base-only {peaks['base'] / 1024:.0f} MiB, with 4 LoRA {peaks['4 loras'] / 1024:.0f} MiB "
        f"(base weights {weights / 2**20:.0f} MiB)"
    )
    assert peaks["4 loras"] <= 1.3 * peaks["base"], peaks
    # the bound means something: 4 merged copies of the base would add 4x the weights
    assert 4 * weights / 1024 > 0.3 * peaks["base"], (weights, peaks)
