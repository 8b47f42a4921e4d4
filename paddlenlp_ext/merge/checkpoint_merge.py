"""The merge from inputs to published output: ``merge_adapter_checkpoint``.

Owns: the order of the steps (check inputs -> plan -> stream every tensor of the
base through ``add_delta_inplace`` or a verbatim copy into a temporary directory
-> copy config/tokenizer -> ``merge_info.json`` -> verify -> publish), the
bookkeeping that every adapter module is merged exactly once, and ``MergeResult``.
The steps themselves live in the sibling modules.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .cli import EXIT_OK, EXIT_VERIFY_FAILED, check_paths, resolve_device, resolve_tolerance
from .common import MERGE_INFO_NAME, Log, MergeError, fmt_bytes, parse_size
from .delta import MERGE_THREADS, add_delta_inplace, merge_dtype, single_threaded_blas
from .formats import AdapterBundle, check_adapter_against_base, check_model_type
from .reader import BufferPool, Checkpoint, TensorEntry, TensorSource
from .verify import run_verification, verify_merge, write_failure_marker
from .writer import (
    SafetensorsStreamWriter,
    copy_aux_files,
    make_temp_dir,
    plan_shards,
    publish,
    save_pdparams,
    shard_file_names,
    to_paddle,
    write_index,
    write_json,
)


@dataclass
class MergeResult:
    output_dir: str
    weight_files: List[str]
    modules_merged: List[str]
    checkpoint_bytes: int
    merge_seconds: float
    dtype: str
    tolerance: float
    verify: Optional[Dict[str, Any]] = None
    warnings: List[str] = field(default_factory=list)

    @property
    def verify_failed(self) -> bool:
        return bool(self.verify) and self.verify.get("status") == "failed"

    @property
    def exit_code(self) -> int:
        return EXIT_VERIFY_FAILED if self.verify_failed else EXIT_OK


def merge_adapter_checkpoint(
    model_name_or_path: str,
    lora_path: str,
    output_path: str,
    *,
    safe_serialization: bool = True,
    max_shard_size="1GB",
    overwrite: bool = False,
    verify: bool = True,
    tolerance: Optional[float] = None,
    device: Optional[str] = None,
    num_probes: int = 2,
    probe_length: int = 32,
    log: Log = print,
) -> MergeResult:
    """Merge the adapter in ``lora_path`` into the checkpoint in ``model_name_or_path``
    and write a complete model to ``output_path`` (see the package docstring).

    The output is assembled in a temporary directory next to ``output_path`` and
    renamed into place at the end; on any error the temporary directory is removed
    and nothing is left at ``output_path``.  With ``verify`` the merged model is
    compared with base + adapter on random probes; a failure keeps the output but
    writes ``MERGE_VERIFY_FAILED`` into it (``result.exit_code`` is then 3).
    Input problems raise :class:`MergeError`.
    """
    t0 = time.time()
    base_dir, adapter_dir, out_dir = model_name_or_path, lora_path, output_path
    check_paths(base_dir, adapter_dir, out_dir, overwrite)
    max_bytes = parse_size(max_shard_size)
    dev = resolve_device(device) if verify else (device or "cpu")

    bundle = AdapterBundle.open(adapter_dir)
    cfg = bundle.config
    base_cfg = check_model_type(base_dir, adapter_dir, cfg, log)
    ckpt = Checkpoint.open(base_dir)
    targets = check_adapter_against_base(bundle, ckpt)
    dtype = merge_dtype(targets)
    tol = resolve_tolerance(tolerance, dtype)
    notes: List[str] = []

    desc = (
        cfg.layer_type
        + ("+rslora" if cfg.rslora else "")
        + (f"+lora_plus_scale={cfg.lora_plus_scale:g}" if cfg.method == "lora" and cfg.lora_plus_scale != 1.0 else "")
    )
    log(
        f"[merge] base {base_dir}: {ckpt.fmt}, {len(ckpt.files)} file(s), {len(ckpt.entries)} tensors, "
        f"{fmt_bytes(ckpt.total_bytes)}; adapter {adapter_dir}: {desc}, r={cfg.r}, "
        f"scaling={cfg.scaling:g}, {len(targets)} modules"
    )
    if cfg.quantization:
        msg = (
            f"adapter was trained on a {cfg.quantization.get('weight_quantize_algo')}-quantized base (QLoRA); "
            "merging into the FULL-PRECISION base weights (the quantization error of the base is not baked in)"
        )
        log(f"[merge] note: {msg}")
        notes.append(msg)
    if cfg.pissa:
        log("[merge] PiSSA: merged = W_orig + s*(A@B - A0@B0), against the original base weights")

    tmp = make_temp_dir(out_dir)
    try:
        weight_files, merged = stream_merge(ckpt, bundle, targets, tmp, safe_serialization, max_bytes, log)
        copy_aux_files(base_dir, adapter_dir, tmp)
        merge_seconds = time.time() - t0
        info = {
            "base_model": os.path.abspath(base_dir),
            "adapter": os.path.abspath(adapter_dir),
            "adapter_config": cfg.to_dict(),
            "merged_into": "full-precision base" if cfg.quantization else "base",
            "modules_merged": len(merged),
            "dtype": dtype,
            "weight_files": weight_files,
            "checkpoint_bytes": ckpt.total_bytes,
            "merge_seconds": round(merge_seconds, 3),
        }
        write_json(os.path.join(tmp, MERGE_INFO_NAME), info)
        result = MergeResult(out_dir, weight_files, merged, ckpt.total_bytes, merge_seconds, dtype, tol, warnings=notes)
        if verify:
            result.verify = run_verification(
                lambda: verify_merge(
                    base_dir,
                    adapter_dir,
                    tmp,
                    cfg,
                    ckpt,
                    tol,
                    dev,
                    base_cfg,
                    num_probes=num_probes,
                    probe_length=probe_length,
                    log=log,
                ),
                tol,
                log,
            )
            info["verify"] = result.verify
            write_json(os.path.join(tmp, MERGE_INFO_NAME), info)
            if result.verify_failed:
                write_failure_marker(tmp, result.verify)
        publish(tmp, out_dir)
    except BaseException:  # Ctrl-C included: never leave a half-written temp dir behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def stream_merge(
    ckpt: Checkpoint,
    bundle: AdapterBundle,
    targets: Dict[str, TensorEntry],
    out_dir: str,
    safe: bool,
    max_bytes: int,
    log: Log,
) -> Tuple[List[str], List[str]]:
    """Write every tensor of ``ckpt`` into ``out_dir`` (adapted weights + delta, the rest
    verbatim) in PaddleNLP's shard layout; returns (file names written, modules merged)."""
    # looked up at call time, so the adapters module (and a test's stand-in) provides the formula
    from ..adapters.api import compute_delta

    cfg = bundle.config
    module_of = {ent.name: mod for mod, ent in targets.items()}
    consumed: Dict[str, int] = {mod: 0 for mod in targets}
    shards = plan_shards(ckpt.entries, max_bytes)
    names = shard_file_names(len(shards), safe)
    src = TensorSource(ckpt)
    pool = BufferPool(max_buffers=3)  # one being merged + one queued + one being written
    weight_map: Dict[str, str] = {}
    executor = ThreadPoolExecutor(max_workers=MERGE_THREADS, thread_name_prefix="merge") if MERGE_THREADS > 1 else None
    blas_limit = single_threaded_blas()
    try:
        for shard, fname in zip(shards, names):
            ts = time.time()
            path = os.path.join(out_dir, fname)
            writer = SafetensorsStreamWriter(path, shard, queue_size=1) if safe else None
            pd_state: Dict[str, Any] = {}
            n_merged = 0
            try:
                for ent in writer.order if writer else shard:
                    weight_map[ent.name] = fname
                    mod = module_of.get(ent.name)
                    if mod is None and writer is not None and ckpt.fmt == "safetensors" and not ent.transpose:
                        writer.copy(ent)  # untouched tensor: byte copy in the kernel
                        src.skip(ent)
                        continue
                    arr, buf = src.read(ent, pool if writer is not None else None)
                    if mod is not None:
                        if consumed[mod]:
                            raise MergeError(f"adapter module {mod!r} was merged twice")
                        add_delta_inplace(
                            arr, ent.dtype, cfg, bundle.modules[mod], compute_delta, executor, MERGE_THREADS
                        )
                        consumed[mod] += 1
                        n_merged += 1
                    if writer is not None:
                        writer.write(ent.name, arr, buf, pool.release if buf is not None else None)
                    else:
                        pd_state[ent.name] = to_paddle(arr)
                    del arr, buf
            except BaseException:
                if writer:
                    writer.abort()
                raise
            if writer:
                writer.close()
            else:
                save_pdparams(pd_state, path)
                pd_state.clear()
            log(
                f"[merge] wrote {fname}: {len(shard)} tensors ({n_merged} merged), "
                f"{fmt_bytes(sum(e.nbytes for e in shard))} in {time.time() - ts:.1f}s"
            )
    finally:
        src.close()
        if executor is not None:
            executor.shutdown(wait=True)
        blas_limit.__exit__(None, None, None)
    leftovers = sorted(m for m, c in consumed.items() if c != 1)
    unused = sorted(set(bundle.modules) - set(consumed))
    if leftovers or unused:
        raise MergeError(f"adapter modules not merged exactly once: {leftovers + unused}")
    if len(names) > 1:
        names = names + [write_index(out_dir, safe, ckpt.entries, weight_map)]
    return names, sorted(targets)
