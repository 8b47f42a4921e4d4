"""Preference data for DPO: PaddleNLP's JSON lines -> validated, tokenized, truncated pairs -> datasets.

Format (PaddleNLP ``llm/alignment/dpo``), one JSON object per line::

    {"src": ["hi", "and then?"], "tgt": ["hello"], "response": ["bye", "go away"], "sort": [1, 0]}
    {"src": "one-turn prompt", "tgt": [], "response": ["good", "bad"], "sort": [0.9, 0.2]}

``src`` has exactly one more turn than ``tgt`` (a string counts as one turn):
the last src is the prompt the two responses answer.  The response with the
higher ``sort`` is chosen.  Optional ``"context": {"system": "..."}`` as in
the SFT format.  Every bad line is reported with ``file:line`` in one
:class:`~paddlenlp_ext.data.reader.DataError`; nothing is skipped.

Reading and checking the records is :mod:`.records`; rows, masks, packing and the collator live in
:mod:`.pair_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..data.binpack import DEFAULT_GROUP_SIZE
from ..data.chat_template import find_template, special_tokens_of
from ..data.conversation import answer_segments
from ..data.reader import MAX_REPORTED, DataError, Example, json_line
from ..data.tokenize import encode_turns, length_histogram, resolve_chat_template
from ..data.truncation import fit_segments
from .pair_rows import PreferenceCollator, PreferenceDataset, build_pair_row, pair_length
from .records import (
    PreferenceExample,
    parse_preference_line,
    preference_from_obj,
    read_preference_files,
    resolve_split_files,
    source_files,
)

__all__ = [
    "PreferenceExample",
    "parse_preference_line",
    "read_preference_files",
    "resolve_split_files",
    "fit_pair",
    "tokenize_pair",
    "tokenize_preference_examples",
    "PreferenceData",
    "build_preference_datasets",
]


def fit_pair(
    prefix: List[int],
    history: Sequence,
    last_src: List[int],
    chosen: List[int],
    rejected: List[int],
    max_seq_len: int,
    max_prompt_len: int,
):
    """Truncate one pair by the toolkit's one policy (:mod:`paddlenlp_ext.data.truncation`, docs/data.md);
    returns ``(prompt, chosen, rejected, info)`` with ``info = {"truncated_prompt", "truncated_response",
    "dropped_rounds"}``.  ``history`` is the earlier rounds, each a token list or a ``(src, tgt)`` pair.

    1. earlier rounds go, the oldest first, while the prompt exceeds ``max_prompt_len`` or the pair
       ``max_seq_len``;
    2. then the prompt is cut from the LEFT to ``max_prompt_len`` (its end, e.g. the template's assistant
       header, stays; the prefix -- bos / system -- stays while the question keeps a token);
    3. then the responses share the rest in proportion to their lengths (chosen gets
       ``int(C / (C + R) * rest)``, at least 1; rejected the remainder); a cut response loses its tail,
       eos included (PaddleNLP would score a fake eos there).

    Worked example, max_seq_len=8, max_prompt_len=3, prefix [1]:

    >>> fit_pair([1], [([40], [41, 2])], [5, 6, 7], [8, 9, 2], [10, 2], 8, 3)
    ([1, 6, 7], [8, 9, 2], [10, 2], {'truncated_prompt': True, 'truncated_response': False, 'dropped_rounds': 1})

    (the earlier round [40, 41, 2] goes first, then the prompt is cut to [1, 6, 7]: 3 + 3 + 2 = 8 tokens).
    """
    rounds = [list(h[0]) + list(h[1]) if isinstance(h, tuple) else list(h) for h in history]
    prompt, (c, r), info = fit_segments(prefix, rounds, last_src, [chosen, rejected], max_seq_len, max_prompt_len)
    return (
        prompt,
        c,
        r,
        {
            "truncated_prompt": info["truncated_prompt"],
            "truncated_response": info["truncated_response"],
            "dropped_rounds": info["dropped_rounds"],
        },
    )


def _conversation_segments(ex: PreferenceExample, tokenizer, jinja):
    """(prefix, rounds, last, chosen, rejected) of a pair with tool turns, rendered by the jinja template."""
    conv = ex.conversation
    templates, special = jinja or ({}, {})
    source = templates.get(bool(conv.tools)) or templates.get(False)
    if not source:
        raise ValueError(
            "tool calls, tool results and tools in a preference pair are rendered by a jinja chat "
            "template, and the tokenizer has none: add chat_template to its tokenizer_config.json or set "
            "chat_template to a jinja file"
        )
    pre_c, rounds_c, last_c, chosen = answer_segments(conv, ex.answers[0], tokenizer, source, special)
    pre_r, rounds_r, last_r, rejected = answer_segments(conv, ex.answers[1], tokenizer, source, special)
    if (pre_c, rounds_c, last_c) != (pre_r, rounds_r, last_r):
        raise ValueError("the chat template renders the prompt differently for the two responses")
    return pre_c, rounds_c, last_c, chosen, rejected


def tokenize_pair(
    ex: PreferenceExample, tokenizer, max_seq_len: int, max_prompt_len: int, use_chat_template: bool, jinja=None
) -> Tuple[Dict, Dict]:
    """One example -> (``{"prompt", "chosen", "rejected", "origin"}``, truncation info).

    The conversation is encoded by :func:`paddlenlp_ext.data.tokenize.encode_turns` (chat
    template if any, else ``[bos] + src_1 + tgt_1 + eos + ... + src_n``), once with each
    answer as the last target; both answers end with eos.  Without a template
    (bos=1, eos=2; "q" -> [5], "a" -> [6], "b" -> [7]):
    ``PreferenceExample(src=["q"], tgt=[], chosen="a", rejected="b")`` ->
    ``{"prompt": [1, 5], "chosen": [6, 2], "rejected": [7, 2]}``.

    A pair with tool turns (``ex.conversation``) is rendered by the jinja template of ``jinja``
    (``({has_tools: source}, special tokens)``): :func:`~paddlenlp_ext.data.conversation.answer_segments`.
    """
    if ex.conversation is not None:
        prefix, rounds, last, chosen, rejected = _conversation_segments(ex, tokenizer, jinja)
        prompt, chosen, rejected, info = fit_pair(prefix, rounds, last, chosen, rejected, max_seq_len, max_prompt_len)
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "origin": ex.origin}, info
    pre_c, turns_c = encode_turns(Example(ex.src, ex.tgt + [ex.chosen], ex.system), tokenizer, use_chat_template)
    pre_r, turns_r = encode_turns(Example(ex.src, ex.tgt + [ex.rejected], ex.system), tokenizer, use_chat_template)
    if pre_c != pre_r or [s for s, _ in turns_c] != [s for s, _ in turns_r] or turns_c[:-1] != turns_r[:-1]:
        raise ValueError("the chat template renders the prompt differently for the two responses")
    prompt, chosen, rejected, info = fit_pair(
        pre_c, turns_c[:-1], turns_c[-1][0], turns_c[-1][1], turns_r[-1][1], max_seq_len, max_prompt_len
    )
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "origin": ex.origin}, info


def tokenize_preference_examples(
    examples: Sequence[PreferenceExample],
    tokenizer,
    max_seq_len: int,
    max_prompt_len: int,
    use_chat_template: bool,
    jinja=None,
) -> Tuple[List[Dict], Dict]:
    """Tokenize all examples; returns (pairs, stats).  Every pair fits after truncation (:func:`fit_pair`);
    pairs that fail to tokenize (a template error) are ALL raised together as DataError naming ``file:line``.

    stats: ``pairs``, ``truncated_examples`` (pairs cut in any way), ``dropped_examples`` (0: none is too
    long to keep), ``truncated_prompts``, ``truncated_responses``, ``dropped_rounds``,
    ``tokens`` (prompt + chosen + rejected), ``scored_tokens`` (chosen + rejected),
    ``length_histogram``.  E.g. two fitting one-turn pairs of 4 tokens each (2 scored) ->
    ``{"pairs": 2, "truncated_prompts": 0, ..., "tokens": 8, "scored_tokens": 4, ...}``.
    """
    pairs, problems, extra = [], [], 0
    st = {
        "pairs": 0,
        "truncated_examples": 0,
        "dropped_examples": 0,
        "truncated_prompts": 0,
        "truncated_responses": 0,
        "dropped_rounds": 0,
        "tokens": 0,
        "scored_tokens": 0,
    }
    lengths = []
    for ex in examples:
        try:
            pair, info = tokenize_pair(ex, tokenizer, max_seq_len, max_prompt_len, use_chat_template, jinja)
        except (ValueError, TypeError, KeyError, IndexError) as e:  # re-raised below with file:line
            if len(problems) < MAX_REPORTED:
                problems.append(f"{ex.origin}: {e}")
            else:
                extra += 1
            continue
        n = len(pair["prompt"]) + len(pair["chosen"]) + len(pair["rejected"])
        st["pairs"] += 1
        st["truncated_examples"] += int(
            info["truncated_prompt"] or info["truncated_response"] or info["dropped_rounds"] > 0
        )
        st["truncated_prompts"] += int(info["truncated_prompt"])
        st["truncated_responses"] += int(info["truncated_response"])
        st["dropped_rounds"] += info["dropped_rounds"]
        st["tokens"] += n
        st["scored_tokens"] += len(pair["chosen"]) + len(pair["rejected"])
        lengths.append(n)
        pairs.append(pair)
    if problems:
        raise DataError(problems, extra)
    st["length_histogram"] = length_histogram(lengths, max_seq_len)
    return pairs, st


def truncation_notice(
    split: str, stats: Dict, max_seq_len: int, max_prompt_len: int, unit: str = "pairs"
) -> Optional[str]:
    """The log line saying how many examples the one truncation policy cut, and how (None if none was).

    >>> truncation_notice("train", {"pairs": 100, "truncated_examples": 3, "dropped_rounds": 5,
    ...                             "truncated_prompts": 1, "truncated_responses": 2}, 128, 64)  # doctest: +ELLIPSIS
    'notice: train: 3 of 100 pairs truncated (docs/data.md): 5 earlier rounds dropped, oldest first; 1 prompt(s) ...'
    """
    n = stats.get("truncated_examples", 0)
    if not n:
        return None
    return (
        f"notice: {split}: {n} of {stats.get('pairs', stats.get('examples'))} {unit} truncated (docs/data.md): "
        f"{stats.get('dropped_rounds', 0)} earlier rounds dropped, oldest first; {stats.get('truncated_prompts', 0)} "
        f"prompt(s) cut from the left to max_prompt_len {max_prompt_len}; {stats.get('truncated_responses', 0)} "
        f"answer pair(s) cut at the tail to max_seq_len {max_seq_len}"
    )


def say(line: Optional[str]) -> None:
    """Print a notice on the run's console (and train.log), when there is one."""
    if line:
        from ..training.console import current

        current().line(line)


@dataclass
class PreferenceData:
    train: Optional[PreferenceDataset]
    dev: Optional[PreferenceDataset]
    collator: Callable
    reports: Dict[str, Dict] = field(default_factory=dict)


def row_settings(data_args: Any, tokenizer) -> Tuple[int, int, Optional[str], bool, int]:
    """``(max_seq_len, max_prompt_len, packing, use_chat_template, pad_token_id)`` of a preference run
    (shared with KTO); ``packing`` is None, ``"in_order"`` (zero_padding) or ``"greedy"``."""
    max_seq_len, max_prompt_len = int(data_args.max_seq_len), int(data_args.max_prompt_len)
    if max_seq_len < 3 or max_prompt_len < 1:
        raise ValueError(f"need max_seq_len >= 3 and max_prompt_len >= 1, got {max_seq_len} and {max_prompt_len}")
    zero_padding = bool(getattr(data_args, "zero_padding", False))
    greedy = bool(getattr(data_args, "greedy_zero_padding", False))
    if greedy and not zero_padding:
        raise ValueError("greedy_zero_padding=true needs zero_padding=true")
    packing = ("greedy" if greedy else "in_order") if zero_padding else None
    use_template = resolve_chat_template(tokenizer, getattr(data_args, "chat_template", None))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return max_seq_len, max_prompt_len, packing, use_template, pad


def pair_templates(data_args: Any, tokenizer):
    """``({has_tools: jinja source or None}, special tokens)``: what renders pairs with tool turns (the
    ``chat_template`` jinja file, else the tokenizer directory's template; see ``data.chat_template``)."""
    tok_dir = getattr(tokenizer, "name_or_path", None)
    key = getattr(data_args, "chat_template", None)
    return {t: find_template(tok_dir, key, t) for t in (False, True)}, special_tokens_of(tokenizer)


def build_preference_datasets(
    data_args: Any,
    tokenizer,
    *,
    do_train: bool,
    do_eval: bool,
    flash_mask: bool,
    seed: int = 0,
    group_size: int = DEFAULT_GROUP_SIZE,
    dataset_cls=PreferenceDataset,
    collator_cls=PreferenceCollator,
) -> PreferenceData:
    """Datasets, collator and reports for DPO.

    ``data_args`` has ``train_dataset_path``, ``dev_dataset_path`` (a file, or a directory with
    ``train.json`` / ``dev.json``), ``max_seq_len``, ``max_prompt_len``, ``zero_padding``,
    ``greedy_zero_padding`` (needs zero_padding), ``lazy`` (the train pairs are streamed: see
    :func:`stream_preference_pairs`; optional ``resume_cursor``) and
    optionally ``chat_template`` (a file, see :func:`~paddlenlp_ext.data.tokenize.resolve_chat_template`).

    ``zero_padding``: several pairs per row of ``max_seq_len`` (in data order; best-fit-decreasing
    per window of ``group_size`` with ``greedy_zero_padding``), rows shuffled per epoch by
    ``set_epoch``.  Otherwise one pair per row, padded per batch by the collator.  E.g. for
    ``llm/data/dpo_tiny`` with max_seq_len 512 and zero_padding: ``.train`` holds rows of several
    pairs, ``.collator(rows)`` gives the contract batch, ``.reports["train"]`` the counts.
    ``dataset_cls`` / ``collator_cls``: subclasses adding keys to the rows and batches (reward models).
    """
    max_seq_len, max_prompt_len, packing, use_template, pad = row_settings(data_args, tokenizer)
    jinja = pair_templates(data_args, tokenizer)
    zero_padding, greedy = packing is not None, packing == "greedy"
    out = PreferenceData(train=None, dev=None, collator=collator_cls(pad, flash_mask, max_seq_len if packing else None))
    lazy = bool(getattr(data_args, "lazy", False))
    if lazy and dataset_cls is not PreferenceDataset:
        raise ValueError(f"lazy=true streams DPO pair rows; {dataset_cls.__name__} needs the pairs in memory")
    for split, wanted, path in (
        ("train", do_train, getattr(data_args, "train_dataset_path", None)),
        ("dev", do_eval, getattr(data_args, "dev_dataset_path", None)),
    ):
        if not wanted:
            continue
        if not path:
            raise ValueError(f"{split}_dataset_path is not set")
        files, columns = source_files(path, split, data_args)
        if lazy and split == "train":  # streamed group by group; dev sets stay in memory (eval needs their length)
            out.train = stream_preference_pairs(
                files,
                tokenizer,
                max_seq_len,
                max_prompt_len,
                use_template,
                pad,
                greedy=greedy,
                packed=zero_padding,
                group_size=group_size,
                seed=seed,
                start=getattr(data_args, "resume_cursor", None),
                jinja=jinja,
                columns=columns,
            )
            out.reports["train"] = {
                "files": files,
                "lazy": True,
                "chat_template": use_template,
                "packing": packing or "none",
            }
            continue
        pairs, stats = tokenize_preference_examples(
            read_preference_files(files, columns), tokenizer, max_seq_len, max_prompt_len, use_template, jinja
        )
        ds = dataset_cls(pairs, max_seq_len, packing, pad, group_size=group_size, seed=seed, shuffle=(split == "train"))
        out.reports[split] = {
            "files": files,
            "chat_template": use_template,
            "packing": packing or "none",
            **stats,
            **ds.stats(),
        }
        say(truncation_notice(split, stats, max_seq_len, max_prompt_len))
        setattr(out, split, ds)
    return out


def stream_preference_pairs(
    files,
    tokenizer,
    max_seq_len: int,
    max_prompt_len: int,
    use_chat_template: bool,
    pad_token_id: int,
    *,
    greedy: bool,
    packed: bool,
    group_size: int,
    seed: int,
    start=None,
    jinja=None,
    columns=None,
):
    """``lazy: true`` for preference data: the SFT stream (:mod:`paddlenlp_ext.data.streaming`: one group of
    ``group_size`` pairs in memory, packed per group, resumable from a cursor) with preference rows.

    Lines parse with :func:`parse_preference_line`, pairs tokenize with :func:`tokenize_pair`
    (truncated by the one policy; a pair the template fails on stops the run with its ``file:line``, as in
    memory) and rows are
    :func:`~paddlenlp_ext.dpo.pair_rows.build_pair_row` rows (``max_seq_len`` long when packed,
    one unpadded pair otherwise), so the collator and the trainer see what the in-memory path gives.
    """
    from ..data.streaming import RowFormat, StreamingPackedDataset

    def tokenize(ex):
        try:
            pair, info = tokenize_pair(ex, tokenizer, max_seq_len, max_prompt_len, use_chat_template, jinja)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise DataError([f"{ex.origin}: {e}"]) from e
        return pair, bool(info["truncated_prompt"] or info["truncated_response"]), int(info["dropped_rounds"])

    fmt = RowFormat(
        parse=lambda line, origin: preference_from_obj(json_line(line), origin, columns),
        length=pair_length,
        supervised=lambda p: len(p["chosen"]) + len(p["rejected"]),
        build_row=lambda members, length, pad: build_pair_row(members, length, pad),
    )
    return StreamingPackedDataset(
        files,
        tokenize,
        max_seq_len,
        pad_token_id,
        greedy=greedy,
        group_size=group_size,
        seed=seed,
        start=start,
        packed=packed,
        row_format=fmt,
    )
