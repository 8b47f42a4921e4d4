"""Command-line glue of the merge: exit codes and checks of flag values.

Owns: the exit codes of ``llm/merge_lora_params.py``, ``check_paths`` (the
input / output directory rules: no overwrite without ``--overwrite``, never the
input directory itself), ``resolve_device`` (``--device``) and
``resolve_tolerance`` (``--tolerance`` and its per-dtype default).  Messages name
the flags because they are what the user typed; ``merge_adapter_checkpoint``
applies the same checks when called from Python.
"""

from __future__ import annotations

import os
from typing import Optional

from .common import MergeError
from .verify import DEFAULT_TOLERANCE

EXIT_OK = 0
EXIT_ERROR = 2  # bad input, as every script (docs/reliability.md)
EXIT_VERIFY_FAILED = 3


def _dir_nonempty(p: str) -> bool:
    return os.path.isdir(p) and bool(os.listdir(p))


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def check_paths(base_dir: str, adapter_dir: str, out_dir: str, overwrite: bool) -> None:
    """Raise MergeError unless the base is a directory and ``out_dir`` may be written."""
    if not os.path.isdir(base_dir):
        raise MergeError(
            f"--model_name_or_path {base_dir}: no such directory (this tool reads a local checkpoint; "
            "download the model first)"
        )
    for what, p in (("--model_name_or_path", base_dir), ("--lora_path", adapter_dir)):
        if os.path.exists(out_dir) and _same_path(p, out_dir):
            raise MergeError(f"the output path {out_dir} is the same directory as {what}; choose another one")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise MergeError(f"output path {out_dir} exists and is not a directory")
    if _dir_nonempty(out_dir) and not overwrite:
        raise MergeError(f"output directory {out_dir} exists and is not empty; pass --overwrite to replace it")


def resolve_device(device: Optional[str]) -> str:
    """'gpu' when Paddle sees a CUDA device, else 'cpu'; an explicit 'gpu' without one is an error."""
    if device not in (None, "", "cpu", "gpu") and not str(device).startswith("gpu:"):
        raise MergeError(f"--device must be cpu or gpu, got {device!r}")
    if device == "cpu":
        return "cpu"
    import paddle

    has_gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if device in (None, ""):
        return "gpu" if has_gpu else "cpu"
    if not has_gpu:
        raise MergeError(f"--device {device}: this Paddle build has no usable GPU; use --device cpu")
    return device


def resolve_tolerance(tolerance: Optional[float], dtype: str) -> float:
    """``--tolerance``, or the default for the merged weights' dtype."""
    tol = float(tolerance) if tolerance is not None else DEFAULT_TOLERANCE[dtype]
    if not tol > 0:
        raise MergeError(f"--tolerance must be > 0, got {tolerance}")
    return tol


def report_merge(result, seconds: Optional[float] = None) -> int:
    """Print the one-line summary of a merge (and the verification failure, on stderr); return the exit code."""
    import sys

    from .common import VERIFY_FAILED_MARKER

    status = (result.verify or {}).get("status", "not run")
    took = f" in {seconds:.1f}s" if seconds is not None else ""
    print(
        f"[merge] merged {len(result.modules_merged)} modules into {result.output_dir} "
        f"({len(result.weight_files)} weight file(s), {result.dtype}){took}; verify: {status}"
    )
    if result.verify_failed:
        print(
            f"error: verification FAILED; {os.path.join(result.output_dir, VERIFY_FAILED_MARKER)} marks the "
            "output as untrustworthy",
            file=sys.stderr,
        )
    return result.exit_code
