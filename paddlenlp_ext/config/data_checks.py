"""Config checks of the dataset-format keys (``dataset_format``, ``dataset_columns``, ``train_on_prompt``,
``autoregressive``); no paddle import.  Example: ``dataset_columns: {"promt": "q"}`` -> ``unknown name 'promt'``."""

import os
from typing import List

from ..data.dataset_info import DatasetInfoError, INFO_FILE, is_entry, lookup
from ..data.mixture import split_sources
from ..data.reader import find_split_files
from .problems import Problem


def dataset_path_problems(d, do_train: bool, do_eval: bool, where: str) -> List[str]:
    """``dataset_name_or_path``: each comma-separated source is a directory (train/dev files as
    PaddleNLP's layout) or one data file (train only); ``dataset_weights`` / ``mix_strategy`` fit them."""
    p: List[str] = dataset_dir_problems(d.dataset_dir, where)
    sources = split_sources(d.dataset_name_or_path)
    for src in sources:
        if is_entry(src, d.dataset_dir):  # a name of dataset_info.json (data/dataset_info.py)
            p += named_dataset_problems(src, d.dataset_dir, where, ranking=False, dev=do_eval)
        elif os.path.isfile(src):
            if do_eval:
                p.append(
                    Problem(
                        f"{where}: dataset_name_or_path {src!r} is one file (the train split); do_eval "
                        "needs a directory with train and dev files",
                        "data_dir",
                    )
                )
        elif not os.path.isdir(src):
            p.append(
                Problem(
                    f"{where}: dataset_name_or_path {src!r} is not a directory or a data file (looked for "
                    f"{os.path.abspath(src)})",
                    "data_dir",
                )
            )
        else:
            for flag, split in ((do_train, "train"), (do_eval, "dev")):
                if flag and not find_split_files(src, split):
                    p.append(
                        Problem(
                            f"{where}: {src!r} has no {split}.json or {split}/*.json "
                            f"(needed by do_{'train' if split == 'train' else 'eval'})",
                            "data_dir",
                        )
                    )
    if d.dataset_weights is not None:
        if len(d.dataset_weights) != len(sources):
            p.append(
                f"{where}: dataset_weights has {len(d.dataset_weights)} values for {len(sources)} source(s) in "
                "dataset_name_or_path; give one weight per source"
            )
        if any(not isinstance(w, (int, float)) or w <= 0 for w in d.dataset_weights):
            p.append(f"{where}: dataset_weights must be positive numbers; got {d.dataset_weights}")
        if d.mix_strategy == "concat":
            p.append(
                f"{where}: dataset_weights need mix_strategy interleave_under or interleave_over (concat uses "
                "every example of each source once)"
            )
    if len(sources) > 1 and d.lazy:
        p.append(
            f"{where}: lazy=true streams one source; a mixture of {len(sources)} sources is read in memory "
            "(set lazy=false, or combine the files into one source directory)"
        )
    return p


def dataset_dir_problems(dataset_dir, where: str) -> List[str]:
    """``dataset_dir`` is a directory holding ``dataset_info.json`` (LLaMA-Factory's layout)."""
    if dataset_dir is None:
        return []
    if not os.path.isfile(os.path.join(dataset_dir, INFO_FILE)):
        return [
            Problem(
                f"{where}: dataset_dir {dataset_dir!r} has no {INFO_FILE} (looked for "
                f"{os.path.abspath(os.path.join(dataset_dir, INFO_FILE))})",
                "data_dir",
            )
        ]
    return []


def named_dataset_problems(name: str, dataset_dir: str, where: str, ranking: bool, dev: bool = False) -> List[str]:
    """A ``dataset_info.json`` entry used by name: usable here (local files, its formatting and columns), a
    preference (``ranking``) entry exactly where pairs are trained, and one split only (the train split)."""
    try:
        entry = lookup(name, dataset_dir)
    except DatasetInfoError as e:
        return [f"{where}: {e}"]
    p = []
    if entry.ranking != ranking:
        p.append(
            f"{where}: {name!r} in {dataset_dir}/{INFO_FILE} is "
            + (
                "a preference dataset (ranking: true); train it with llm/run_dpo.py or llm/run_reward.py"
                if entry.ranking
                else 'not a preference dataset (no "ranking": true); DPO and reward models train '
                "on chosen / rejected pairs"
            )
        )
    if dev:
        p.append(
            f"{where}: {name!r} names a dataset_info.json entry, which is one split (train); do_eval needs a "
            "directory with train and dev files as dataset_name_or_path (or set do_eval false)"
        )
    return p


def data_format_problems(d, where: str) -> List[str]:
    """The dataset-format keys: known ``dataset_columns`` names (string values), ``autoregressive`` without
    generation eval or a jinja-only option."""
    from ..data.formats.convo import DEFAULT_COLUMNS, DEFAULT_TAGS

    p = []
    if d.dataset_columns is not None:
        known = set(DEFAULT_COLUMNS) | set(DEFAULT_TAGS) | {"messages", "chosen", "rejected", "kto_tag"}
        for key, val in d.dataset_columns.items():
            if key not in known:
                p.append(f"{where}: dataset_columns has unknown name {key!r}; known: {', '.join(sorted(known))}")
            elif not isinstance(val, str):
                p.append(f"{where}: dataset_columns[{key!r}] must be a field name (string)")
    if d.autoregressive:
        if d.eval_with_do_generation:
            p.append(
                f"{where}: autoregressive=true trains on raw text; eval_with_do_generation needs prompts and "
                "answers (set it false)"
            )
        if d.train_on_prompt:
            p.append(f"{where}: autoregressive=true already supervises every token; remove train_on_prompt")
        if d.dataset_format not in ("auto", "text"):
            p.append(
                f"{where}: autoregressive=true reads text records; dataset_format {d.dataset_format!r} is a "
                "conversation format (use auto or text)"
            )
    return p
