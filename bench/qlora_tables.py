"""The markdown tables of ``bench/qlora.py`` (harness.table), from the results of its workers."""

from __future__ import annotations

from bench import harness as h
from bench.qlora_worker import CONFIGS

TARGETS = {"nf4 + double quant": 0.54, "weight_only_int4": 0.55, "weight_only_int8": 1.05}

MiB = 2**20


def table_part0(quant_rows, step_rows, base, shape, tokens):
    quant = h.table(
        ["format", "M params/s (CPU time)", "M params/s (wall)"],
        [[n, f"{c:.0f}", f"{w:.0f}"] for n, c, w in quant_rows],
    )
    step = h.table(
        ["format", "fwd+bwd ms (wall)", "ms (CPU)", "ratio wall", "ratio CPU", "one dequant ms (wall)"],
        [[n, f"{w:.1f}", f"{c:.1f}", f"{rw:.2f}", f"{rc:.2f}", f"{d:.1f}"] for n, w, c, rw, rc, d in step_rows],
    )
    return "\n".join(
        [
            f"Quantize one `[{shape[0]}, {shape[1]}]` fp32 weight (`quantize(w, algo, 64, dq)`, best of the repeats):",
            "",
            quant,
            "",
            f"x `[{tokens}, {shape[0]}]` through the layer, forward + backward "
            f"(gradient to x), against `paddle.matmul` on the fp32 weight: {base[0]:.1f} ms wall, "
            f"{base[1]:.1f} ms CPU:",
            "",
            step,
        ]
    )


def mib(v):
    return "—" if v is None else f"{v / MiB:.0f}"


def rows_table(header, rows, cells, first=(), key="config"):
    """``harness.table`` of ``first`` (fixed rows) and ``cells(r)`` per row; a failed run's row says FAILED."""
    body = [list(f) for f in first]
    body += [[r[key], "FAILED"] + [""] * (len(header) - 2) if r.get("failed") else cells(r) for r in rows]
    return h.table(header, body)


def table_bytes(rows, block_size):
    ref = next((r for r in rows if not r.get("failed")), None)
    n = ref["linear_params"] if ref else 0
    checks = []
    for r in rows:
        tgt = TARGETS.get(r["config"])
        if tgt is not None and r.get("failed"):
            checks.append(f"FAIL {r['config']}: run failed")
        elif tgt is not None:
            checks.append(
                f"{h.verdict(r['bytes_per_param'], tgt)} {r['config']}: {r['bytes_per_param']:.4f} "
                f"bytes/param <= {tgt} (bf16 2, fp32 4)"
            )

    def cells(r):
        bpp, tgt = r["bytes_per_param"], TARGETS.get(r["config"])
        label = r["config"] + (f" (block {block_size})" if CONFIGS[r["config"]][0] in ("nf4", "fp4") else "")
        return [
            label,
            f"{r['linear_params']:,}",
            f"{r['linear_bytes'] / MiB:.1f} MiB",
            f"{bpp:.4f}",
            f"{bpp / 2:.3f}x",
            f"{bpp / 4:.3f}x",
            "" if tgt is None else f"<= {tgt}",
            "" if tgt is None else h.verdict(bpp, tgt),
        ]

    header = [
        "config",
        "base linear params",
        "base linear bytes",
        "bytes / param",
        "vs bf16",
        "vs fp32",
        "target",
        "check",
    ]
    first = [["bf16 (theoretical, not run)", f"{n:,}", f"{2 * n / MiB:.1f} MiB", "2.0000", "1.00x", "0.50x", "", ""]]
    return rows_table(header, rows, cells, first), checks


def table_train(rows):
    def cells(r):
        dq = "0" if r.get("dequant_ms") is None else f"{r['dequant_ms']:.0f}"
        how = "" if r.get("peak_train_how") == "VmHWM reset" else f" ({r.get('peak_train_how')})"
        return [
            r["config"],
            mib(r["rss_imports"]),
            mib(r["rss_after_build"]),
            mib(r["peak_build"]),
            mib(r.get("rss_before_train")),
            mib(r.get("peak_train")) + how,
            mib(r.get("rss_steady")),
            f"{r['step_ms']:.0f}",
            ", ".join(f"{t:.0f}" for t in r["step_ms_all"]),
            f"{r['step_cpu_ms']:.0f}",
            dq,
            f"{r['load_before']:.1f} / {r['load_after']:.1f}",
        ]

    header = [
        "config",
        "after imports (MiB)",
        "after build + quant + gc (MiB)",
        "build peak (MiB)",
        "before steps (MiB)",
        "train peak (MiB)",
        "steady (MiB)",
        "step time, median (ms)",
        "timed steps (ms)",
        "CPU time / step (ms)",
        "of which dequant (ms)",
        "load avg before / after",
    ]
    first = [["bf16 (theoretical)"] + ["—"] * 6 + ["— (no bf16 matmul on CPU)", "", "", "", ""]]
    return rows_table(header, rows, cells, first)


def table_summary(rows):
    def cells(r):
        tgt = TARGETS.get(r["config"])
        chk = "" if tgt is None else f"<= {tgt} {h.verdict(r['bytes_per_param'], tgt)}"
        return [
            r["config"],
            f"{r['bytes_per_param']:.4f}",
            chk,
            mib(r["rss_after_build"]),
            mib(r.get("peak_train")),
            f"{r['step_ms']:.0f}",
            f"{r['step_cpu_ms']:.0f}",
        ]

    header = [
        "config",
        "bytes / param (base linears)",
        "target",
        "RSS after build (MiB)",
        "train peak RSS (MiB)",
        "step time (ms)",
        "CPU time / step (ms)",
    ]
    return rows_table(header, rows, cells, [["bf16 (theoretical)", "2.0000", "", "—", "—", "—", "—"]])


def table_naive(rows, lazy_by_name):
    def cells(r):
        lz = lazy_by_name.get(r["config"], {})
        sizes = (r["rss_fp32_model"], r["rss_after_build"], r["peak_build"], lz.get("peak_build"))
        return [r["config"], *map(mib, sizes)]

    header = [
        "config",
        "fp32 model built (MiB)",
        "after quantize_model + gc (MiB)",
        "process peak (MiB)",
        "layer-by-layer build peak (MiB)",
    ]
    return rows_table(header, rows, cells)


def table_eval(train, rows):
    base = next((r for r in rows if r["name"] == "unquantized" and not r.get("failed")), None)
    ref = base["eval_loss"] if base else train["eval_loss"]

    def cells(r):
        d = r["eval_loss"] - ref
        bpp = "4 (fp32)" if r["bpp"] is None else f"{r['bpp']:.4f}"
        return [
            r["name"],
            r["layers"] or 0,
            bpp,
            f"{r['eval_loss']:.4f}",
            f"{(r['ppl'] or float('nan')):.4f}",
            f"{d:+.4f}",
            f"{100 * d / ref:+.1f}%",
        ]

    header = [
        "base weights",
        "linears quantized",
        "bytes / param (quantized linears)",
        "eval loss",
        "perplexity",
        "change vs unquantized",
        "relative change of the loss",
    ]
    return rows_table(header, rows, cells, key="name")
