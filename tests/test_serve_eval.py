"""lm-evaluation-harness 0.4.13 against our server, judged by transformers on the HF export of the same model.

``llm/tools/eval.py`` runs lm-eval's own ``local-completions`` model (remote tokenizer through our
/tokenize, token-id prompts, batch size 8) on a local multiple-choice task of 60 questions written
here; the per-choice log-likelihoods lm-eval logged and its accuracy must equal what transformers
computes from the exported checkpoint, token for token as lm-eval split context and continuation.
A generate-until task then runs over both ``local-completions`` and ``local-chat-completions``.
Nothing is downloaded (local JSON task files, HF_DATASETS_OFFLINE).
"""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

EVAL = os.path.join(ROOT, "llm", "tools", "eval.py")
WORDS = [
    "dress",
    "blue",
    "casual",
    "shirt",
    "red",
    "skirt",
    "long",
    "cotton",
    "style",
    "color",
    "black",
    "white",
    "coat",
    "print",
    "slim",
    "loose",
    "silk",
    "green",
    "short",
    "sleeve",
]


def write_tasks(root):
    rng = np.random.default_rng(0)
    mc = root / "mc.jsonl"
    with open(mc, "w") as f:
        for i in range(60):
            q = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 8))))
            choices = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 4)))) for _ in range(4)]
            f.write(json.dumps({"question": f"type#{q}", "choices": choices, "answer": int(rng.integers(0, 4))}) + "\n")
    gen = root / "gen.jsonl"
    with open(gen, "w") as f:
        for i in range(6):
            q = " ".join(rng.choice(WORDS, size=4))
            f.write(json.dumps({"question": f"type#{q}", "answer": "dress"}) + "\n")
    (root / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    (root / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["</s>"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return str(root)


def run_eval(model_dir, tasks_dir, out, *extra):
    env = dict(
        os.environ,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_CACHE=os.path.join(out, "hf_cache"),
    )
    r = subprocess.run(
        [
            sys.executable,
            EVAL,
            "--model_name_or_path",
            model_dir,
            "--include_path",
            tasks_dir,
            "--output_dir",
            out,
            "--max_length",
            "256",
            "--log_samples",
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    samples = {}
    for path in glob.glob(os.path.join(out, "**", "samples_*.jsonl"), recursive=True):
        task = os.path.basename(path)[len("samples_") :].rsplit("_", 1)[0]
        with open(path) as f:
            samples[task] = [json.loads(line) for line in f if line.strip()]
    return results, samples


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir, tmp_path_factory):
    from paddlenlp_ext.export import export_hf_model

    out = str(tmp_path_factory.mktemp("hf_export") / "model")
    export_hf_model(tiny_model_dir, out, log=lambda *a, **k: None)
    return out


def hf_loglikelihood(model, tok, context, continuation):
    """lm-eval's own split (``TemplateLM._encode_pair``: trailing spaces move to the continuation, the whole
    encoded then cut after the context's tokens), scored by transformers in float32."""
    import torch

    n = len(context) - len(context.rstrip())
    if n:
        continuation, context = context[-n:] + continuation, context[:-n]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx) :]
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].float()  # [S, V]
    logp = torch.log_softmax(logits, dim=-1)
    return float(sum(logp[len(ctx) - 1 + j, t] for j, t in enumerate(cont)))


def test_lm_eval_loglikelihood_equals_transformers_on_the_export(tiny_model_dir, hf_model, tasks_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results, samples = run_eval(
        tiny_model_dir, tasks_dir, str(tmp_path / "mc"), "--tasks", "tiny_mc", "--batch_size", "8"
    )
    docs = samples["tiny_mc"]
    assert len(docs) == 60
    model = AutoModelForCausalLM.from_pretrained(hf_model, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf_model, use_fast=False)  # sentencepiece itself, as test_export
    correct, worst = [], 0.0
    for s in docs:
        ours = [float(r[0][0]) for r in s["resps"]]  # lm-eval's log-likelihood of each choice, from our logprobs
        # lm-eval 0.4.13 logs the requests as {"gen_args_i": {"arg_0": context, "arg_1": continuation}}
        judge = [hf_loglikelihood(model, tok, v["arg_0"], v["arg_1"]) for v in s["arguments"].values()]
        worst = max(worst, max(abs(a - b) for a, b in zip(ours, judge)))
        correct.append(int(np.argmax(judge)) == int(s["target"]))
    assert worst < 1e-3, f"a choice's log-likelihood differs from transformers' by {worst}"
    acc = results["results"]["tiny_mc"]["acc,none"]
    assert acc == pytest.approx(float(np.mean(correct)), abs=1e-9), (acc, np.mean(correct))


def test_lm_eval_generate_until_over_both_endpoints(tiny_model_dir, tasks_dir, tmp_path):
    from paddlenlp_ext.serve.process import ServerProcess, post

    _, comp = run_eval(tiny_model_dir, tasks_dir, str(tmp_path / "gen_c"), "--tasks", "tiny_gen", "--batch_size", "4")
    _, chat = run_eval(
        tiny_model_dir,
        tasks_dir,
        str(tmp_path / "gen_chat"),
        "--tasks",
        "tiny_gen",
        "--model",
        "local-chat-completions",
        "--apply_chat_template",
    )
    assert len(comp["tiny_gen"]) == len(chat["tiny_gen"]) == 6
    # lm-eval's answers are the server's greedy answers to the same prompts
    with ServerProcess(
        ["--model_name_or_path", tiny_model_dir, "--served_model_name", "base", "--max_length", "256"]
    ) as srv:
        for s in comp["tiny_gen"]:
            # lm-eval sends the context as token ids from our /tokenize, without special tokens
            ids = post(
                srv.url + "/tokenize", {"prompt": s["arguments"]["gen_args_0"]["arg_0"], "add_special_tokens": False}
            )[1]["tokens"]
            status, r = post(
                srv.url + "/v1/completions",
                {"model": "base", "prompt": ids, "max_tokens": 8, "temperature": 0, "stop": ["</s>"]},
            )
            assert status == 200 and s["resps"][0][0] == r["choices"][0]["text"]
        for s in chat["tiny_gen"]:
            messages = s["arguments"]["gen_args_0"]["arg_0"]  # lm-eval logs ['<the messages as JSON>']
            messages = json.loads(messages[0] if isinstance(messages, list) else messages)
            status, r = post(
                srv.url + "/v1/chat/completions",
                {"model": "base", "messages": messages, "max_tokens": 8, "temperature": 0},
            )
            assert status == 200, r
            assert s["resps"][0][0] == r["choices"][0]["message"]["content"]
