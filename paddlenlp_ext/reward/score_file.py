"""Score a JSON-lines (or JSON array / parquet) file with a reward model (``llm/predict/reward_score.py``).

Each record is either

* a completion: ``{"prompt": "...", "response": "..."}`` -> the record plus ``"score"``
  (``RewardScorer.score_texts``), or
* a preference pair in any format reward training reads (DPO's: ``src``/``tgt``/``response``/``sort``,
  ``conversations`` or ``messages`` + ``chosen``/``rejected``) -> the record plus ``"chosen_score"``
  and ``"rejected_score"``, each answer tokenized exactly as training tokenized it (history, template,
  truncation).  The pair accuracy (chosen > rejected) is reported over the pair records.

Bad records are all reported together with ``file:line`` (DataError); nothing is skipped.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import numpy as np

from ..data.formats.files import parse_records
from ..dpo.data import tokenize_pair
from ..dpo.records import preference_from_obj


def parse_score_record(obj: Any, origin: str) -> Tuple[str, Any, Any]:
    """``("completion", obj, (prompt, response))`` or ``("pair", obj, PreferenceExample)``.

    >>> parse_score_record({"prompt": "q", "response": "a"}, "f:1")
    ('completion', {'prompt': 'q', 'response': 'a'}, ('q', 'a'))
    """
    if isinstance(obj, dict) and "prompt" in obj and "response" in obj and "chosen" not in obj:
        prompt, response = obj["prompt"], obj["response"]
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise ValueError("'prompt' and 'response' must be strings")
        return "completion", obj, (prompt, response)
    try:
        ex = preference_from_obj(obj, origin)
    except ValueError as e:
        raise ValueError(f'neither {{"prompt", "response"}} nor a preference pair: {e}') from e
    return "pair", obj, ex


def score_records(scorer, files: List[str]) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """(output records, summary ``{"records", "pairs", "pair_accuracy", "mean_margin"}``)."""
    records = parse_records(files, parse_score_record)
    info = scorer.info
    max_seq_len = int(info.get("max_seq_len") or 4096)
    max_prompt_len = int(info.get("max_prompt_len") or max_seq_len - 1)
    seqs: List[List[int]] = []
    for kind, _, item in records:
        if kind == "completion":
            seqs.append(scorer.encode(*item))
        else:
            pair, _ = tokenize_pair(item, scorer.tokenizer, max_seq_len, max_prompt_len, scorer.use_chat_template)
            seqs += [pair["prompt"] + pair["chosen"], pair["prompt"] + pair["rejected"]]
    scores = scorer.score_ids(seqs) if seqs else np.zeros([0], dtype=np.float32)
    out, k, margins = [], 0, []
    for kind, obj, _ in records:
        row = dict(obj) if isinstance(obj, dict) else {"record": obj}
        if kind == "completion":
            row["score"] = float(scores[k])
            k += 1
        else:
            row["chosen_score"], row["rejected_score"] = float(scores[k]), float(scores[k + 1])
            margins.append(float(scores[k] - scores[k + 1]))
            k += 2
        out.append(row)
    summary = {"records": len(out), "pairs": len(margins)}
    if margins:
        summary["pair_accuracy"] = float(np.mean(np.asarray(margins) > 0))
        summary["mean_margin"] = float(np.mean(margins))
    return out, summary


def write_jsonl(path: str, rows: List[Dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
