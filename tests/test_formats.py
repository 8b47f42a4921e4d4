"""Dataset formats (paddlenlp_ext/data/formats): readers, detection, bad input with file:line, text chunks."""

import doctest
import json

import pytest

from paddlenlp_ext.data import conversation
from paddlenlp_ext.data.conversation import Renderer, shift_and_fit, text_features, to_example
from paddlenlp_ext.data.formats import Conversation, Message, TextDoc, detect_format, read_items
from paddlenlp_ext.data.formats import alpaca, convo, files, messages, sharegpt
from paddlenlp_ext.data.reader import DataError, Example, dataset_files
from paddlenlp_ext.data.tokenize import tokenize_example

GLAIVE = {
    "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": '{"t": 20}'},
        {"from": "gpt", "value": "It is 20 C."},
    ],
    "tools": '[{"name": "get_weather", "parameters": {"type": "object"}}]',
}


@pytest.mark.parametrize("module", [conversation, convo, files, alpaca, sharegpt, messages])
def test_docstring_examples(module):
    res = doctest.testmod(module, verbose=False)
    assert res.failed == 0


def write(tmp_path, name, records, array=False):
    p = tmp_path / name
    if array:
        p.write_text(json.dumps(records, indent=2))
    else:
        p.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(p)


def test_detect_each_format():
    assert detect_format({"src": "a", "tgt": "b"}) == "paddlenlp"
    assert detect_format({"instruction": "a", "input": "", "output": "b"}) == "alpaca"
    assert detect_format(GLAIVE) == "sharegpt"
    assert detect_format({"messages": [{"role": "user", "content": "a"}]}) == "messages"
    assert detect_format({"text": "doc"}) == "text"
    assert detect_format({"question": "a"}) is None
    assert detect_format({"question": "a", "answer": "b"}, {"prompt": "question", "response": "answer"}) == "alpaca"


def test_alpaca_with_system_and_history(tmp_path):
    rec = {"instruction": "Add", "input": "1 2", "output": "3", "system": "Be exact.", "history": [["hi", "hello"]]}
    (conv,), fmts = read_items([write(tmp_path, "a.json", [rec], array=True)])
    assert [(m.role, m.content) for m in conv.messages] == [
        ("system", "Be exact."),
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "Add\n1 2"),
        ("assistant", "3"),
    ]
    assert conv.origin.endswith("a.json:2") and list(fmts.values()) == ["alpaca"]
    assert to_example(conv) == Example(
        src=["hi", "Add\n1 2"], tgt=["hello", "3"], system="Be exact.", origin=conv.origin
    )


def test_sharegpt_tools_and_function_calls(tmp_path):
    (conv,), _ = read_items([write(tmp_path, "g.jsonl", [GLAIVE])])
    assert [m.role for m in conv.messages] == ["user", "assistant", "tool", "assistant"]
    assert conv.messages[1].tool_calls == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert conv.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_sharegpt_renamed_tags(tmp_path):
    rec = {"dialog": [{"speaker": "u", "text": "hi"}, {"speaker": "a", "text": "yo"}]}
    cols = {"messages": "dialog", "role_tag": "speaker", "content_tag": "text", "user_tag": "u", "assistant_tag": "a"}
    (conv,), _ = read_items([write(tmp_path, "t.jsonl", [rec])], "sharegpt", cols)
    assert [(m.role, m.content) for m in conv.messages] == [("user", "hi"), ("assistant", "yo")]


def test_openai_messages_parts_reasoning_and_tool_call_text(tmp_path):
    rec = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}],
            },
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "4", "reasoning_content": "2+2=4", "loss_weight": 1},
        ],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}],
    }
    (conv,), _ = read_items([write(tmp_path, "m.jsonl", [rec])])
    assert conv.messages[0].content == "2+2?"
    assert conv.messages[1].tool_calls[0]["function"]["arguments"] == {"a": 2, "b": 2}
    assert conv.messages[3].reasoning == "2+2=4" and conv.messages[3].loss is True
    assert conv.messages[3].as_template_dict()["reasoning_content"] == "2+2=4"


def test_text_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    txt = tmp_path / "w.txt"
    txt.write_text("first doc\n\nsecond doc\n")
    docs, fmts = read_items([str(txt)])
    assert [(d.text, d.origin.rsplit(":", 1)[1]) for d in docs] == [("first doc", "1"), ("second doc", "3")]
    pq.write_table(pa.table({"instruction": ["q1", "q2"], "output": ["a1", "a2"]}), str(tmp_path / "p.parquet"))
    convs, fmts = read_items([str(tmp_path / "p.parquet")])
    assert [c.messages[-1].content for c in convs] == ["a1", "a2"] and convs[1].origin.endswith("p.parquet:2")


def test_paddlenlp_records_unchanged(tmp_path):
    path = write(tmp_path, "train.json", [{"src": "a", "tgt": "b"}])
    (ex,), fmts = read_items([path])
    assert ex == Example(src=["a"], tgt=["b"], system=None, origin=f"{path}:1") and fmts[path] == "paddlenlp"
    bad = write(tmp_path, "bad.json", [{"src": "a", "tgt": "b"}, {"src": "a"}])
    with pytest.raises(DataError, match=r"bad.json:2: missing key 'tgt'"):
        read_items([bad])


@pytest.mark.parametrize(
    "record, message",
    [
        ({"question": "q"}, r"x.json:3: the record matches no dataset format \(it has \['question'\]\)"),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{city: 1}"}}],
                    },
                ]
            },
            r"x.json:3: messages\[2\]: tool call arguments are not valid JSON",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
            r"x.json:3: message 2 is an empty assistant turn",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "b"},
                ]
            },
            r"x.json:3: the conversation starts with 'assistant'",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "tool", "content": "r"},
                    {"role": "assistant", "content": "b"},
                ]
            },
            r"x.json:3: message 2 is a tool result that follows no",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": "u"}]},
                    {"role": "assistant", "content": "b"},
                ]
            },
            r"content part of type 'image_url' is not supported",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b", "loss_weight": 0.5}]},
            r"loss_weight must be 0 \(not learned\) or 1",
        ),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, record, message):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = str(tmp_path / "x.json")
    with open(path, "w") as f:
        f.write("[\n" + json.dumps(good) + ",\n" + json.dumps(record) + "\n]\n")
    with pytest.raises(DataError, match=message):
        read_items([path])


def test_other_format_in_a_file_is_refused(tmp_path):
    path = write(tmp_path, "mix.jsonl", [{"instruction": "q", "output": "a"}, {"text": "doc"}])
    with pytest.raises(DataError, match=r"mix.jsonl:2: the record is not in the alpaca format \(it looks like text"):
        read_items([path])


def test_single_file_dataset(tmp_path):
    path = write(tmp_path, "data.jsonl", [{"text": "a"}])
    assert dataset_files(path, "train") == [path] and dataset_files(path, "dev") == []
    (tmp_path / "d").mkdir()
    write(tmp_path / "d", "train.jsonl", [{"text": "a"}])
    assert dataset_files(str(tmp_path / "d"), "train")[0].endswith("train.jsonl")


class Tok:
    """bos=1, eos=2, one id per whitespace-separated word (from 10)."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0
    special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>"}

    def __init__(self):
        self.vocab = {}

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": [self.vocab.setdefault(w, 10 + len(self.vocab)) for w in text.split()]}


def test_no_template_alpaca_is_byte_identical_to_src_tgt():
    tok = Tok()
    conv = alpaca.convert({"instruction": "what is up", "output": "not much", "system": "be nice"}, "f:1")
    (feat,), _, _ = Renderer(tok, 64, 64, False)(conv)
    ref, _, _ = tokenize_example(Example(src=["what is up"], tgt=["not much"], system="be nice"), tok, 64, 64, False)
    assert feat == ref


def test_no_template_refuses_tool_calls():
    conv = sharegpt.convert(GLAIVE, "g.json:4")
    with pytest.raises(ValueError, match=r"g.json:4: tool calls can only be rendered with a jinja chat template"):
        Renderer(Tok(), 64, 64, False)(conv)


SIMPLE = (
    "{% for m in messages %}<{{ m.role }}> {{ m.content }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def labelled_words(tok, feat):
    inv = {v: k for k, v in tok.vocab.items()} | {2: "</s>"}
    return [inv[x] for x in feat["labels"] if x != -100]


def test_template_supervises_assistant_turns_and_weights():
    tok = Tok()
    conv = Conversation(
        [
            Message("system", "sys"),
            Message("user", "hi there"),
            Message("assistant", "yo", loss=False),
            Message("user", "again"),
            Message("assistant", "fine thanks"),
        ],
        origin="f:1",
    )
    r = Renderer(tok, 64, 64, False, {False: SIMPLE}, Tok.special_tokens_map)
    (feat,), _, _ = r(conv)
    assert labelled_words(tok, feat) == ["fine", "thanks", "</s>"]
    conv.messages[2].loss = None
    (feat,), _, _ = r(conv)
    assert labelled_words(tok, feat) == ["yo", "</s>", "fine", "thanks", "</s>"]
    r.train_on_prompt = True
    (feat,), _, _ = r(conv)
    assert len(labelled_words(tok, feat)) == len(feat["input_ids"])  # everything after the first token


def test_template_never_supervises_tool_results_and_cuts_to_max_length():
    tok = Tok()
    conv = sharegpt.convert(GLAIVE, "g:1")
    tmpl = (
        "{% for m in messages %}<{{ m.role }}> {{ m.content }}{% for c in m.tool_calls or [] %} CALL "
        "{{ c.function.name }}{% endfor %} {{ eos_token }} {% endfor %}{% if add_generation_prompt %}<assistant> "
        "{% endif %}"
    )
    r = Renderer(tok, 64, 64, False, {True: tmpl, False: tmpl}, Tok.special_tokens_map, train_on_prompt=True)
    (feat,), _, _ = r(conv)
    words = labelled_words(tok, feat)
    assert '{"t":' not in words and "CALL" in words and words[-1] == "</s>"
    with pytest.raises(ValueError, match="g:1: no supervised token within max_length=4"):
        shift_and_fit([1, 5, 6, 7, 8, 9], [True] + [False] * 5, 4, "g:1")


def test_text_features_split_long_documents_never_drop():
    tok = Tok()
    feats = text_features(TextDoc("a b c d e f g"), tok, 3)
    ids = [1] + [tok.vocab[w] for w in "a b c d e f g".split()] + [2]
    assert [f["input_ids"] for f in feats] == [ids[0:3], ids[3:6], ids[6:8]]
    assert [f["labels"] for f in feats] == [ids[1:4], ids[4:7], ids[7:9]]
    r = Renderer(tok, 8, 3, False, autoregressive=True)
    feats2, truncated, _ = r(TextDoc("a b c d e f g", origin="w.txt:1"))
    assert feats2 == feats and truncated
    with pytest.raises(ValueError, match="w.txt:1: a raw text record; set autoregressive: true"):
        Renderer(tok, 8, 3, False)(TextDoc("a", origin="w.txt:1"))


def test_preference_forms(tmp_path):
    from paddlenlp_ext.dpo.data import read_preference_files

    lf = {
        "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "Name a color."}],
        "chosen": {"from": "gpt", "value": "Blue."},
        "rejected": {"from": "gpt", "value": "No."},
    }
    oa = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye?"},
        ],
        "chosen": [{"role": "assistant", "content": "Bye!"}],
        "rejected": {"role": "assistant", "content": "No"},
    }
    path = write(tmp_path, "p.json", [lf, oa], array=True)
    a, b = read_preference_files([path])
    assert (a.system, a.src, a.tgt, a.chosen, a.rejected) == ("s", ["Name a color."], [], "Blue.", "No.")
    assert (b.src, b.tgt, b.chosen, b.rejected, b.origin) == (["hi", "bye?"], ["hello"], "Bye!", "No", f"{path}:22")
    bad = write(tmp_path, "bad.jsonl", [{**lf, "rejected": {"from": "gpt", "value": " "}}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: 'rejected' is empty"):
        read_preference_files([bad])


def mixture_cfg(tmp_path, **data):
    from types import SimpleNamespace

    from paddlenlp_ext.config.schema import DataArgument, ModelArgument

    return SimpleNamespace(data=DataArgument(**data), model=ModelArgument(model_name_or_path=str(tmp_path)))


def test_mixture_shares_and_determinism(tmp_path):
    from paddlenlp_ext.data.build import tokenize_split

    a = write(tmp_path, "a.jsonl", [{"instruction": f"a{i}", "output": "x"} for i in range(900)])
    b = tmp_path / "b"
    b.mkdir()
    write(b, "train.json", [{"src": f"b{i}", "tgt": "y"} for i in range(900)])
    cfg = mixture_cfg(
        tmp_path,
        dataset_name_or_path=f"{a},{b}",
        dataset_weights=[0.7, 0.3],
        mix_strategy="interleave_over",
        max_length=16,
    )
    tok = Tok()
    feats, report = tokenize_split(cfg, tok, "train", False, seed=3)
    first = [tok.vocab.get("x") in f["labels"] for f in feats[:1000]]
    assert abs(sum(first) / 1000 - 0.7) <= 0.02
    assert report["mixture"]["per_source"] == {a: 2099, str(b): 900}  # a oversampled until b is used whole
    again, _ = tokenize_split(cfg, tok, "train", False, seed=3)
    assert again == feats  # a pure function of the data, weights, strategy and seed: a resume replays it
    cfg.data.mix_strategy = "interleave_under"
    under, report = tokenize_split(cfg, tok, "train", False, seed=3)
    assert report["mixture"]["per_source"] == {a: 900, str(b): 386}  # stops when a runs out


def test_mixture_config_checks(tmp_path):
    from paddlenlp_ext.config.data_checks import dataset_path_problems

    a = write(tmp_path, "a.jsonl", [{"text": "t"}])
    d = mixture_cfg(tmp_path, dataset_name_or_path=f"{a},{tmp_path}/missing", dataset_weights=[1.0], lazy=True).data
    msgs = "\n".join(dataset_path_problems(d, True, False, "cfg.json"))
    assert "missing' is not a directory or a data file" in msgs and "has 1 values for 2 source(s)" in msgs
    assert "need mix_strategy interleave_under" in msgs and "lazy=true streams one source" in msgs
