"""Printing a plan: the per-device table, the --json document, device-memory sizes like "24GB"."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

from .layout import Suggestion
from .memory import GiB, Estimate

ROWS = (
    ("weights", "weights"),
    ("gradients", "gradients"),
    ("optimizer_states", "optimizer states"),
    ("activations", "activations"),
    ("logits", "logits"),
    ("step_temporaries", "step temporaries"),
    ("framework_overhead", "framework overhead"),
)

_UNITS = {
    "": GiB,
    "b": 1,
    "k": 2**10,
    "kb": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mb": 2**20,
    "mib": 2**20,
    "g": GiB,
    "gb": GiB,
    "gib": GiB,
    "t": 2**40,
    "tb": 2**40,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"24GB"`` -> 24 GiB.  A GPU sold as 24 GB has 24 GiB (nvidia-smi: 24576 MiB), so GB means GiB here;
    a bare number is GiB too.  ValueError for anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"expected a size like 24GB, 80GiB or 40960MB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def describe_run(est: Estimate) -> str:
    inp, f = est.inputs, est.facts
    prec = "fp32" if not inp.amp else f"{inp.precision} {inp.amp_level}"
    extras = [f"{inp.optim}" if inp.do_train else "forward only", f"batch {inp.batch} x {inp.seq}"]
    if inp.recompute:
        extras.append(f"recompute {inp.recompute_granularity}")
    extras.append("flash attention" if inp.flash_attention else "eager attention")
    q = inp.params.quantized_linears
    return (
        f"{inp.shape.model_type} {inp.shape.total_params / 1e9:.2f}B params"
        + (f" ({inp.shape.active_params / 1e9:.2f}B active)" if inp.shape.moe else "")
        + f", {f['method']}"
        f"{' on a quantized base' if q else ''} ({f['trainable_params']:,} trainable), {prec}, " + ", ".join(extras)
    )


def table(est: Estimate) -> str:
    b = est.breakdown
    lines = [
        f"memory plan ({est.inputs.target}): {describe_run(est)}",
        f"layout: {est.layout.describe()}" + (f"; peak on the {est.stage} pipeline stage" if est.layout.pp > 1 else ""),
        "",
        f"  {'':22s}{'per device':>12s}",
    ]
    for key, label in ROWS:
        lines.append(f"  {label:22s}{b[key] / GiB:>8.2f} GiB")
    step = "activations + logits" if b["activations"] + b["logits"] >= b["step_temporaries"] else "step temporaries"
    lines.append(f"  {'total per device':22s}{est.per_device_bytes / GiB:>8.2f} GiB")
    lines.append(f"  (activations + logits and step temporaries never coexist: the total counts the larger, {step})")
    lines.append("")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in est.assumptions]
    return "\n".join(lines)


def suggestion_text(
    est: Estimate, device_memory: int, suggestions: List[Suggestion], config_path: str, overrides: Sequence[str] = ()
) -> str:
    """The fit verdict and, per suggestion, the command that runs it: the user's config path and own
    ``--key value`` overrides, with only the layout keys the suggestion changes replaced or added."""
    fits = est.per_device_bytes <= device_memory
    lines = [
        f"device memory {device_memory / GiB:.2f} GiB: this config ({est.layout.describe()}) needs "
        f"{est.per_device_bytes / GiB:.2f} GiB per device -- {'fits' if fits else 'does not fit'}"
    ]
    if not suggestions:
        lines.append(
            "no layout up to 1024 devices fits: lower per_device_train_batch_size or max_length, turn on "
            "recompute, or use LoRA / a quantized base"
        )
        return "\n".join(lines)
    current = est.layout.config_keys()
    for i, sg in enumerate(suggestions):
        lay, e = sg.estimate.layout, sg.estimate
        head = "smallest layout that fits" if i == 0 else "smallest layout paddlenlp_ext runs today"
        lines.append(
            f"{head}: {lay.describe()}, {e.per_device_bytes / GiB:.2f} GiB per device"
            + ("" if sg.supported else f" ({sg.why_not})")
        )
        changes = {k: v for k, v in lay.config_keys().items() if v != current[k]}  # only the keys that change
        keys = " ".join(shell_word(w) for w in with_overrides(overrides, changes))
        if lay.devices == 1:
            launch = "python"
        else:
            nodes = -(-lay.devices // 8)
            launch = f"python -m paddle.distributed.launch --nproc_per_node {min(lay.devices, 8)}" + (
                f" --ips HOST1,...,HOST{nodes}" if nodes > 1 else ""
            )
        lines.append(f"  {launch} llm/run_finetune.py {config_path} {keys}".rstrip())
    return "\n".join(lines)


def with_overrides(overrides: Sequence[str], changes: Dict[str, object]) -> List[str]:
    """The user's own ``--key value`` overrides with ``changes`` applied: a changed key's value is
    replaced where the user gave it (``--key=value`` too), the other changed keys follow at the end.

    ``with_overrides(["--model_name_or_path", "m", "--sharding", "stage1"], {"sharding": "stage3",
    "sharding_parallel_degree": 2})`` -> ``["--model_name_or_path", "m", "--sharding", "stage3",
    "--sharding_parallel_degree", "2"]``.
    """
    out, done, i = [], set(), 0
    while i < len(overrides):
        word = overrides[i]
        key = word[2:].split("=", 1)[0] if word.startswith("--") else None
        has_value = (
            key is not None and "=" not in word and i + 1 < len(overrides) and not overrides[i + 1].startswith("--")
        )
        if key in changes:
            out += [f"--{key}", str(changes[key])]
            done.add(key)
        else:
            out += overrides[i : i + 1 + has_value]
        i += 1 + has_value
    for k, v in changes.items():
        if k not in done:
            out += [f"--{k}", str(v)]
    return out


def shell_word(word: str) -> str:
    """A word as typed on a shell command line: ``""`` for the empty value, quotes only where needed."""
    import shlex

    return '""' if word == "" else shlex.quote(word)


def to_json(
    est: Estimate,
    device_memory: Optional[int] = None,
    suggestions: Optional[List[Suggestion]] = None,
    notes: Optional[List[str]] = None,
) -> Dict[str, object]:
    doc = est.to_dict()
    doc["assumptions"] = list(doc["assumptions"]) + list(notes or [])
    if device_memory is not None:
        doc["device_memory_bytes"] = device_memory
        doc["fits"] = est.per_device_bytes <= device_memory
        doc["suggestions"] = [
            {
                "layout": sg.estimate.layout.config_keys(),
                "devices": sg.estimate.layout.devices,
                "describe": sg.estimate.layout.describe(),
                "per_device_bytes": sg.estimate.per_device_bytes,
                "breakdown": dict(sg.estimate.breakdown),
                "supported_by_paddlenlp_ext": sg.supported,
                **({"why_not": sg.why_not} if sg.why_not else {}),
            }
            for sg in (suggestions or [])
        ]
    return doc
