import doctest
import json

import pytest

from paddlenlp_ext.data import collate, build, reader
from paddlenlp_ext.data.reader import DataError, Example, find_split_files, read_examples
from paddlenlp_ext.data.tokenize import IGNORE_INDEX, fit_turns, length_histogram, tokenize_example, tokenize_examples
from paddlenlp_ext.data.collate import PaddingCollator, PackedCollator
from paddlenlp_ext.data.packed_row import build_packed_row


def write_lines(tmp_path, lines, name="train.json"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


@pytest.mark.parametrize("module, examples", [(collate, 5), (build, 1), (reader, 1)])
def test_docstring_examples(module, examples):
    res = doctest.testmod(module, verbose=False)
    assert res.attempted >= examples and res.failed == 0


class TableTokenizer:
    """The tokenizer of the tokenize.py docstrings: bos=1, eos=2, "hi" -> [5], "yo" -> [6, 7]."""

    bos_token_id, eos_token_id = 1, 2
    table = {"hi": [5], "yo": [6, 7]}

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": self.table[text]}


def test_tokenize_examples_worked_example():
    feats, stats = tokenize_examples([Example(src=["hi"], tgt=["yo"], origin="f:1")], TableTokenizer(), 8, 16, False)
    assert feats == [{"input_ids": [1, 5, 6, 7], "labels": [-100, 6, 7, 2]}]
    assert (stats.examples, stats.tokens, stats.supervised_tokens, stats.lengths) == (1, 4, 3, [4])


def test_tokenize_failure_names_the_line_and_is_not_swallowed():
    examples = [Example(src=["hi"], tgt=["yo"], origin="f:1"), Example(src=["hi"], tgt=["??"], origin="f:2")]
    with pytest.raises(ValueError, match=r"^f:2: could not tokenize: '\?\?'$") as e:
        tokenize_examples(examples, TableTokenizer(), 8, 16, False)
    assert isinstance(e.value.__cause__, KeyError)


def test_find_split_files(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "b.json").write_text("")
    (tmp_path / "train" / "a.json").write_text("")
    (tmp_path / "dev.json").write_text("")
    assert [p.split("/")[-1] for p in find_split_files(str(tmp_path), "train")] == ["a.json", "b.json"]
    assert find_split_files(str(tmp_path), "dev")[0].endswith("dev.json")
    assert find_split_files(str(tmp_path), "test") == []


def test_every_bad_line_reported_with_file_and_line(tmp_path):
    path = write_lines(
        tmp_path,
        [
            '{"src": "a", "tgt": "b"}',
            '{"src": "a", "tgt": "b"',  # bad JSON
            '{"src": "a"}',  # missing tgt
            '{"src": 3, "tgt": "b"}',  # wrong type
            '{"src": "a", "tgt": "  "}',  # empty target
            '{"src": ["a", "b"], "tgt": ["c"]}',  # mismatched turns
            '{"src": "a", "tgt": "b", "context": {"system": 1}}',
        ],
    )
    with pytest.raises(DataError) as e:
        read_examples([path])
    msg = str(e.value)
    for line, needle in (
        (2, "invalid JSON"),
        (3, "missing key 'tgt'"),
        (4, "'src' must be a string"),
        (5, "empty target"),
        (6, "mismatched turns"),
        (7, "'context.system'"),
    ):
        assert f"{path}:{line}: {needle}" in msg, (line, msg)
    assert f"{path}:1:" not in msg


def test_multi_turn_and_system_parsed(tmp_path):
    path = write_lines(tmp_path, ['{"src": ["q1", "q2"], "tgt": ["a1", "a2"], "context": {"system": "S"}}'])
    (ex,) = read_examples([path])
    assert ex.src == ["q1", "q2"] and ex.tgt == ["a1", "a2"] and ex.system == "S" and ex.origin == f"{path}:1"


def test_fit_turns_worked_examples():
    turns = [([5, 5, 5], [6, 2]), ([7], [8, 2])]
    tokens, labels, truncated, dropped = fit_turns([1], turns, src_length=2, max_length=8)
    assert tokens == [1, 5, 5, 6, 2, 7, 8, 2]
    assert labels == [-100, -100, -100, 6, 2, -100, 8, 2] and truncated and dropped == 0
    tokens, labels, truncated, dropped = fit_turns([1], turns, src_length=2, max_length=5)
    assert tokens == [1, 7, 8, 2] and labels == [-100, -100, 8, 2] and truncated and dropped == 1
    # the last round always stays, its target cut to fit
    tokens, labels, truncated, _ = fit_turns([1], [([5, 5], [6, 6, 6, 2])], src_length=4, max_length=5)
    assert tokens == [1, 5, 5, 6, 6] and labels == [-100, -100, -100, 6, 6] and truncated


def test_tokenize_masks_prompt_and_shifts(tiny_tokenizer):
    tok = tiny_tokenizer
    ex = Example(src=["type#dress"], tgt=["A red dress."])
    feat, truncated, _ = tokenize_example(ex, tok, src_length=64, max_length=128, use_chat_template=False)
    src = tok("type#dress", add_special_tokens=False)["input_ids"]
    tgt = tok("A red dress.", add_special_tokens=False)["input_ids"]
    full = [tok.bos_token_id] + src + tgt + [tok.eos_token_id]
    assert feat["input_ids"] == full[:-1]
    assert feat["labels"] == [IGNORE_INDEX] * len(src) + tgt + [tok.eos_token_id]
    assert not truncated


def test_tokenize_multi_turn_keeps_latest_rounds(tiny_tokenizer):
    tok = tiny_tokenizer
    ex = Example(src=["type#dress " * 5, "color#red"], tgt=["A long answer " * 5, "Red."])
    feat, truncated, dropped = tokenize_example(ex, tok, src_length=64, max_length=16, use_chat_template=False)
    assert truncated and dropped == 1
    last = tok("Red.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert feat["labels"][-len(last) :] == last
    assert len(feat["input_ids"]) <= 15


def test_length_histogram():
    assert length_histogram([3, 9, 10], 16, bins=2) == {"1-8": 1, "9-16": 2}


def test_padding_collator():
    b = PaddingCollator(0)([{"input_ids": [1, 5], "labels": [5, 2]}, {"input_ids": [1], "labels": [2]}])
    assert b["input_ids"].tolist() == [[1, 5], [1, 0]]
    assert b["labels"].tolist() == [[5, 2], [2, -100]]
    assert b["real_tokens"].tolist() == [[1, 1], [1, 0]]
    assert PaddingCollator(0, pad_to_multiple_of=4)([{"input_ids": [1], "labels": [2]}])["input_ids"].shape == (1, 4)


def test_packed_collator_dense_and_flashmask():
    row = build_packed_row(
        [{"input_ids": [1, 2, 3], "labels": [2, 3, 4]}, {"input_ids": [5, 6], "labels": [6, 7]}], 8, 0
    )
    fm = PackedCollator(flash_mask=True)([row])
    assert fm["attn_mask_startend_row_indices"].shape == (1, 1, 8, 1)
    assert fm["attn_mask_startend_row_indices"][0, 0, :, 0].tolist() == [3, 3, 3, 5, 5, 5, 5, 5]
    assert fm["real_tokens"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    assert fm["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert "attention_mask" not in fm
    dense = PackedCollator(flash_mask=False)([row])
    assert "attn_mask_startend_row_indices" not in dense
    assert dense["attention_mask"].shape == (1, 1, 8, 8)
    # causal inside each example (rows/cols 0-2 and 3-4), nothing across them, and padding (5-7) sees and is seen
    # by nothing
    assert dense["attention_mask"][0, 0].astype(int).tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ]


@pytest.mark.parametrize("kind", ["json", "jinja"])
def test_chat_template_applied_and_prompt_masked(tmp_path, tiny_model_dir, kind):
    from paddlenlp.transformers import AutoTokenizer

    from paddlenlp_ext.data.tokenize import resolve_chat_template

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    if kind == "json":
        path = tmp_path / "chat_template.json"
        path.write_text(
            json.dumps(
                {
                    "system": "<s>{{system}}\n",
                    "conversation": ["user: {{user}}\nbot: ", "{{bot}}</s>"],
                    "query": "user: {{query}}\nbot: ",
                }
            )
        )
    else:
        path = tmp_path / "template.jinja"
        path.write_text(
            "{% for m in messages %}{% if m['role'] == 'user' %}user: {{ m['content'] }}\nbot: "
            "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
        )
    assert resolve_chat_template(tok, str(path))
    ex = Example(src=["color#red", "type#dress"], tgt=["Red.", "A dress."], system="Be brief")
    feat, _, _ = tokenize_example(ex, tok, 64, 128, use_chat_template=True)
    text = tok.decode(feat["input_ids"] + [feat["labels"][-1]])
    assert "user: color#red" in text and "bot: A dress.</s>" in text.replace("\n", " ").replace("  ", " ")
    assert ("Be brief" in text) == (kind == "json")
    supervised = tok.decode([x for x in feat["labels"] if x != IGNORE_INDEX])
    assert "user" not in supervised and "Red.</s>" in supervised and "A dress.</s>" in supervised
