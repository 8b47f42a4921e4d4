"""The predictor's options (PaddleNLP's predictor flags) and their checks, before anything loads (no paddle).

Meanings are PaddleNLP's (llm/docs/predict/inference.md):

* ``src_length``: the longest input context, in tokens;
* ``max_length``: prompt + answer, in tokens (the answer gets ``max_length - len(prompt)``);
* ``decode_strategy`` ``sampling`` with ``top_k`` 1 keeps only the most likely token, i.e. greedy
  decoding (PaddleNLP's defaults are top_k 1, top_p 1.0, temperature 1.0); it then runs as
  ``greedy_search``, exactly as PaddleNLP's streaming predictor does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..config.paths import model_dir_text

DECODE_STRATEGIES = ("greedy_search", "sampling")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "gpu")
DEFAULT_SRC_LENGTH = 1024  # PaddleNLP's predictor defaults, capped by the model's max_position_embeddings
DEFAULT_MAX_LENGTH = 2048
DEFAULT_OUTPUT_FILE = "output.json"  # PaddleNLP's predictor default

#: files that make a --lora_path directory an adapter of each kind
ADAPTER_FILES = ("adapter_config.json", "lora_config.json", "vera_config.json")  # adapters/ (ours, PaddleNLP's)
PREFIX_FILES = ("prefix_config.json",)  # prefix/ (PaddleNLP's format)


@dataclass
class PredictOptions:
    model_name_or_path: str
    lora_path: Optional[str] = None
    data_file: Optional[str] = None
    output_file: Optional[str] = None  # file mode: DEFAULT_OUTPUT_FILE; chat: the turns, only when given
    batch_size: int = 1
    src_length: Optional[int] = None  # None: DEFAULT_SRC_LENGTH, at most half of max_length
    max_length: Optional[int] = None  # None: DEFAULT_MAX_LENGTH, at most max_position_embeddings
    decode_strategy: str = "sampling"
    top_k: int = 1
    top_p: float = 1.0
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    dtype: str = "float32"
    chat: bool = False
    chat_template: Optional[str] = None
    device: Optional[str] = None  # None: gpu when Paddle has one, else cpu
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        """Greedy decoding: asked for, or sampling from the top-1 token only."""
        return self.decode_strategy == "greedy_search" or self.top_k == 1


def adapter_kind(path: str) -> Optional[str]:
    """``"adapter"`` (LoRA family, VeRA, LoKr; ours or PaddleNLP's), ``"prefix"``, or None."""
    if any(os.path.isfile(os.path.join(path, f)) for f in ADAPTER_FILES):
        return "adapter"
    if any(os.path.isfile(os.path.join(path, f)) for f in PREFIX_FILES):
        return "prefix"
    return None


def _model_config(model_dir: str, problems: List[str]) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        problems.append(f"--{model_dir_text('model_name_or_path', model_dir)}")  # names the absolute path tried
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        problems.append(f"{path}:{e.lineno}: invalid JSON ({e.msg})")
        return {}


def _lengths(o: PredictOptions, mpe: Optional[int], where: str, problems: List[str]) -> Tuple[int, int]:
    max_length = o.max_length if o.max_length is not None else min(DEFAULT_MAX_LENGTH, mpe or DEFAULT_MAX_LENGTH)
    src_length = o.src_length if o.src_length is not None else min(DEFAULT_SRC_LENGTH, max_length // 2)
    if src_length < 1:
        problems.append(f"--src_length {src_length}: must be at least 1")
    if max_length <= src_length:
        problems.append(
            f"--max_length {max_length} must be greater than --src_length {src_length}: max_length counts the prompt "
            f"AND the answer (PaddleNLP's meaning), so nothing would be left to generate; e.g. --src_length "
            f"{src_length} --max_length {2 * src_length}"
        )
    if mpe and max_length > mpe:
        problems.append(
            f"--max_length {max_length} exceeds max_position_embeddings={mpe} in {where}: the model "
            f"was not built for longer sequences; use --max_length {mpe} or less"
        )
    return src_length, max_length


def check_options(o: PredictOptions) -> Tuple[PredictOptions, List[str], List[str]]:
    """(options with the lengths resolved, problems, notes).  Every problem at once; no problem -> ready to load."""
    problems: List[str] = []
    notes: List[str] = []
    if not o.data_file and not o.chat:
        problems.append(
            'nothing to do: give --data_file FILE (JSON lines with "src") to predict a file, '
            "or --chat for an interactive session"
        )
    if o.data_file and o.chat:
        problems.append("--data_file and --chat are two modes; give one of them")
    if o.data_file and not os.path.isfile(o.data_file):
        problems.append(f"--data_file {o.data_file}: no such file")
    cfg = _model_config(o.model_name_or_path, problems)
    if cfg.get("model_type"):  # a family the table refuses (docs/models.md) is refused here too
        from ..config.family_checks import unlisted_allowed
        from ..models.family_table import family_problem

        why = family_problem(cfg.get("model_type"), allow_unlisted=unlisted_allowed())
        if why:
            problems.append(f"--model_name_or_path {o.model_name_or_path}: {why}")
    mpe = cfg.get("max_position_embeddings")
    src_length, max_length = _lengths(
        o,
        mpe if isinstance(mpe, int) and mpe > 0 else None,
        os.path.join(o.model_name_or_path, "config.json"),
        problems,
    )
    if o.lora_path:
        if not os.path.isdir(o.lora_path):
            problems.append(f"--lora_path {o.lora_path}: no such directory")
        elif adapter_kind(o.lora_path) is None:
            problems.append(
                f"--lora_path {o.lora_path}: holds none of {', '.join(ADAPTER_FILES + PREFIX_FILES)}; "
                "give the output_dir (or a checkpoint-N/) of an adapter or prefix-tuning run"
            )
    if o.chat_template and not os.path.isfile(o.chat_template):
        problems.append(
            f"--chat_template {o.chat_template}: no such file (a jinja template or PaddleNLP's "
            "chat_template.json, the file given to training as chat_template)"
        )
    if o.decode_strategy not in DECODE_STRATEGIES:
        problems.append(f"--decode_strategy {o.decode_strategy!r}: choose one of {', '.join(DECODE_STRATEGIES)}")
    if o.dtype not in DTYPES:
        problems.append(f"--dtype {o.dtype!r}: choose one of {', '.join(DTYPES)}")
    if o.device is not None and o.device not in DEVICES:
        problems.append(f"--device {o.device!r}: choose one of {', '.join(DEVICES)}")
    for name, ok, rule in (
        ("batch_size", o.batch_size >= 1, "at least 1"),
        ("top_k", o.top_k >= 0, "0 (no top-k filter) or more"),
        ("top_p", 0.0 < o.top_p <= 1.0, "in (0, 1]"),
        ("temperature", o.temperature > 0.0, "greater than 0"),
        ("repetition_penalty", o.repetition_penalty > 0.0, "greater than 0 (1.0 = off)"),
    ):
        if not ok:
            problems.append(f"--{name} {getattr(o, name)}: must be {rule}")
    if o.output_file and os.path.isdir(o.output_file):
        problems.append(
            f"--output_file {o.output_file} is a directory; give a file name, e.g. "
            f"{os.path.join(o.output_file, DEFAULT_OUTPUT_FILE)}"
        )
    if o.chat and o.batch_size != 1:
        notes.append("--batch_size has no effect with --chat (one conversation, one answer at a time)")
    if o.greedy and (o.temperature != 1.0 or o.top_p != 1.0):
        notes.append(
            "decoding is greedy (--decode_strategy greedy_search, or --top_k 1 which keeps only the most "
            "likely token), so --temperature and --top_p change nothing; sample with "
            "--decode_strategy sampling --top_k 0"
        )
    output_file = o.output_file or (DEFAULT_OUTPUT_FILE if o.data_file else None)
    return (
        dataclasses.replace(o, src_length=src_length, max_length=max_length, output_file=output_file),
        problems,
        notes,
    )


def add_generation_flags(p: argparse.ArgumentParser) -> None:
    """The flags the predictor and the server (``llm/predict/server.py``) share: lengths, decoding, dtype,
    device, chat template (PaddleNLP's names and defaults)."""
    d = PredictOptions(model_name_or_path="")
    p.add_argument(
        "--max_length",
        type=int,
        default=None,
        help="prompt + answer in tokens (default 2048, at most max_position_embeddings)",
    )
    p.add_argument("--decode_strategy", choices=DECODE_STRATEGIES, default=d.decode_strategy)
    p.add_argument("--top_k", type=int, default=d.top_k, help="1 = greedy (default); 0 = no top-k filter")
    p.add_argument("--top_p", type=float, default=d.top_p)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--repetition_penalty", type=float, default=d.repetition_penalty)
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype)
    p.add_argument("--device", choices=DEVICES, default=None, help="default: gpu if Paddle has one, else cpu")
    p.add_argument("--chat_template", default=None, help="chat template file given to training, if any")
