"""Tokenizers given only as tokenizer.json (models/tokenizer.py), judged against transformers' AutoTokenizer.

The test tokenizers are byte-level BPEs trained here with the ``tokenizers`` library
(a Qwen2-style and a Llama-3-style pre-tokenizer) and saved by transformers as
tokenizer.json + tokenizer_config.json only -- the files the hub ships.
"""

import json
import os

import pytest

from conftest import ROOT
from hf_tokenizers import CHINESE, build
from paddlenlp_ext.models.tokenizer import TokenizerLoadError, load_tokenizer, uses_fast_file

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def shared_data(name):
    for d in (os.path.join(os.path.dirname(ROOT), "shared", "data"), "/work/shared/data"):
        if os.path.isfile(os.path.join(d, name)):
            return os.path.join(d, name)
    return None


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def pair(request, tmp_path_factory):
    d = build(str(tmp_path_factory.mktemp(request.param)), request.param)
    return request.param, load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)


def assert_same_ids(ours, ref, texts):
    for t in texts:
        assert list(ours(t)["input_ids"]) == ref(t)["input_ids"], t
        assert list(ours(t, add_special_tokens=False)["input_ids"]) == ref(t, add_special_tokens=False)["input_ids"], t


def test_special_tokens_come_from_tokenizer_config(pair):
    style, ours, ref = pair
    assert type(ours).__module__.startswith("paddlenlp.")
    for attr in ("bos_token", "eos_token", "pad_token", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert len(ours) == len(ref)
    if style == "qwen2":
        assert ours.eos_token == "<|im_end|>" and ours.pad_token_id == 0 and ours.bos_token is None
    else:
        assert ours.bos_token_id == 700 and ours.eos_token_id == 702
        assert ours("hi")["input_ids"][0] == 700  # the post-processor's bos, as transformers adds it
    text = "<|im_start|>user\n你好<|im_end|>" if style == "qwen2" else "<|begin_of_text|>hi<|eot_id|>"
    assert_same_ids(ours, ref, [text])  # added tokens are atomic
    ids = ref(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_chinese_text_ids_and_round_trip(pair):
    _, ours, ref = pair
    assert_same_ids(ours, ref, CHINESE)
    for t in CHINESE:
        ids = ours(t, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == t


def test_every_alpaca_demo_line_equals_transformers(pair):
    path = shared_data("alpaca_en_demo.json")
    if path is None:
        pytest.skip("shared demo data (alpaca_en_demo.json) is absent")
    _, ours, ref = pair
    texts = []
    with open(path, encoding="utf-8") as f:
        for ex in json.load(f):
            texts += [ex[k] for k in ("instruction", "input", "output") if ex.get(k)]
    assert len(texts) > 2000
    got = ours(texts, add_special_tokens=True)["input_ids"]
    want = ref(texts, add_special_tokens=True)["input_ids"]
    bad = [t for t, g, w in zip(texts, got, want) if list(g) != w]
    assert not bad, bad[:3]


def test_the_calls_training_and_prediction_make(pair):
    """data/tokenize.py: tokenizer(text, add_special_tokens=False, return_attention_mask=False); the predictor:
    decode(skip_special_tokens=True, clean_up_tokenization_spaces=False)."""
    _, ours, ref = pair
    got = ours(CHINESE[1], add_special_tokens=False, return_attention_mask=False)
    assert (
        "attention_mask" not in got and list(got["input_ids"]) == ref(CHINESE[1], add_special_tokens=False)["input_ids"]
    )
    ids = ref(CHINESE[3])["input_ids"]
    kw = dict(skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert ours.decode(ids, **kw) == ref.decode(ids, **kw) == CHINESE[3]


def test_an_unknown_class_without_vocabulary_files_is_refused(tmp_path):
    d = build(str(tmp_path / "t"), "qwen2")
    assert uses_fast_file(d)
    path = os.path.join(d, "tokenizer_config.json")
    cfg = json.load(open(path))
    cfg["tokenizer_class"] = "ChatGLMTokenizer"  # no fast class in PaddleNLP
    json.dump(cfg, open(path, "w"))
    with pytest.raises(TokenizerLoadError, match="tokenizer_class='ChatGLMTokenizer'.*PreTrainedTokenizerFast"):
        load_tokenizer(d)


def test_sentencepiece_directories_keep_the_slow_tokenizer(tiny_model_dir):
    assert not uses_fast_file(tiny_model_dir)
    assert "Fast" not in type(load_tokenizer(tiny_model_dir)).__name__


def test_sentencepiece_vocabulary_saved_by_transformers_loads(tiny_model_dir, tmp_path):
    """transformers saves a SentencePiece vocabulary as tokenizer.model (no tokenizer.json for a slow
    tokenizer); PaddleNLP's LlamaTokenizer looks for sentencepiece.bpe.model and crashed with a TypeError.
    Loaded here, it encodes as transformers' own tokenizer does."""
    spm = os.path.join(tiny_model_dir, "sentencepiece.bpe.model")
    ref = transformers.LlamaTokenizer(vocab_file=spm, legacy=True)
    d = str(tmp_path / "hf_spm")
    ref.save_pretrained(d)
    assert os.path.isfile(os.path.join(d, "tokenizer.model")) and not uses_fast_file(d)
    ours = load_tokenizer(d)
    text = "Hello world, fine-tune me"
    assert ours(text)["input_ids"] == ref(text)["input_ids"]
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)


def test_chat_template_in_tokenizer_config_reaches_paddlenlps_chat_code(tmp_path):
    """The fast tokenizer exposes tokenizer_config.json's chat_template to PaddleNLP's chat code
    (apply_chat_template / encode_chat_inputs); rendering equals transformers'."""
    d = build(str(tmp_path / "t"), "qwen2")
    path = os.path.join(d, "tokenizer_config.json")
    cfg = json.load(open(path))
    cfg["chat_template"] = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    json.dump(cfg, open(path, "w"))
    ours, ref = load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
    msgs = [{"role": "user", "content": "你好"}]
    text = ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    src, tgt = ours.encode_chat_inputs([["你好", "hi"]])["conversations"][0]
    assert src == ref(text, add_special_tokens=False)["input_ids"]
    assert tgt == ref("hi<|im_end|>\n", add_special_tokens=False)["input_ids"]


def test_hf_layout_docstring_examples():
    import doctest

    from paddlenlp_ext.models import hf_layout

    assert doctest.testmod(hf_layout).failed == 0
