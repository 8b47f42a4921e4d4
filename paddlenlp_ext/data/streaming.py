"""``lazy: true``: stream, tokenize and pack with bounded memory, resumable without replay.

The stream reads the split's files line by line, tokenizes, and buffers one
group of ``group_size`` examples at a time; each group is packed (best-fit
decreasing, or in order) and its rows are yielded in a seeded per-(epoch,
group) shuffled order.  Memory is one group of examples, whatever the data
size.  Epochs repeat the files forever; the Trainer stops at ``max_steps``.

Resuming: the stream is a pure function of (files, settings, seed), so the
position after N rows is fully described by the group that contains row N —
its file index, byte offset and epoch — and how many of that group's rows
were already used.  ``position_after(rows)`` gives that cursor from the
groups the stream has started (a short log), checkpoints store it
(``data_state.json``), and a resumed stream seeks straight to it: no earlier
data is read again.
"""

import json
import os
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Deque, Dict, Iterator, List, Optional

import numpy as np
from paddle.io import IterableDataset

from .binpack import greedy_pack, pack_in_order
from .packed_row import build_packed_row
from .reader import DataError, EncodingProblem, decode_utf8, parse_line

DATA_STATE_NAME = "data_state.json"


@dataclass(frozen=True)
class RowFormat:
    """What the stream streams: ``parse(line, origin) -> example``, ``length(feature)`` (tokens),
    ``supervised(feature)`` (scored tokens) and ``build_row(features, max_length or None, pad_id)``
    (``None``: one unpacked feature, no padding)."""

    parse: Callable
    length: Callable
    supervised: Callable
    build_row: Callable


def _sft_row(members, max_length, pad_token_id):
    return build_packed_row(members, max_length, pad_token_id) if max_length is not None else members[0]


SFT_ROWS = RowFormat(
    parse=parse_line,
    length=lambda f: len(f["input_ids"]),
    supervised=lambda f: int(np.sum(np.asarray(f["labels"]) != -100)),
    build_row=_sft_row,
)


@dataclass
class Cursor:
    """Where a group starts: file index, byte offset and line number in it, epoch, and rows of it to skip."""

    file_index: int = 0
    offset: int = 0
    line: int = 0  # lines of the file before ``offset`` (for file:line errors)
    epoch: int = 0
    group_index: int = 0  # groups started before this one in the stream (for the shuffle seed)
    skip_rows: int = 0


class StreamingPackedDataset(IterableDataset):
    """Rows packed group by group from JSON-lines files, forever (see the module docstring).

    Worked example: a file of 4 examples that tokenize to lengths 6, 5, 2, 3, with max_length 8,
    greedy, group_size 2.  Group 0 (lengths 6, 5) packs into two rows, yielded in the
    ``RandomState([seed, 0])`` order: ``6 tokens + 2 pad`` and ``5 tokens + 3 pad``.  Group 1
    (lengths 2, 3) packs into one row, ``2 + 3 tokens + 3 pad``.  Then epoch 1 starts again at
    the first line.  ``position_after(2)`` is the start of group 1: ``Cursor(file_index=0,
    offset=<bytes of the first 2 lines>, line=2, epoch=0, group_index=1, skip_rows=0)``;
    ``position_after(1)`` is group 0 with ``skip_rows=1``.
    """

    def __init__(
        self,
        files: List[str],
        tokenize: Callable,
        max_length: int,
        pad_token_id: int,
        greedy: bool,
        group_size: int,
        seed: int,
        start: Optional[Cursor] = None,
        log_size: int = 64,
        packed: bool = True,
        row_format: Optional["RowFormat"] = None,
        parse: Optional[Callable] = None,
    ):
        super().__init__()
        self.packed = packed  # False: yield tokenized examples (shuffled per group) for batch padding
        # how lines parse and features become rows: SFT examples by default, preference pairs for DPO
        self.fmt = row_format or SFT_ROWS
        if parse is not None:  # another record parser (dataset formats) with the same rows
            self.fmt = RowFormat(
                parse=parse, length=self.fmt.length, supervised=self.fmt.supervised, build_row=self.fmt.build_row
            )
        self.files = list(files)
        self.tokenize = tokenize  # Example -> (feature, truncated, dropped_rounds)
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.greedy = greedy
        self.group_size = group_size
        self.seed = seed
        self.start = start or Cursor()
        # (first global row of the group, Cursor of the group), newest last
        self._groups: Deque = deque(maxlen=log_size)
        self.stats = {
            "examples": 0,
            "truncated_examples": 0,
            "dropped_rounds": 0,
            "packs": 0,
            "tokens": 0,
            "slots": 0,
            "supervised_tokens": 0,
        }

    # -- reading ---------------------------------------------------------
    def _examples_from(self, cur: Cursor) -> Iterator:
        """Yield (example, Cursor just after it) forever, starting at ``cur``."""
        fi, off, lineno, epoch = cur.file_index, cur.offset, cur.line, cur.epoch
        while True:
            path = self.files[fi]
            with open(path, "rb") as f:
                f.seek(off)
                while True:
                    start, line = off, f.readline()
                    if not line:
                        break
                    off, lineno = f.tell(), lineno + 1
                    if not line.strip():
                        continue
                    try:  # UTF-8 (a BOM at offset 0 is dropped), as the in-memory reader
                        text = decode_utf8(line, path, lineno, start)
                    except EncodingProblem as e:
                        raise DataError([str(e)]) from None
                    try:
                        ex = self.fmt.parse(text, f"{path}:{lineno}")
                    except ValueError as e:
                        msg = str(e)
                        raise DataError([msg if msg.startswith(f"{path}:{lineno}:") else f"{path}:{lineno}: {msg}"])
                    yield ex, Cursor(fi, off, lineno, epoch)
            fi, off, lineno = fi + 1, 0, 0
            if fi == len(self.files):
                fi, epoch = 0, epoch + 1

    def _pack(self, feats: List[Dict]) -> List[List[int]]:
        if not self.packed:
            return [[i] for i in range(len(feats))]
        lengths = [self.fmt.length(f) for f in feats]
        return (
            greedy_pack(lengths, self.max_length, len(lengths))
            if self.greedy
            else pack_in_order(lengths, self.max_length)
        )

    def __iter__(self):
        cur = self.start
        row = 0  # global row index of the stream (since this iterator's start)
        examples = self._examples_from(cur)
        group_cursor, skip = cur, cur.skip_rows
        group_index = cur.group_index
        while True:
            feats, next_cursor = [], group_cursor
            for ex, after in examples:
                feat, truncated, dropped = self.tokenize(ex)
                self.stats["examples"] += 1
                self.stats["truncated_examples"] += int(truncated)
                self.stats["dropped_rounds"] += dropped
                # a tokenizer may return several rows for one record (a long text document, autoregressive)
                feats.extend(feat if isinstance(feat, list) else [feat])
                next_cursor = after
                if len(feats) >= self.group_size:
                    break
            packs = self._pack(feats)
            order = np.random.RandomState([self.seed, group_index]).permutation(len(packs))
            self._groups.append(
                (row - skip, Cursor(**{**asdict(group_cursor), "skip_rows": 0, "group_index": group_index}), len(packs))
            )
            for k in order[skip:]:
                members = [feats[i] for i in packs[k]]
                n_tok = int(sum(self.fmt.length(f) for f in members))
                self.stats["packs"] += 1
                self.stats["tokens"] += n_tok
                self.stats["slots"] += self.max_length if self.packed else n_tok
                self.stats["supervised_tokens"] += sum(self.fmt.supervised(f) for f in members)
                row += 1
                yield self.fmt.build_row(members, self.max_length if self.packed else None, self.pad_token_id)
            skip = 0
            group_index += 1
            group_cursor = Cursor(
                next_cursor.file_index, next_cursor.offset, next_cursor.line, next_cursor.epoch, group_index
            )

    # -- resuming --------------------------------------------------------
    def position_after(self, rows: int) -> Cursor:
        """Cursor of the stream after ``rows`` rows (counted from this dataset's start)."""
        for first, cur, n in reversed(self._groups):
            if first <= rows:
                if rows - first > n:
                    break
                return Cursor(**{**asdict(cur), "skip_rows": rows - first})
        raise RuntimeError(f"row {rows} is outside the stream's recent groups; increase log_size")

    def report(self) -> Dict:
        """Counts over what the stream has produced so far (``padding_ratio`` only when packed)."""
        s = dict(self.stats)
        slots = s.pop("slots")
        if self.packed:
            s["padding_ratio"] = round(1 - s["tokens"] / slots, 6) if slots else 0.0
        else:
            s["rows_are"] = "examples"
        s["supervised_fraction"] = round(s["supervised_tokens"] / max(s["tokens"], 1), 4)
        return s


def save_cursor(cursor: Cursor, directory: str) -> None:
    with open(os.path.join(directory, DATA_STATE_NAME), "w") as f:
        json.dump(asdict(cursor), f)


def load_cursor(directory: str) -> Optional[Cursor]:
    path = os.path.join(directory, DATA_STATE_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return Cursor(**json.load(f))
