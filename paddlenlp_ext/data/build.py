"""Config -> datasets + collator + data reports (tokenizer only, never the model)."""

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Optional

import numpy as np

from .collate import PackedCollator, PaddingCollator
from .binpack import batch_padding_ratio
from .packing import PackedDataset
from .chat_template import find_template, special_tokens_of
from .conversation import Renderer
from .formats.detect import parse_stream_line, read_items
from .formats.files import streamable
from .mixture import mixture_order, split_sources
from .dataset_info import named_entry
from .reader import DataError, dataset_files
from .streaming import StreamingPackedDataset
from .tokenize import TokenizeStats, length_histogram, resolve_chat_template


@dataclass
class BuiltData:
    train: Optional[Any]
    dev: Optional[Any]
    collator: Callable
    reports: Dict[str, Dict] = field(default_factory=dict)


def make_renderer(cfg, tokenizer, use_template: bool) -> Renderer:
    """The run's :class:`~.conversation.Renderer`: the jinja template (``chat_template`` key, or the tokenizer
    directory's ``tokenizer_config.json`` / ``chat_template.jinja``) and the loss keys."""
    d, m = cfg.data, cfg.model
    tok_dir = m.tokenizer_name_or_path or m.model_name_or_path
    templates = {has_tools: find_template(tok_dir, d.chat_template, has_tools) for has_tools in (False, True)}
    return Renderer(
        tokenizer,
        d.src_length,
        d.max_length,
        use_template,
        templates,
        special_tokens_of(tokenizer),
        train_on_prompt=d.train_on_prompt,
        autoregressive=d.autoregressive,
    )


def tokenize_items(items, renderer: Renderer, formats: Dict[str, str]):
    """Items -> (features, report); a failure is a DataError naming the item's ``file:line``.

    The report counts, per source file, its format, the records read and how many were truncated
    (``sources``), besides the totals of :class:`~.tokenize.TokenizeStats`."""
    stats = TokenizeStats()
    sources = {f: {"format": fmt, "examples": 0, "truncated": 0, "dropped": 0} for f, fmt in formats.items()}
    out = []
    for item in items:
        try:
            feats, truncated, dropped = renderer(item)
        except (ValueError, TypeError, KeyError, IndexError) as e:  # re-raised with the record's file:line
            msg = str(e)
            raise DataError(
                [msg if msg.startswith(item.origin) else f"{item.origin}: could not tokenize: {msg}"]
            ) from e
        for k, feat in enumerate(feats):
            stats.add(feat, truncated and k == 0, dropped if k == 0 else 0)
        src = sources.get(item.origin.rsplit(":", 1)[0])
        if src is not None:
            src["examples"] += 1
            src["truncated"] += int(truncated)
            src["dropped"] += int(not feats)
        stats.dropped_examples += int(not feats)  # no learned token left after truncation: left out, counted
        out.extend(feats)
    empty = [f for f, v in sources.items() if v["examples"] and v["dropped"] == v["examples"]]
    if empty:  # the one refusal for length: nothing in a file fits
        raise DataError(
            [
                f"{f}: no example of this file keeps a learned token within max_length={renderer.max_length} "
                "after truncation; raise max_length (or lower src_length)"
                for f in empty
            ]
        )
    return out, stats, sources


def source_files(src: str, split: str, d):
    """``(files, dataset_format, dataset_columns)`` of one source of ``dataset_name_or_path``: a directory or
    file (the run's format and columns), or the name of a ``dataset_dir/dataset_info.json`` entry (its files as
    the train split, its formatting, its columns and tags over the run's; :mod:`.dataset_info`)."""
    entry = named_entry(src, d)
    if entry is not None:
        return (entry.files if split == "train" else []), entry.format, {**(d.dataset_columns or {}), **entry.columns}
    return dataset_files(src, split), d.dataset_format, d.dataset_columns


def tokenize_split(cfg, tokenizer, split: str, use_template: bool, renderer: Optional[Renderer] = None, seed: int = 0):
    """One split, tokenized.  Several sources (comma-separated ``dataset_name_or_path``): the train split is
    their mixture (:mod:`.mixture`, by ``dataset_weights`` / ``mix_strategy`` and ``seed``), dev splits are
    concatenated."""
    d = cfg.data
    renderer = renderer or make_renderer(cfg, tokenizer, use_template)
    per_source, files, formats, stats = [], [], {}, TokenizeStats()
    sources = split_sources(d.dataset_name_or_path)
    for src in sources:
        src_files, fmt, columns = source_files(src, split, d)
        if not src_files:
            continue  # config checks: a needed split exists in every source
        items, src_formats = read_items(src_files, fmt, columns)
        feats, src_stats, by_file = tokenize_items(items, renderer, src_formats)
        per_source.append(feats)
        files += src_files
        formats.update(by_file)
        stats.merge(src_stats)
    if len(per_source) > 1 and split == "train":
        order = mixture_order([len(f) for f in per_source], d.dataset_weights, d.mix_strategy, seed)
        features = [per_source[s][i] for s, i in order]
    else:
        order, features = None, [f for feats in per_source for f in feats]
    report = {"files": files, **stats.as_dict(), "length_histogram": length_histogram(stats.lengths, d.max_length)}
    if any(v["format"] != "paddlenlp" for v in formats.values()) or d.autoregressive or len(sources) > 1:
        report.update(sources=formats, template="jinja" if renderer.jinja else "paddlenlp" if use_template else "none")
    if order is not None:
        report["mixture"] = {
            "strategy": d.mix_strategy,
            "rows": len(order),
            "per_source": {src: sum(1 for s, _ in order if s == k) for k, src in enumerate(sources)},
        }
    return features, report


def build_datasets(cfg, tokenizer, do_train: bool, do_eval: bool, seed: int, resume_cursor=None) -> BuiltData:
    """Tokenized (and packed) train/dev sets.  With ``lazy`` the train set is a
    stream (``StreamingPackedDataset``) starting at ``resume_cursor``; dev sets
    are always loaded in memory (they are small, and eval needs their length)."""
    d = cfg.data
    use_template = resolve_chat_template(tokenizer, d.chat_template)
    reports, train, dev = {}, None, None
    renderer = make_renderer(cfg, tokenizer, use_template)
    if do_train and d.lazy:
        files, fmt, columns = source_files(d.dataset_name_or_path, "train", d)
        whole = [f for f in files if not streamable(f)]
        if whole:
            raise DataError(
                [
                    f"{whole[0]}: lazy=true streams JSON lines and .txt files; this file is a JSON array or "
                    "parquet (read whole): convert it to JSON lines or set lazy=false"
                ]
            )
        train = StreamingPackedDataset(
            files,
            partial(_tokenize_streamed, renderer=renderer),
            d.max_length,
            tokenizer.pad_token_id,
            greedy=d.greedy_zero_padding,
            group_size=d.greedy_group_size,
            seed=seed,
            start=resume_cursor,
            packed=d.zero_padding,
            parse=partial(parse_stream_line, fmt=fmt, columns=columns),
        )
        reports["train"] = {
            "files": files,
            "lazy": True,
            "chat_template": use_template,
            "packing": ("greedy" if d.greedy_zero_padding else "in_order") if d.zero_padding else "none",
        }
    elif do_train:
        train, reports["train"] = tokenize_split(cfg, tokenizer, "train", use_template, renderer, seed)
    if do_eval:
        dev, reports["dev"] = tokenize_split(cfg, tokenizer, "dev", use_template, renderer)
    for r in reports.values():
        r["chat_template"] = use_template
    if d.zero_padding:
        if not d.lazy:
            train = pack(cfg, train, tokenizer, seed, reports.get("train"))
        dev = pack(cfg, dev, tokenizer, seed, reports.get("dev"))
        return BuiltData(train=train, dev=dev, collator=PackedCollator(cfg.model.flash_mask), reports=reports)
    t = cfg.training
    for feats, split, bs in (
        (train, "train", t.get("per_device_train_batch_size", 8)),
        (dev, "dev", t.get("per_device_eval_batch_size", 8)),
    ):
        if feats is not None and not isinstance(feats, StreamingPackedDataset):
            reports[split].update(batch_padding_report(feats, bs, seed))
    collator = PaddingCollator(
        tokenizer.pad_token_id, d.pad_to_multiple_of, d.max_length if d.pad_to_max_length else None
    )
    return BuiltData(train=train, dev=dev, collator=collator, reports=reports)


def _tokenize_streamed(item, renderer):
    """The renderer for the lazy stream: a failure is a DataError naming the record's file:line, as in memory."""
    try:
        return renderer(item)
    except (ValueError, TypeError, KeyError, IndexError) as e:  # re-raised with the record's file:line
        msg = str(e)
        raise DataError([msg if msg.startswith(item.origin) else f"{item.origin}: could not tokenize: {msg}"]) from e


def batch_padding_report(features, batch_size: int, seed: int) -> Dict:
    """Expected padding without packing: batches drawn in a seeded shuffled
    order (as the Trainer's sampler does), each padded to its longest example.

    Example: lengths 1 and 3 in one batch of 2 fill 4 of 2 x 3 slots, in either order:

    >>> batch_padding_report([{"input_ids": [7]}, {"input_ids": [7, 8, 9]}], batch_size=2, seed=0)
    {'packing': 'none', 'batches': 1, 'padding_ratio': 0.333333}
    """
    lengths = np.array([len(f["input_ids"]) for f in features], dtype=np.int64)
    order = np.random.RandomState(seed).permutation(len(lengths))
    return {
        "packing": "none",
        "batches": -(-len(lengths) // batch_size),
        "padding_ratio": round(batch_padding_ratio(lengths[order], batch_size), 6),
    }


def pack(cfg, features, tokenizer, seed: int, report: Optional[Dict]):
    """Tokenized examples -> PackedDataset (rows of max_length); adds pack stats to ``report``.

    Features of lengths 6, 5, 2, 3 with max_length 8 and greedy zero padding give 2 rows
    (``[[0, 2], [1, 3]]``), and ``report`` gains ``packing="greedy", packs=2, padding_ratio=0.0``.
    """
    if features is None:
        return None
    d = cfg.data
    ds = PackedDataset(
        features,
        d.max_length,
        tokenizer.pad_token_id,
        greedy=d.greedy_zero_padding,
        group_size=d.greedy_group_size,
        seed=seed,
    )
    stats = ds.stats()
    report.update(
        packing="greedy" if d.greedy_zero_padding else "in_order",
        packs=stats["packs"],
        padding_ratio=round(stats["padding_ratio"], 6),
    )
    return ds
