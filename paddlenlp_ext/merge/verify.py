"""Verification of a written merge: merged model logits vs base + adapter logits.

Owns: the default tolerances, the RAM estimate that decides whether a
verification pass can run (``estimate_verify_bytes``), the random probes, the
comparison itself (``verify_merge``) and how a failed or crashed verification
is recorded (``run_verification``, ``write_failure_marker``).  This is the only
module of the package that builds paddlenlp models.
"""

from __future__ import annotations

import gc
import json
import os
import time
import warnings
from typing import Any, Callable, Dict, Mapping

import numpy as np

from ..adapters.config import AdapterConfig
from .common import VERIFY_FAILED_MARKER, Log, MergeError, fmt_bytes
from .reader import Checkpoint

#: default --tolerance by the dtype of the merged weights (relative logit error,
#: see ``verify_merge``): fp32 is exact up to fp32 summation order; bf16/fp16
#: round the merged weight once, which moves logits by ~1e-3..1e-2.
DEFAULT_TOLERANCE = {"float64": 1e-4, "float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


def estimate_verify_bytes(ckpt: Checkpoint) -> int:
    """Host memory a verification pass needs: one fp32 model while from_pretrained also
    holds its state dict (~2x), plus slack."""
    params = sum(e.numel for e in ckpt.entries)
    return int(params * 4 * 2.5) + 512 * 2**20


def _quiet_paddlenlp() -> Callable[[], None]:
    """Raise PaddleNLP's log level to WARNING (from_pretrained logs every load); returns the undo."""
    try:
        from paddlenlp.utils.log import logger as pnlp_logger

        old = pnlp_logger.logger.level
        pnlp_logger.set_level("WARNING")
    # a PaddleNLP without this logger module / Logger API: keep its messages, they are harmless
    except (ImportError, AttributeError):  # pragma: no cover - paddlenlp 3.0.0b4 has both
        return lambda: None
    return lambda: pnlp_logger.logger.setLevel(old)


def _logits(model, probes: np.ndarray) -> np.ndarray:
    """[num, length] token ids -> [num, length, vocab] float32 logits."""
    import paddle

    model.eval()
    with paddle.no_grad():
        out = model(input_ids=paddle.to_tensor(probes))
    logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
    return logits.astype("float32").numpy()


def probe_inputs(vocab_size: int, num: int, length: int, seed: int = 0) -> np.ndarray:
    """Random token ids [num, length] (fixed seed), avoiding the first few ids (pad/bos/eos)."""
    rng = np.random.default_rng(seed)
    low = 3 if vocab_size > 8 else 0
    return rng.integers(low, vocab_size, size=(num, length)).astype("int64")


def verify_merge(
    base_dir: str,
    adapter_dir: str,
    merged_dir: str,
    cfg: AdapterConfig,
    ckpt: Checkpoint,
    tolerance: float,
    device: str,
    base_cfg: Mapping[str, Any],
    num_probes: int = 2,
    probe_length: int = 32,
    log: Log = print,
) -> Dict[str, Any]:
    """Run base + adapter and the merged model (both loaded in float32) on random probes.

    ``error = max|logits_merged - logits_ref| / max(1, max|logits_ref|)`` must be
    <= ``tolerance``.  For QLoRA adapters the reference is the full-precision base +
    adapter (what the merge represents); the gap to the quantized base + adapter
    (the model as trained) is reported but never fails.  Returns a dict with
    ``status`` "passed" / "failed" / "skipped"."""
    import psutil

    need = estimate_verify_bytes(ckpt)
    avail = int(psutil.virtual_memory().available)
    if need > avail:
        log(
            f"[verify] skipped: needs ~{fmt_bytes(need)} of RAM to load the model in float32, only "
            f"{fmt_bytes(avail)} available (the merge itself is complete; --no-verify silences this)"
        )
        return {"status": "skipped", "reason": "not enough memory", "needed_bytes": need, "available_bytes": avail}

    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM

    from ..adapters import load_adapter
    from ..models.registration import register_decoder, register_qwen3

    register_qwen3()  # our model families (Qwen3) known to AutoModelForCausalLM
    register_decoder()  # ... and our decoder's rows (models/family_table.py, Family.decoder)
    paddle.set_device(device)
    restore = _quiet_paddlenlp()
    vocab = int(base_cfg.get("vocab_size") or 0)
    if vocab <= 0:
        raise MergeError("verify: config.json has no vocab_size")
    probes = probe_inputs(vocab, num_probes, probe_length)  # [num_probes, probe_length]
    t0 = time.time()

    def load(path, quant=None):
        if path == base_dir and ckpt.hf_layout:
            # a transformers-layout base: PaddleNLP's from_pretrained reads only its own layout; the streaming
            # loader converts, and equals from_pretrained + quantize_model (tests/test_loading.py)
            from ..models.loading import load_model_streaming
            from ..models.model_config import load_model_config

            return load_model_streaming(
                path, load_model_config(path, dtype="float32"), "float32", quantization=quant, max_seq_len=probe_length
            )[0]
        from ..models.loading import decoder_class_for
        from ..models.model_config import load_model_config

        # a row of our decoder whose model_type PaddleNLP also has (mistral, gemma, mixtral, ...): PaddleNLP's Auto
        # classes would build PaddleNLP's class, so the decoder's is named
        cls, config = decoder_class_for(load_model_config(path, dtype="float32"))
        model = (cls or AutoModelForCausalLM).from_pretrained(path, config=config, dtype="float32")
        if quant:
            from ..models.quantize import quantize_model

            quantize_model(
                model,
                quant["weight_quantize_algo"],
                block_size=quant.get("weight_blocksize", 64),
                double_quant=bool(quant.get("weight_double_quant", False)),
                double_quant_block_size=quant.get("weight_double_quant_block_size", 256),
            )
        return model

    # logits below: [num_probes, probe_length, vocab] float32; one model in memory at a time
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = load(base_dir)
            base_only = _logits(model, probes)
            load_adapter(model, adapter_dir)  # the same base model, now with the adapter
            ref = _logits(model, probes)
            del model
            quant_logits = None
            if cfg.quantization:
                model = load(base_dir, quant=cfg.quantization)
                load_adapter(model, adapter_dir)
                quant_logits = _logits(model, probes)
                del model
            gc.collect()
            model = load(merged_dir)
            got = _logits(model, probes)
            del model
            gc.collect()
    finally:
        restore()
    scale = max(1.0, float(np.abs(ref).max()))
    diff = float(np.abs(got - ref).max())
    err = diff / scale
    effect = float(np.abs(ref - base_only).max())
    res: Dict[str, Any] = {
        "status": "passed" if err <= tolerance and np.isfinite(err) else "failed",
        "max_abs_logit_diff": diff,
        "relative_error": err,
        "logit_scale": scale,
        "tolerance": tolerance,
        "adapter_effect": effect,
        "reference": "full-precision base + adapter" if cfg.quantization else "base + adapter",
        "probes": [int(num_probes), int(probe_length)],
        "device": device,
        "seconds": round(time.time() - t0, 2),
    }
    log(
        f"[verify] {res['status'].upper()}: max |logit diff| merged vs {res['reference']} = {diff:.3e} "
        f"(relative {err:.3e}, tolerance {tolerance:g}) on {num_probes}x{probe_length} random tokens; "
        f"for scale, the adapter itself moves the logits by up to {effect:.3e}"
    )
    if effect > 0 and diff >= 0.5 * effect:
        msg = (
            "the merge error is not small against the adapter's own effect on the logits; "
            "a lower --tolerance would make this check meaningful"
        )
        res["note"] = msg
        log(f"[verify] warning: {msg}")
    if quant_logits is not None:
        qdiff = float(np.abs(got - quant_logits).max())
        res["quantized_base_gap"] = {"max_abs_logit_diff": qdiff, "relative": qdiff / scale}
        log(
            f"[verify] info: merged (full precision) vs {cfg.quantization.get('weight_quantize_algo')}-quantized "
            f"base + adapter (the model as trained): max |logit diff| = {qdiff:.3e} (relative {qdiff / scale:.3e}); "
            "this is the base's quantization error, not a merge error"
        )
    if res["status"] == "failed":
        log(
            f"[verify] the merged model does not reproduce base + adapter; the output is kept but marked with "
            f"{VERIFY_FAILED_MARKER}"
        )
    return res


def run_verification(check: Callable[[], Dict[str, Any]], tolerance: float, log: Log) -> Dict[str, Any]:
    """``check()`` (a bound ``verify_merge`` call), with a crash recorded as a failure.

    The merge is complete when this runs, so a verification that cannot run (PaddleNLP
    cannot build the architecture, the device fails, a load or forward pass raises)
    must not delete it: the output is kept and marked instead, and the exception's
    type and message go into the report (merge_info.json, MERGE_VERIFY_FAILED, exit
    code 3).  That has to hold whatever PaddleNLP or Paddle raise, hence ``Exception``;
    KeyboardInterrupt / SystemExit are not Exceptions, so they still abort the merge."""
    try:
        return check()
    except Exception as e:
        log(f"[verify] FAILED to run: {type(e).__name__}: {e}")
        return {"status": "failed", "error": f"{type(e).__name__}: {e}", "tolerance": tolerance}


def write_failure_marker(out_dir: str, report: Mapping[str, Any]) -> None:
    """The MERGE_VERIFY_FAILED file that marks a kept but untrustworthy output."""
    with open(os.path.join(out_dir, VERIFY_FAILED_MARKER), "w", encoding="utf-8") as f:
        f.write("The merged weights did NOT reproduce base + adapter within tolerance.\n")
        f.write(json.dumps(report, indent=2) + "\n")
