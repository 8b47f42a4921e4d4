"""Route PaddleNLP Llama / Qwen2 FlashMask attention to the CPU implementation.

PaddleNLP 3.0.0b4 models (``use_flash_attention=True``) send packed rows
through ``paddlenlp.transformers.llama.fusion_ops.fusion_flash_attention``,
which calls ``F.flashmask_attention(q, k, v,
startend_row_indices=attn_mask_startend_row_indices.unsqueeze(-1),
causal=True)`` whenever ``attn_mask_startend_row_indices`` is given.  Qwen2
(and the other models built on ``fusion_ops``) reuse that function.  On a CPU
build Paddle's ``flashmask_attention`` has no kernel and fails.

``install_cpu_flashmask()`` swaps the ``F`` that *fusion_ops* sees (only that
module's global, never ``paddle.nn.functional`` itself) for a thin proxy whose
``flashmask_attention`` dispatches per call: tensors on a GPU/XPU of a build
that has the native op go to Paddle's kernel, everything else to
``paddlenlp_ext.kernels.flashmask_attention``.  All other ``F.*`` lookups
fall through to the real module.  ``cpu_flashmask()`` is the context-manager
form (installs, and on exit restores exactly what it installed).

Input contract of the patched models
------------------------------------
``LlamaForCausalLM/Qwen2ForCausalLM.forward(..., attn_mask_startend_row_indices=...)``
takes an integer (int32) tensor of shape ``[batch, 1, seq]`` (what PaddleNLP's
collators produce) or ``[batch, seq]``: for every key column j of a packed
row, the first query row that must NOT see it (the end of j's example; pad
columns use ``seq``).  fusion_ops appends the bound axis itself, so the stock
code rejects ``[batch, 1, seq, 1]``; the proxy also accepts that (and
``[batch, 1, seq, 2]`` = causal LTS/LTE) by dropping the extra trailing axis
fusion_ops adds.  ``position_ids`` must restart at 0 for every example.

Checked on CPU with these inputs: LlamaModel/Qwen2Model build no dense mask
when ``attn_mask_startend_row_indices`` is given (``attention_mask`` stays
None; ForCausalLM drops a user-provided one), ``is_casual_mask`` and
``scaled_dot_product_attention`` are not reached, k/v keep their kv-head count
(GQA handled by the kernel), and full/core-attention recompute just re-runs
the PyLayer.  Without startend indices the models call
``F.scaled_dot_product_attention(..., attn_mask=mask, is_causal=True)``; its
CPU (math) fallback ignores the mask when ``is_causal`` is set, which would let
packed examples see each other, so the proxy also routes that call through
``sdpa_dispatch`` (the mask alone, which already holds the causal part).
"""

from __future__ import annotations

import contextlib
import functools
import types

import paddle
import paddle.nn.functional as _F

from ..kernels import flashmask_attention as cpu_flashmask_attention
from .versions import check_versions

check_versions()

__all__ = [
    "cpu_flashmask",
    "install_cpu_flashmask",
    "uninstall_cpu_flashmask",
    "is_installed",
    "native_flashmask_available",
    "flashmask_dispatch",
    "flashmask_path",
]

#: (module, attribute) pairs this module reads or patches (tests/test_integrations.py).
RELIED_ON = [
    ("paddlenlp.transformers.llama.fusion_ops", "F"),
    ("paddlenlp.transformers.llama.fusion_ops", "fusion_flash_attention"),
    ("paddlenlp.transformers.llama.modeling", "flash_attention"),
    ("paddlenlp.transformers.qwen2.modeling", "flash_attention"),
    ("paddle._C_ops", "flashmask_attention"),
    ("paddle.nn.functional", "flashmask_attention"),
]

_NATIVE_FLASHMASK = getattr(_F, "flashmask_attention", None)
_ORIGINALS: dict = {}


@functools.lru_cache(maxsize=None)
def native_flashmask_available() -> bool:
    """True when Paddle has the FlashMask op *and* a device that runs it
    (a CUDA or XPU build with at least one visible device)."""
    from paddle import _C_ops

    if _NATIVE_FLASHMASK is None or not hasattr(_C_ops, "flashmask_attention"):
        return False
    # CPU wheels register the op too; only a device build has a kernel.  The
    # compiled-with checks come first: device_count() is only defined there.
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        return True
    return bool(paddle.is_compiled_with_xpu() and paddle.device.xpu.device_count() > 0)


def _on_native_device(x) -> bool:
    place = x.place
    return place.is_gpu_place() or place.is_xpu_place()


def _normalize_startend(sri):
    """Accept what the models may hand over and return [b, h, seq, nb] int32.

    fusion_ops always appends a trailing axis, so a caller that already passed
    the 4-D Paddle form [b, 1, seq, nb] arrives here as [b, 1, seq, nb, 1].
    """
    if sri is None:
        return None
    if sri.ndim == 5 and sri.shape[-1] == 1:
        sri = sri.squeeze(-1)
    if sri.dtype != paddle.int32:
        sri = sri.astype("int32")
    return sri


#: dtypes Paddle's native FlashMask kernel accepts (it has no fp32 kernel).
NATIVE_DTYPES = (paddle.float16, paddle.bfloat16)


def flashmask_path(query) -> str:
    """Which implementation runs for this query tensor: ``"native"`` (Paddle's
    kernel: a device build, the tensor on that device, fp16/bf16) or
    ``"portable"`` (paddlenlp_ext.kernels; any device and dtype, e.g. fp32
    weights on a GPU without O2)."""
    if native_flashmask_available() and _on_native_device(query) and query.dtype in NATIVE_DTYPES:
        return "native"
    return "portable"


def flashmask_dispatch(query, key, value, startend_row_indices=None, **kwargs):
    """``flashmask_attention`` that uses Paddle's kernel where it can run and
    the portable implementation otherwise (see :func:`flashmask_path`)."""
    sri = _normalize_startend(startend_row_indices)
    if flashmask_path(query) == "native":
        return _NATIVE_FLASHMASK(query, key, value, sri, **kwargs)
    return cpu_flashmask_attention(query, key, value, sri, **kwargs)


def sdpa_dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
    """``scaled_dot_product_attention`` that honours a dense mask off the native device.

    fusion_ops passes ``attn_mask`` *and* ``is_causal=True`` when the model carries a dense
    mask (packed rows without flash_mask).  Paddle's math fallback (CPU) then applies only its
    own triangle and ignores the mask, so packed examples would attend to each other.  The
    models build that mask with the causal part included (block-diagonal lower triangles),
    so applying the mask alone is exact; device kernels keep Paddle's behaviour.
    """
    if attn_mask is not None and is_causal and not _on_native_device(query):
        is_causal = False
    return _F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)


class _FunctionalProxy(types.ModuleType):
    """Stands in for ``paddle.nn.functional`` inside fusion_ops only."""

    def __init__(self, base):
        super().__init__(base.__name__, base.__doc__)
        self.__dict__["_base"] = base
        # fusion_ops tests hasattr(F, "flashmask_attention") before using it.
        self.__dict__["flashmask_attention"] = flashmask_dispatch
        self.__dict__["scaled_dot_product_attention"] = sdpa_dispatch

    def __getattr__(self, name):
        return getattr(self.__dict__["_base"], name)


def _flash_attention_unavailable(*args, **kwargs):
    raise RuntimeError("paddle.nn.functional.flash_attention is not available in this Paddle build")


def _model_modules():
    from paddlenlp.transformers.llama import fusion_ops
    from paddlenlp.transformers.llama import modeling as llama_modeling
    from paddlenlp.transformers.qwen2 import modeling as qwen2_modeling

    return fusion_ops, (llama_modeling, qwen2_modeling)


def install_cpu_flashmask() -> None:
    """Make Llama/Qwen2 FlashMask attention work without the native kernel.

    Idempotent.  Patches module globals of PaddleNLP's model code only:
    ``fusion_ops.F`` (proxy, see module doc) and, if Paddle failed to import
    ``flash_attention`` there, the models' ``flash_attention`` truthiness gate
    that decides whether ``use_flash_attention=True`` reaches fusion_ops at
    all (otherwise the startend indices would be silently ignored in favour of
    a plain causal mask).
    """
    fusion_ops, model_mods = _model_modules()
    if not isinstance(fusion_ops.F, _FunctionalProxy):
        _ORIGINALS[(fusion_ops.__name__, "F")] = fusion_ops.F
        fusion_ops.F = _FunctionalProxy(fusion_ops.F)
    for mod in model_mods:
        if getattr(mod, "flash_attention", None) is None and (mod.__name__, "flash_attention") not in _ORIGINALS:
            _ORIGINALS[(mod.__name__, "flash_attention")] = None
            mod.flash_attention = _flash_attention_unavailable


@contextlib.contextmanager
def cpu_flashmask():
    """``with cpu_flashmask(): ...``: the patch for the duration of the block.

    Restores the previous state on exit, so it nests: an already installed
    patch stays installed after an inner block ends."""
    was_installed = is_installed()
    install_cpu_flashmask()
    try:
        yield
    finally:
        if not was_installed:
            uninstall_cpu_flashmask()


def uninstall_cpu_flashmask() -> None:
    """Undo ``install_cpu_flashmask``."""
    fusion_ops, model_mods = _model_modules()
    by_name = {m.__name__: m for m in (fusion_ops, *model_mods)}
    for (mod_name, attr), value in list(_ORIGINALS.items()):
        setattr(by_name[mod_name], attr, value)
        del _ORIGINALS[(mod_name, attr)]


def is_installed() -> bool:
    fusion_ops, _ = _model_modules()
    return isinstance(fusion_ops.F, _FunctionalProxy)
