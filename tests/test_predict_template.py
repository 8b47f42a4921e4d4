"""Prompts of the predictor and the server under a jinja chat template, judged against transformers.

A tokenizer.json-only directory (tests/hf_tokenizers.py: Qwen2-style and Llama-3-style byte-level BPEs)
gets a chat template with a system slot in its tokenizer_config.json.  The ids the predictor
(``predict.prompts.build_prompt``) and the server (``serve.models.prompt_ids``) build for
[system, user, ...] equal ``transformers.AutoTokenizer.apply_chat_template(..., add_generation_prompt=True)``:
the system message is kept (PaddleNLP's ``encode_chat_inputs`` drops it).
"""

import json
import os

import pytest

from hf_tokenizers import build

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

# Qwen2.5's layout: a system block when given, each turn in <|im_start|>role ... <|im_end|>, the header of
# the answer as generation prompt (the end-of-turn token is spelled out: Llama-3-style has no <|im_end|>)
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM, Q1, A1, Q2 = "Be brief.", "Describe a red coat.", "A red coat.", "And a blue skirt?"


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def template_dir(request, tmp_path_factory):
    d = build(str(tmp_path_factory.mktemp(request.param)), request.param)
    path = os.path.join(d, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TEMPLATE
    with open(path, "w") as f:
        json.dump(cfg, f)
    return d


def ours(model_dir):
    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.predict.session import load_tokenizer, prompt_template

    o = PredictOptions(model_dir)
    tok, use_template = load_tokenizer(o)
    return tok, use_template, prompt_template(o)


def hf_ids(model_dir, messages):
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def test_predictor_prompt_keeps_the_system_message_as_transformers(template_dir):
    from paddlenlp_ext.predict.inputs import PromptRecord
    from paddlenlp_ext.predict.prompts import build_prompt

    tok, use_template, jinja = ours(template_dir)
    assert jinja == TEMPLATE
    one = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}]
    p = build_prompt(PromptRecord(src=[Q1], history=[], system=SYSTEM), tok, 1024, 2048, use_template, jinja)
    want = hf_ids(template_dir, one)
    assert p.ids == want and p.max_new_tokens == 2048 - len(want) and not p.truncated
    assert tok.decode(p.ids).startswith(f"<|im_start|>system\n{SYSTEM}")
    # multi-turn: every earlier round rendered as transformers renders it
    turns = one + [{"role": "assistant", "content": A1}, {"role": "user", "content": Q2}]
    rec = PromptRecord(src=[Q1, Q2], history=[A1], system=SYSTEM)
    assert build_prompt(rec, tok, 1024, 2048, use_template, jinja).ids == hf_ids(template_dir, turns)
    # src_length too small for the earlier round: it is dropped, the system message and last question stay
    short = hf_ids(template_dir, [one[0], {"role": "user", "content": Q2}])
    p = build_prompt(rec, tok, len(short), 2048, use_template, jinja)
    assert p.ids == short and p.dropped_rounds == 1 and p.truncated


def test_server_prompt_keeps_the_system_message_as_transformers(template_dir):
    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.predict.session import Session
    from paddlenlp_ext.serve.models import ServedModel, prompt_ids
    from paddlenlp_ext.serve.protocol import Sampling, parse_chat

    tok, use_template, jinja = ours(template_dir)
    session = Session(
        model=None,
        tokenizer=tok,
        use_template=use_template,
        eos_ids=[tok.eos_token_id],
        pad_id=0,
        device="cpu",
        description="test",
        jinja=jinja,
    )
    served = ServedModel("m", PredictOptions(template_dir, max_length=1024), session=session)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": Q1},
        {"role": "assistant", "content": A1},
        {"role": "user", "content": Q2},
    ]
    req = parse_chat({"model": "m", "messages": messages}, ["m"], Sampling(greedy=True))
    assert prompt_ids(req, served) == hf_ids(template_dir, messages)  # accepted, and the system message is in it
