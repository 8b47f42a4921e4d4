"""Config -> datasets + collator + data reports (tokenizer only, never the model)."""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

from .collate import PackedCollator, PaddingCollator
from .packing import PackedDataset
from .reader import find_split_files, read_examples
from .tokenize import length_histogram, resolve_chat_template, tokenize_examples


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
    features, stats = tokenize_examples(examples, tokenizer, d.src_length, d.max_length, use_template)
    report = {"files": files, **stats.as_dict(), "length_histogram": length_histogram(stats.lengths, d.max_length)}
    return features, report


def build_datasets(cfg, tokenizer, do_train: bool, do_eval: bool, seed: int) -> BuiltData:
    d = cfg.data
    use_template = resolve_chat_template(tokenizer, d.chat_template)
    reports, train, dev = {}, None, None
    if do_train:
        train, reports["train"] = tokenize_split(cfg, tokenizer, "train", use_template)
    if do_eval:
        dev, reports["dev"] = tokenize_split(cfg, tokenizer, "dev", use_template)
    for r in reports.values():
        r["chat_template"] = use_template
    if d.zero_padding:
        train, dev = (pack(cfg, feats, tokenizer, seed, reports.get(split)) for feats, split in ((train, "train"), (dev, "dev")))
        return BuiltData(train=train, dev=dev, collator=PackedCollator(cfg.model.flash_mask), reports=reports)
    collator = PaddingCollator(
        tokenizer.pad_token_id, d.pad_to_multiple_of, d.max_length if d.pad_to_max_length else None
    )
    return BuiltData(train=train, dev=dev, collator=collator, reports=reports)


def pack(cfg, features, tokenizer, seed: int, report: Optional[Dict]):
    """Tokenized examples -> PackedDataset (rows of max_length); adds pack stats to ``report``."""
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
