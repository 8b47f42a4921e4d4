"""What ``bench/e2e.py`` prints after its runs: a table per case (each toolkit, then ours / each other
toolkit), the packed / unpacked and qlora / lora ratios, and how the GFLOP/s column is counted.
"""

from __future__ import annotations

from bench import harness as h

fmt, mean = h.fmt, h.mean


def table(runs, case) -> list:
    rows = [r for r in runs if r["case"] == case]
    names = list(dict.fromkeys(r["toolkit"] for r in rows))
    key = "pairs_s" if case == "dpo" else "sup_tok_s"
    head = [
        "toolkit",
        "runs",
        "pairs/s" if case == "dpo" else "supervised tok/s",
        "GFLOP/s (of peak)",
        "step time",
        "peak RSS",
        "CPU% in steps",
        "padding",
        "final loss",
    ]
    body = []
    for name in names:
        rs = [r for r in rows if r["toolkit"] == name]
        pad, of_peak = mean(rs, "padding"), mean(rs, "of_peak")
        body.append(
            [
                f"{name} ({rs[0]['detail']})",
                len(rs),
                f"{mean(rs, key):.2f} ({', '.join(format(r[key], '.2f') for r in rs)})",
                fmt(mean(rs, "gflops"), ".1f") + ("" if of_peak is None else f" ({of_peak:.0%})"),
                f"{mean(rs, 'step_s'):.2f} s",
                f"{mean(rs, 'peak_rss_gib'):.2f} GiB",
                f"{fmt(mean(rs, 'cpu_pct'), '.0f')}%",
                "-" if pad is None else format(pad, ".1%"),
                f"{mean(rs, 'final_loss'):.4f}",
            ]
        )
    ours = {k: mean([r for r in rows if r["toolkit"].startswith("ours")], k) for k in (key, "step_s", "peak_rss_gib")}
    for name in names:
        other = [r for r in rows if r["toolkit"] == name]
        if ours[key] is not None and not name.startswith("ours"):
            base = {k: mean(other, k) for k in ours}
            cells = h.ratio_cells(ours, base, list(ours))
            body.append([f"ours / {name}", "", cells[0], "", *cells[1:], "", "", ""])
    return [f"### {case}", "", h.table(head, body)]


def ratios_across(runs) -> list:
    """packed / unpacked and qlora / lora supervised tok/s per toolkit, where both ran."""
    out = []
    for num, den in (("packed", "lora"), ("qlora", "lora"), ("packed_b4", "lora_b4")):
        for name in dict.fromkeys(r["toolkit"] for r in runs):
            a = [r for r in runs if r["toolkit"] == name and r["case"] == num]
            b = [r for r in runs if r["toolkit"] == name and r["case"] == den]
            if a and b:
                out.append(
                    f"{num} / {den}, {name}: {mean(a, 'sup_tok_s') / mean(b, 'sup_tok_s'):.2f}x supervised "
                    f"tok/s, {mean(a, 'peak_rss_gib') / mean(b, 'peak_rss_gib'):.2f}x peak RSS"
                )
    return out


def limit_lines(limit: dict, runs: list) -> str:
    """How the FLOP/s column is counted, and ours' measured supervised fraction against the data's."""
    stats = limit["stats"]
    if not stats:
        return "GFLOP/s: not counted (no SentencePiece model in the model directory)"
    ours = [r["supervised_fraction"] for r in runs if r.get("supervised_fraction")]
    per = next(iter(limit["per_sup_token"].values()))
    return (
        f"GFLOP/s: {per / 1e9:.3f} GFLOP per supervised token (bench/flops.py: matmuls only, mean causal "
        f"context {stats['context']:.0f} tokens, supervised fraction {stats['supervised_fraction']:.3f} of the "
        f"data"
        + (f", ours measured {sum(ours) / len(ours):.3f}" if ours else "")
        + "); peak: "
        + (
            f"{limit['peak']['peak_gflops']:.1f} GFLOP/s fp32 matmul (bench/peak.py, {limit['peak']['date']})"
            if limit["peak"]
            else "not measured"
        )
    )
