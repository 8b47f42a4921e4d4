"""``--device cpu``: run a GPU config (PaddleNLP's bf16-O2, tensor-parallel defaults) on this CPU (no paddle).

PaddleNLP's shipped configs assume GPUs: ``bf16`` with ``fp16_opt_level O2`` (bf16
weights, no CPU kernels) and ``tensor_parallel_degree: 4`` etc.  Given ``--device cpu``
on the command line, the config layer makes the few changes such a run needs on a
CPU and prints each one as a derived setting, instead of refusing them one by one:

* ``bf16`` / ``fp16`` with ``fp16_opt_level O2`` -> fp32 (``bf16 false``, ``fp16 false``);
  ``fp16`` alone -> false (Paddle's CPU build has no fp16 kernels); bf16 O1 (autocast) is kept;
* parallel degrees whose product exceeds the processes of this launch -> 1
  (tensor, pipeline, sep, context): one process trains the whole model.

A file that itself says ``device: cpu`` next to GPU-only settings contradicts itself and is
refused (environment.py names the keys); so is a GPU config without ``--device cpu``.
"""

from typing import Dict

from .environment import PARALLEL_KEYS, world_size


def cpu_changes(training: Dict[str, object], processes: int) -> Dict[str, object]:
    """The ``{key: new value}`` changes ``device: cpu`` makes to the training keys.

    >>> cpu_changes({"bf16": True, "fp16_opt_level": "O2", "tensor_parallel_degree": 4}, processes=1)
    {'bf16': False, 'tensor_parallel_degree': 1}
    >>> cpu_changes({"bf16": True, "fp16_opt_level": "O1", "tensor_parallel_degree": 2}, processes=2)
    {}
    """
    out: Dict[str, object] = {}
    o2 = training.get("fp16_opt_level", "O1") == "O2"
    if training.get("bf16") and o2:
        out["bf16"] = False
    if training.get("fp16"):
        out["fp16"] = False
    degrees = {k: int(training.get(k, 1) or 1) for k in PARALLEL_KEYS}
    product = 1
    for v in degrees.values():
        product *= max(v, 1)
    if product > processes:
        out.update({k: 1 for k, v in degrees.items() if v > 1})
    return out


def apply_cpu_device(cfg) -> None:
    """Apply :func:`cpu_changes` to ``cfg`` (a RunConfig; called when ``--device`` came from the command
    line) if it is cpu; each change is a derived setting (printed at the start of the run)."""
    t = cfg.training
    if t.get("device") != "cpu":
        return
    n = world_size()
    for key, value in cpu_changes(t, n).items():
        cfg.derived[key] = f"{value} (device=cpu, {n} process{'es' if n > 1 else ''}; was {t.get(key)!r})"
        t[key] = value
