"""Examples -> token ids with the prompt masked out of the loss.

Pure functions over a tokenizer object (never the model).  Rules:

* With a chat template (the tokenizer's, or the ``chat_template`` file) each
  turn is rendered by PaddleNLP's ``encode_chat_inputs``; without one a row is
  ``[bos] + system + src_1 + tgt_1 + eos + src_2 + tgt_2 + eos ...``.
* Prompt tokens (bos, system, every src) get label -100; EOS closes each target.
* The one truncation policy (docs/data.md, :mod:`.truncation`): multi-turn keeps the latest rounds that
  fit ``max_length`` and always the last one (the oldest go first); each src is cut from the LEFT to
  ``src_length`` tokens (its end -- the question's last words, a template's assistant header -- stays);
  then the last target loses its tail to fit ``max_length``.
* Labels are shifted here (``input_ids = tokens[:-1]``, ``labels = tokens[1:]``)
  because PaddleNLP's causal-LM criteria do not shift.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .reader import read_utf8_text

IGNORE_INDEX = -100


@dataclass
class TokenizeStats:
    examples: int = 0
    truncated_examples: int = 0
    dropped_rounds: int = 0  # earlier turns of multi-turn examples that did not fit
    dropped_examples: int = 0  # examples with no learned token left after truncation (left out, counted)
    tokens: int = 0  # input tokens (after shift)
    supervised_tokens: int = 0
    lengths: List[int] = field(default_factory=list)

    def add(self, ex: Dict, truncated: bool, dropped_rounds: int) -> None:
        self.examples += 1
        self.truncated_examples += int(truncated)
        self.dropped_rounds += dropped_rounds
        n = len(ex["input_ids"])
        self.tokens += n
        self.supervised_tokens += sum(1 for x in ex["labels"] if x != IGNORE_INDEX)
        self.lengths.append(n)

    def merge(self, other: "TokenizeStats") -> None:
        """Add another split's counts (several sources)."""
        for key in (
            "examples",
            "truncated_examples",
            "dropped_rounds",
            "dropped_examples",
            "tokens",
            "supervised_tokens",
        ):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        self.lengths += other.lengths

    def as_dict(self) -> Dict:
        return {
            "examples": self.examples,
            "truncated_examples": self.truncated_examples,
            "dropped_rounds": self.dropped_rounds,
            "dropped_examples": self.dropped_examples,
            "tokens": self.tokens,
            "supervised_tokens": self.supervised_tokens,
            "supervised_fraction": round(self.supervised_tokens / max(self.tokens, 1), 4),
        }


def _encode(tokenizer, text: str) -> List[int]:
    return list(tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"])


def encode_turns(example, tokenizer, use_chat_template: bool) -> Tuple[List[int], List[Tuple[List[int], List[int]]]]:
    """Return (prefix_ids, [(src_ids, tgt_ids), ...]); every tgt ends with EOS.

    Example without a template (bos=1, eos=2; "hi" -> [5], "yo" -> [6, 7]):
    ``Example(src=["hi"], tgt=["yo"])`` -> ``([1], [([5], [6, 7, 2])])``.
    """
    eos = tokenizer.eos_token_id
    if use_chat_template:
        context = {"system": example.system} if example.system is not None else {}
        enc = tokenizer.encode_chat_inputs([[s, t] for s, t in zip(example.src, example.tgt)], context)
        prefix = list(enc.get("system", []))
        turns = [(list(s), list(t)) for s, t in enc["conversations"]]
    else:
        prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        if example.system:
            prefix += _encode(tokenizer, example.system + "\n")
        turns = [(_encode(tokenizer, s), _encode(tokenizer, t)) for s, t in zip(example.src, example.tgt)]
    turns = [(s, t if t and t[-1] == eos else t + [eos]) for s, t in turns]
    return prefix, turns


def fit_turns(
    prefix: Sequence[int], turns: Sequence[Tuple[List[int], List[int]]], src_length: int, max_length: int
) -> Tuple[List[int], List[int], bool, int]:
    """Truncate and concatenate: returns (tokens, labels_unshifted, truncated, dropped_rounds).

    Worked example, src_length=2, max_length=8, prefix=[1]:
    turns [([4,5,5], [6,2]), ([7], [8,2])] -> the first src is cut from the left to [5,5]
    (src_length) and the whole ``1 5 5 6 2 7 8 2`` is exactly 8 tokens:
    tokens [1,5,5,6,2,7,8,2], labels [-100,-100,-100,6,2,-100,8,2], truncated=True.
    With max_length=5 only the last round fits: tokens [1,7,8,2],
    labels [-100,-100,8,2], truncated=True, dropped_rounds=1.
    """
    truncated = False
    cut = []
    for s, t in turns:
        if len(s) > src_length:  # from the left: the end of the question (and a template's header) stays
            s, truncated = s[len(s) - src_length :], True
        cut.append((s, t))
    budget = max_length - len(prefix)
    last_s, last_t = cut[-1]
    if budget < 2:
        raise ValueError(f"max_length {max_length} leaves no room after the {len(prefix)}-token prefix")
    # The last round always stays; shrink its target, then its source, to fit.
    if len(last_s) + len(last_t) > budget:
        truncated = True
        keep_t = max(budget - len(last_s), 1)
        last_t = last_t[:keep_t]
        last_s = last_s[len(last_s) - (budget - len(last_t)) :]
    kept = [(last_s, last_t)]
    used = len(last_s) + len(last_t)
    for s, t in reversed(cut[:-1]):
        if used + len(s) + len(t) > budget:
            break
        kept.append((s, t))
        used += len(s) + len(t)
    dropped = len(cut) - len(kept)
    truncated = truncated or dropped > 0
    tokens, labels = list(prefix), [IGNORE_INDEX] * len(prefix)
    for s, t in reversed(kept):
        tokens += s + t
        labels += [IGNORE_INDEX] * len(s) + list(t)
    return tokens, labels, truncated, dropped


def tokenize_example(
    example, tokenizer, src_length: int, max_length: int, use_chat_template: bool
) -> Tuple[Dict, bool, int]:
    """Example -> ({"input_ids", "labels"} shifted, truncated, dropped_rounds).

    ``tokens [1,5,6,2]`` with ``labels [-100,-100,6,2]`` becomes
    ``input_ids [1,5,6]``, ``labels [-100,6,2]``: position i predicts labels[i].
    """
    prefix, turns = encode_turns(example, tokenizer, use_chat_template)
    tokens, labels, truncated, dropped = fit_turns(prefix, turns, src_length, max_length)
    return {"input_ids": tokens[:-1], "labels": labels[1:]}, truncated, dropped


def tokenize_examples(examples, tokenizer, src_length: int, max_length: int, use_chat_template: bool):
    """Tokenize a list; returns (features, TokenizeStats).

    Worked example without a template (bos=1, eos=2; "hi" -> [5], "yo" -> [6, 7]):
    ``[Example(src=["hi"], tgt=["yo"], origin="f:1")]`` -> features
    ``[{"input_ids": [1, 5, 6, 7], "labels": [-100, 6, 7, 2]}]`` and stats
    ``examples=1, tokens=4, supervised_tokens=3, lengths=[4]``.  If tokenizing an
    example fails, ``ValueError("f:1: could not tokenize: ...")`` names its line.
    """
    stats = TokenizeStats()
    out = []
    for ex in examples:
        try:
            feat, truncated, dropped = tokenize_example(ex, tokenizer, src_length, max_length, use_chat_template)
        except Exception as e:
            # Not swallowed: whatever failed (tokenizer, chat template, a prefix longer than max_length) is
            # re-raised with the example's file:line, and the original error stays chained as __cause__.
            raise ValueError(f"{ex.origin}: could not tokenize: {e}") from e
        stats.add(feat, truncated, dropped)
        out.append(feat)
    return out, stats


def length_histogram(lengths: Sequence[int], max_length: int, bins: int = 8) -> Dict[str, int]:
    """``[3, 9, 10]`` with max_length 16, bins 2 -> ``{"1-8": 1, "9-16": 2}``."""
    width = max(1, -(-max_length // bins))
    hist: Dict[str, int] = {}
    for b in range(bins):
        lo, hi = b * width + 1, min((b + 1) * width, max_length)
        if lo > max_length:
            break
        hist[f"{lo}-{hi}"] = sum(1 for n in lengths if lo <= n <= hi)
    return hist


def resolve_chat_template(tokenizer, chat_template: Optional[str]) -> bool:
    """Load ``chat_template`` into the tokenizer if given; return whether a template is used.

    ``*.json`` is PaddleNLP's chat_template.json format (system / conversation
    / query); any other file is read as a jinja template (HF style, rendering
    ``messages``)."""
    if chat_template:
        if chat_template.endswith(".json"):
            tokenizer.init_chat_template(chat_template)
        else:
            tokenizer.init_chat_template(read_utf8_text(chat_template))  # not UTF-8: DataError naming the file
    return bool(getattr(tokenizer, "chat_template", None))


def generation_prompt(
    example, tokenizer, src_length: int, max_length: int, use_chat_template: bool
) -> Tuple[List[int], str]:
    """(prompt ids, reference text) to evaluate an example by generation.

    The prompt is everything before the last target, truncated by the same
    rules as training (src_length, max_length, latest rounds first); the
    reference is the last target text.  Without a template, for
    ``Example(src=["hi"], tgt=["yo"])``: ``([bos] + ids("hi"), "yo")``.
    """
    prefix, turns = encode_turns(example, tokenizer, use_chat_template)
    tokens, labels, _, _ = fit_turns(prefix, turns, src_length, max_length)
    # the last target is the trailing run of supervised labels
    start = len(labels)
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return tokens[:start], example.tgt[-1]
