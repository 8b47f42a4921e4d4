"""The speed regression guard of ``bench/e2e.py --quick``: this run's figures against the last recorded ones.

docs/benchmarks.md holds the recorded figures in one markdown table between two markers, a row per
run and case, filed under the CPU's ISA class (``bench/peak.py``'s ``avx512`` / ``avx2`` / ``baseline``)::

    <!-- quick-guard -->
    | isa | case | supervised tok/s | peak RSS GiB | date | commit | load | command |
    |---|---|---|---|---|---|---|---|
    | avx512 | lora | 80.1 | 2.50 | 2026-11-27 | abc1234 | load average 3.1 | bench.e2e --quick |
    <!-- /quick-guard -->

The last row of an (isa, case) is the one compared with: a newer measurement is recorded below the
older ones (``--record`` does that).  A case is flagged **slower** when its supervised tokens/s is
below the recorded one by more than the tolerance, **more memory** when its peak RSS is above it by
more than the tolerance.  Nothing here imports paddle or runs anything.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

BEGIN, END = "<!-- quick-guard -->", "<!-- /quick-guard -->"
COLUMNS = ("isa", "case", "supervised tok/s", "peak RSS GiB", "date", "commit", "load", "command")


class GuardTableError(ValueError):
    """The recorded figures' table is missing or malformed (the message names the file's line)."""


def _cells(line: str) -> List[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _block(text: str, where: str) -> Tuple[int, int]:
    """The line indexes (0-based) of the begin and end markers."""
    lines = text.splitlines()
    begin = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    end = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
        raise GuardTableError(
            f"{where}: want exactly one {BEGIN} ... {END} block with the recorded figures "
            f"(found {len(begin)} begin and {len(end)} end markers)"
        )
    return begin[0], end[0]


def parse_baselines(text: str, where: str = "docs/benchmarks.md") -> Dict[Tuple[str, str], dict]:
    """{(isa, case): the last row recorded for it} of the guard's table in ``text``.

    >>> doc = "\\n".join([BEGIN, "| " + " | ".join(COLUMNS) + " |", "|---|---|---|---|---|---|---|---|",
    ...     "| avx512 | lora | 80.0 | 2.50 | d1 | c1 | quiet | x |", "| avx512 | lora | 82.5 | 2.40 | d2 | c2 | quiet | x |",
    ...     END])
    >>> parse_baselines(doc)[("avx512", "lora")]["sup_tok_s"], parse_baselines(doc)[("avx512", "lora")]["date"]
    (82.5, 'd2')
    """
    begin, end = _block(text, where)
    lines = text.splitlines()
    rows = [(i, line) for i, line in enumerate(lines[begin + 1 : end], begin + 1) if line.strip().startswith("|")]
    if not rows or tuple(_cells(rows[0][1])) != COLUMNS:
        raise GuardTableError(
            f"{where}:{begin + 2}: the guard's table must start with the header | {' | '.join(COLUMNS)} |"
        )
    out = {}
    for i, line in rows[2:]:  # after the header and its |---| line
        cells = _cells(line)
        if len(cells) != len(COLUMNS):
            raise GuardTableError(f"{where}:{i + 1}: {len(cells)} cells, want {len(COLUMNS)} ({', '.join(COLUMNS)})")
        row = dict(zip(COLUMNS, cells))
        try:
            figures = {"sup_tok_s": float(row["supervised tok/s"]), "peak_rss_gib": float(row["peak RSS GiB"])}
        except ValueError:
            raise GuardTableError(
                f"{where}:{i + 1}: supervised tok/s and peak RSS GiB must be numbers, got "
                f"{row['supervised tok/s']!r} and {row['peak RSS GiB']!r}"
            ) from None
        out[(row["isa"], row["case"])] = {
            **figures,
            "date": row["date"],
            "commit": row["commit"],
            "load": row["load"],
            "line": i + 1,
        }
    return out


def compare(now: Dict[str, dict], baselines: Dict[Tuple[str, str], dict], isa: str, tolerance: float) -> List[dict]:
    """One verdict per case of ``now`` ({case: {"sup_tok_s", "peak_rss_gib"}}) against the recorded row of
    the same ISA: ``speed`` and ``memory`` are ratios now / recorded, ``flags`` what is over the tolerance
    (``recorded`` None: nothing recorded for this ISA and case).

    >>> base = {("avx512", "lora"): {"sup_tok_s": 100.0, "peak_rss_gib": 2.0}}
    >>> v = compare({"lora": {"sup_tok_s": 80.0, "peak_rss_gib": 2.1}}, base, "avx512", 0.1)[0]
    >>> round(v["speed"], 2), round(v["memory"], 2), v["flags"]
    (0.8, 1.05, ['slower'])
    """
    out = []
    for case, fig in now.items():
        rec = baselines.get((isa, case))
        v = {"case": case, "now": fig, "recorded": rec, "speed": None, "memory": None, "flags": []}
        if rec:
            v["speed"] = fig["sup_tok_s"] / rec["sup_tok_s"]
            v["memory"] = fig["peak_rss_gib"] / rec["peak_rss_gib"]
            if v["speed"] < 1 - tolerance:
                v["flags"].append("slower")
            if v["memory"] > 1 + tolerance:
                v["flags"].append("more memory")
        out.append(v)
    return out


def report(verdicts: List[dict], isa: str, tolerance: float) -> str:
    """The guard's table: now, recorded (date, commit), ratios and flags per case."""
    head = [
        "case",
        "supervised tok/s now",
        "recorded",
        "now / recorded",
        "peak RSS now",
        "recorded",
        "now / recorded",
        f"verdict (tolerance {tolerance:.0%})",
    ]
    rows = []
    for v in verdicts:
        rec = v["recorded"] or {}
        when = f" ({rec.get('date', '-')}, {rec.get('commit', '-')})" if rec else ""
        verdict = ", ".join(v["flags"]) if v["flags"] else ("ok" if rec else f"nothing recorded for {isa}")
        rows.append(
            [
                v["case"],
                f"{v['now']['sup_tok_s']:.1f}",
                _fmt(rec.get("sup_tok_s"), ".1f") + when,
                _fmt(v["speed"], ".2f", "x"),
                f"{v['now']['peak_rss_gib']:.2f} GiB",
                _fmt(rec.get("peak_rss_gib"), ".2f", " GiB"),
                _fmt(v["memory"], ".2f", "x"),
                verdict,
            ]
        )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _fmt(v: Optional[float], spec: str, unit: str = "") -> str:
    return "-" if v is None else format(v, spec) + unit


def record_rows(now: Dict[str, dict], isa: str, date: str, commit: str, load: str, command: str) -> List[str]:
    """This run's rows of the guard's table:

    >>> record_rows({"lora": {"sup_tok_s": 81.04, "peak_rss_gib": 2.456}}, "avx512", "2026-11-27", "abc1234",
    ...             "load average 3.1", "bench.e2e --quick")
    ['| avx512 | lora | 81.0 | 2.46 | 2026-11-27 | abc1234 | load average 3.1 | bench.e2e --quick |']
    """
    return [
        f"| {isa} | {case} | {f['sup_tok_s']:.1f} | {f['peak_rss_gib']:.2f} | {date} | {commit} | {load} | {command} |"
        for case, f in now.items()
    ]


def append_rows(text: str, rows: List[str], where: str = "docs/benchmarks.md") -> str:
    """``text`` with ``rows`` added at the end of the guard's table (so they become the last recorded)."""
    _, end = _block(text, where)
    lines = text.splitlines(keepends=True)
    return "".join(lines[:end] + [r + "\n" for r in rows] + lines[end:])
