"""Config checks of the dataset-format keys (``dataset_format``, ``dataset_columns``, ``train_on_prompt``,
``autoregressive``); no paddle import.  Example: ``dataset_columns: {"promt": "q"}`` -> ``unknown name 'promt'``."""

from typing import List


def data_format_problems(d, where: str) -> List[str]:
    """The dataset-format keys: known ``dataset_columns`` names (string values), ``autoregressive`` without
    generation eval or a jinja-only option."""
    from ..data.formats.convo import DEFAULT_COLUMNS, DEFAULT_TAGS

    p = []
    if d.dataset_columns is not None:
        known = set(DEFAULT_COLUMNS) | set(DEFAULT_TAGS) | {"messages"}
        for key, val in d.dataset_columns.items():
            if key not in known:
                p.append(f"{where}: dataset_columns has unknown name {key!r}; known: {', '.join(sorted(known))}")
            elif not isinstance(val, str):
                p.append(f"{where}: dataset_columns[{key!r}] must be a field name (string)")
    if d.autoregressive:
        if d.eval_with_do_generation:
            p.append(f"{where}: autoregressive=true trains on raw text; eval_with_do_generation needs prompts and "
                     "answers (set it false)")
        if d.train_on_prompt:
            p.append(f"{where}: autoregressive=true already supervises every token; remove train_on_prompt")
        if d.dataset_format not in ("auto", "text"):
            p.append(f"{where}: autoregressive=true reads text records; dataset_format {d.dataset_format!r} is a "
                     "conversation format (use auto or text)")
    return p
