"""KTO data: unpaired, labelled completions -> validated, tokenized examples -> DPO pair rows.

One record per example (JSON array, JSON lines or parquet; docs/alignment.md)::

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
     "label": true}
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Go away."}],
     "label": false}
    {"src": ["Hi"], "tgt": [], "response": "Hello!", "label": true}

The last turn (``response`` in the src/tgt form) is the assistant's completion, ``label`` says
whether it is desirable (true) or not (false) and must be a JSON boolean.  Every bad record is
reported with ``file:line`` in one :class:`~paddlenlp_ext.data.reader.DataError`; nothing is
skipped.

Each example ``j`` becomes the pair ``(prompt_j, completion_j, completion_{j-1})`` (data order,
the first one takes the last completion): the mismatched completion only feeds the KL
reference point (:mod:`paddlenlp_ext.kto.losses`), as TRL and LLaMA-Factory build it.  The pair
is then tokenized, truncated, packed and collated by :mod:`paddlenlp_ext.dpo`'s code, and the
labels ride along as ``kto_label``.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence

import numpy as np

from ..data.formats import preference
from ..data.formats.files import parse_records
from ..data.reader import DataError
from ..dpo.data import (
    PreferenceData,
    PreferenceExample,
    resolve_split_files,
    row_settings,
    say,
    tokenize_preference_examples,
    truncation_notice,
)
from ..dpo.pair_rows import PreferenceCollator, PreferenceDataset

__all__ = ["kto_from_obj", "read_kto_files", "mismatched_pairs", "KTODataset", "KTOCollator", "build_kto_datasets"]

ASSISTANT_ROLES = ("assistant", "gpt")


def kto_from_obj(obj: Any, origin: str) -> PreferenceExample:
    """One record -> ``PreferenceExample(chosen=completion, rejected="")`` with ``.label`` set.

    ``rejected`` is filled in by :func:`mismatched_pairs`.

    >>> ex = kto_from_obj({"messages": [{"role": "user", "content": "q"},
    ...                                 {"role": "assistant", "content": "a"}], "label": False}, "f:1")
    >>> ex.src, ex.tgt, ex.chosen, ex.label, ex.origin
    (['q'], [], 'a', False, 'f:1')
    """
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object with 'messages' (or 'conversations') and a boolean 'label'")
    if "label" not in obj:
        raise ValueError(
            "missing key 'label': every KTO example needs \"label\": true (a desirable completion) "
            "or false (an undesirable one)"
        )
    label = obj["label"]
    if not isinstance(label, bool):
        raise ValueError(f"'label' must be the JSON boolean true or false, got {json.dumps(label)}")
    key = "messages" if "messages" in obj else "conversations" if "conversations" in obj else None
    if key is not None:
        turns = obj[key]
        if not isinstance(turns, list) or len(turns) < 2:
            raise ValueError(f"{key!r} must be a list of turns ending with the assistant's completion")
        last = turns[-1]
        role = last.get("role", last.get("from")) if isinstance(last, dict) else None
        if role not in ASSISTANT_ROLES:
            raise ValueError(
                f"the last turn of {key!r} must be the assistant's completion (role 'assistant' or "
                f"'gpt'), got role {role!r}"
            )
        record = {key: turns[:-1], "chosen": last, "rejected": last}
    elif "src" in obj and "response" in obj:
        src = obj["src"] if isinstance(obj["src"], list) else [obj["src"]]
        tgt = obj.get("tgt") or []
        tgt = tgt if isinstance(tgt, list) else [tgt]
        if len(src) != len(tgt) + 1 or not all(isinstance(s, str) for s in src + tgt):
            raise ValueError("'src' needs exactly one more string turn than 'tgt' (the last src is the prompt)")
        msgs = [{"role": r, "content": t} for pair in zip(src, tgt) for r, t in zip(("user", "assistant"), pair)]
        record = {
            "messages": msgs + [{"role": "user", "content": src[-1]}],
            "chosen": obj["response"],
            "rejected": obj["response"],
        }
    else:
        raise ValueError(
            "needs the conversation under 'messages' (OpenAI roles), 'conversations' (ShareGPT) or "
            "'src'/'tgt'/'response', with the assistant's completion last"
        )
    system, src, tgt, completion, _ = preference.convert(record, origin)
    ex = PreferenceExample(
        src=[s.strip() for s in src],
        tgt=[t.strip() for t in tgt],
        chosen=completion.strip(),
        rejected="",
        system=system,
        origin=origin,
    )
    ex.label = label
    return ex


def read_kto_files(files: Sequence[str]) -> List[PreferenceExample]:
    """Every record of ``files`` (see :func:`kto_from_obj`); all bad records raised together as DataError."""
    if not files:
        raise DataError(["no KTO data files found"])
    out = parse_records(files, kto_from_obj)
    if len(out) < 2:
        raise DataError(
            [
                f"{', '.join(files)}: {len(out)} KTO example(s); the KL reference point pairs each "
                "prompt with another example's completion, so at least 2 are needed"
            ]
        )
    return out


def _prompt_key(ex: PreferenceExample):
    return ex.system, tuple(ex.src), tuple(ex.tgt)


def mismatched_pairs(examples: Sequence[PreferenceExample]) -> List[PreferenceExample]:
    """Fill ``rejected`` with the completion of the nearest earlier example (cyclically) whose
    prompt differs -- the previous one unless it answers the same prompt (a desirable and an
    undesirable answer to one question are often neighbours), so the KL pair is truly mismatched.
    If every prompt is the same, the previous example's completion is used.

    >>> a = kto_from_obj({"src": "q1", "response": "a1", "label": True}, "f:1")
    >>> b = kto_from_obj({"src": "q1", "response": "b1", "label": False}, "f:2")
    >>> c = kto_from_obj({"src": "q2", "response": "a2", "label": False}, "f:3")
    >>> [(e.src[0], e.chosen, e.rejected) for e in mismatched_pairs([a, b, c])]
    [('q1', 'a1', 'a2'), ('q1', 'b1', 'a2'), ('q2', 'a2', 'b1')]
    """
    n = len(examples)
    keys = [_prompt_key(ex) for ex in examples]
    for j, ex in enumerate(examples):
        k = next((j - d for d in range(1, n) if keys[(j - d) % n] != keys[j]), j - 1) % n
        ex.rejected = examples[k].chosen
    return list(examples)


class KTODataset(PreferenceDataset):
    """:class:`~paddlenlp_ext.dpo.pair_rows.PreferenceDataset` rows plus ``kto_label`` [pairs of the row].

    ``pairs[i]["label"]`` is the i-th example's label; a packed row carries its pairs' labels in
    the order of its segments.
    """

    def __getitem__(self, i: int) -> Dict:
        row = super().__getitem__(i)
        row["kto_label"] = np.asarray([int(self.pairs[j]["label"]) for j in self.packs[i]], dtype=np.int64)
        return row


class KTOCollator(PreferenceCollator):
    """:class:`~paddlenlp_ext.dpo.pair_rows.PreferenceCollator` plus ``kto_label`` [N] in pair order."""

    def __call__(self, rows):
        out = super().__call__(rows)
        out["kto_label"] = np.concatenate([np.asarray(r["kto_label"], dtype=np.int64) for r in rows])
        return out


def build_kto_datasets(
    data_args: Any, tokenizer, *, do_train: bool, do_eval: bool, flash_mask: bool, seed: int = 0
) -> PreferenceData:
    """Datasets, collator and reports for KTO (``data_args`` as :func:`~paddlenlp_ext.dpo.data.build_preference_datasets`;
    ``lazy`` is refused at config time).  Reports add ``desirable`` / ``undesirable`` counts."""
    max_seq_len, max_prompt_len, packing, use_template, pad = row_settings(data_args, tokenizer)
    out = PreferenceData(train=None, dev=None, collator=KTOCollator(pad, flash_mask, max_seq_len if packing else None))
    for split, wanted, path in (
        ("train", do_train, data_args.train_dataset_path),
        ("dev", do_eval, data_args.dev_dataset_path),
    ):
        if not wanted:
            continue
        if not path:
            raise ValueError(f"{split}_dataset_path is not set")
        files = resolve_split_files(path, split)
        examples = mismatched_pairs(read_kto_files(files))
        pairs, stats = tokenize_preference_examples(examples, tokenizer, max_seq_len, max_prompt_len, use_template)
        for pair, ex in zip(pairs, examples):  # tokenize_preference_examples keeps every example, in order
            pair["label"] = ex.label
        ds = KTODataset(pairs, max_seq_len, packing, pad, seed=seed, shuffle=(split == "train"))
        desirable = sum(int(ex.label) for ex in examples)
        out.reports[split] = {
            "files": files,
            "chat_template": use_template,
            "packing": packing or "none",
            "desirable": desirable,
            "undesirable": len(examples) - desirable,
            **stats,
            **ds.stats(),
        }
        say(truncation_notice(split, stats, max_seq_len, max_prompt_len, "examples"))
        setattr(out, split, ds)
    return out
