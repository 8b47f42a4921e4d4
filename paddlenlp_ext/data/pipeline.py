"""Config -> datasets + collator + data reports (tokenizer only, never the model)."""

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Optional

import numpy as np

from .collate import PackedCollator, PaddingCollator
from .binpack import batch_padding_ratio
from .packing import PackedDataset
from .reader import DataError, find_split_files, read_examples
from .streaming import StreamingPackedDataset
from .tokenize import length_histogram, resolve_chat_template, tokenize_example, tokenize_examples


@dataclass
class BuiltData:
    train: Optional[Any]
    dev: Optional[Any]
    collator: Callable
    reports: Dict[str, Dict] = field(default_factory=dict)


def tokenize_split(cfg, tokenizer, split: str, use_template: bool):
    d = cfg.data
    files = find_split_files(d.dataset_name_or_path, split)
    examples = read_examples(files)
    try:
        features, stats = tokenize_examples(examples, tokenizer, d.src_length, d.max_length, use_template)
    except ValueError as e:  # "file:line: could not tokenize: ...": bad input, exit 2 like any data error
        raise DataError([str(e)]) from e
    report = {"files": files, **stats.as_dict(), "length_histogram": length_histogram(stats.lengths, d.max_length)}
    return features, report


def build_datasets(cfg, tokenizer, do_train: bool, do_eval: bool, seed: int, resume_cursor=None) -> BuiltData:
    """Tokenized (and packed) train/dev sets.  With ``lazy`` the train set is a
    stream (``StreamingPackedDataset``) starting at ``resume_cursor``; dev sets
    are always loaded in memory (they are small, and eval needs their length)."""
    d = cfg.data
    use_template = resolve_chat_template(tokenizer, d.chat_template)
    reports, train, dev = {}, None, None
    if do_train and d.lazy:
        files = find_split_files(d.dataset_name_or_path, "train")
        train = StreamingPackedDataset(
            files, partial(_tokenize_streamed, tokenizer=tokenizer, src_length=d.src_length, max_length=d.max_length,
                           use_chat_template=use_template),
            d.max_length, tokenizer.pad_token_id, greedy=d.greedy_zero_padding, group_size=d.greedy_group_size,
            seed=seed, start=resume_cursor, packed=d.zero_padding,
        )
        reports["train"] = {"files": files, "lazy": True, "chat_template": use_template,
                            "packing": ("greedy" if d.greedy_zero_padding else "in_order") if d.zero_padding else "none"}
    elif do_train:
        train, reports["train"] = tokenize_split(cfg, tokenizer, "train", use_template)
    if do_eval:
        dev, reports["dev"] = tokenize_split(cfg, tokenizer, "dev", use_template)
    for r in reports.values():
        r["chat_template"] = use_template
    if d.zero_padding:
        if not d.lazy:
            train = pack(cfg, train, tokenizer, seed, reports.get("train"))
        dev = pack(cfg, dev, tokenizer, seed, reports.get("dev"))
        return BuiltData(train=train, dev=dev, collator=PackedCollator(cfg.model.flash_mask), reports=reports)
    t = cfg.training
    for feats, split, bs in ((train, "train", t.get("per_device_train_batch_size", 8)),
                             (dev, "dev", t.get("per_device_eval_batch_size", 8))):
        if feats is not None and not isinstance(feats, StreamingPackedDataset):
            reports[split].update(batch_padding_report(feats, bs, seed))
    collator = PaddingCollator(
        tokenizer.pad_token_id, d.pad_to_multiple_of, d.max_length if d.pad_to_max_length else None
    )
    return BuiltData(train=train, dev=dev, collator=collator, reports=reports)


def _tokenize_streamed(example, **kwargs):
    """``tokenize_example`` for the lazy stream: a failure is a DataError naming the example's
    file:line, as in memory (``tokenize_examples``)."""
    try:
        return tokenize_example(example, **kwargs)
    except (ValueError, TypeError, KeyError, IndexError) as e:  # re-raised with the example's file:line
        raise DataError([f"{example.origin}: could not tokenize: {e}"]) from e


def batch_padding_report(features, batch_size: int, seed: int) -> Dict:
    """Expected padding without packing: batches drawn in a seeded shuffled
    order (as the Trainer's sampler does), each padded to its longest example.

    Example: lengths 1 and 3 in one batch of 2 fill 4 of 2 x 3 slots, in either order:

    >>> batch_padding_report([{"input_ids": [7]}, {"input_ids": [7, 8, 9]}], batch_size=2, seed=0)
    {'packing': 'none', 'batches': 1, 'padding_ratio': 0.333333}
    """
    lengths = np.array([len(f["input_ids"]) for f in features], dtype=np.int64)
    order = np.random.RandomState(seed).permutation(len(lengths))
    return {"packing": "none", "batches": -(-len(lengths) // batch_size),
            "padding_ratio": round(batch_padding_ratio(lengths[order], batch_size), 6)}


def pack(cfg, features, tokenizer, seed: int, report: Optional[Dict]):
    """Tokenized examples -> PackedDataset (rows of max_length); adds pack stats to ``report``.

    Features of lengths 6, 5, 2, 3 with max_length 8 and greedy zero padding give 2 rows
    (``[[0, 2], [1, 3]]``), and ``report`` gains ``packing="greedy", packs=2, padding_ratio=0.0``.
    """
    if features is None:
        return None
    d = cfg.data
    ds = PackedDataset(
        features, d.max_length, tokenizer.pad_token_id, greedy=d.greedy_zero_padding,
        group_size=d.greedy_group_size, seed=seed,
    )
    stats = ds.stats()
    report.update(packing="greedy" if d.greedy_zero_padding else "in_order", packs=stats["packs"],
                  padding_ratio=round(stats["padding_ratio"], 6))
    return ds
