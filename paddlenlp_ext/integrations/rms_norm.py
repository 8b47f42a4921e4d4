"""A cheaper RMSNorm for PaddleNLP's Llama and Qwen2 on CPU (fp32): one autograd node per norm.

PaddleNLP 3.0.0b4's ``LlamaRMSNorm.forward`` / ``Qwen2RMSNorm.forward`` (without
``use_fused_rms_norm``, whose kernel is GPU-only) compute, on ``x`` [b, s, h]::

    variance = x.astype("float32").pow(2).mean(-1, keepdim=True)   # [b, s, 1]
    y = paddle.rsqrt(variance + eps) * x * weight                    # weight [h]: broadcast

On Paddle's CPU kernels ``pow(2)`` and its gradient are ~200x slower than ``x * x``, and the
gradient of a multiply whose operand broadcasts (``* weight``) is ~10x slower than the same
product on one shape; with 2 norms per layer this was ~16% of a LoRA micro-step on the 0.25B
Llama (docs/benchmarks.md, "Training step speed").  :class:`RMSNormFunction` computes the same
function with ``x * x`` and writes the backward by hand::

    n = x * r,  r = rsqrt(mean(x * x) + eps),  y = n * w
    dL/dx = r * (g*w - n * mean(g*w * n))        (all [b, s, h], means over h)
    dL/dw = sum over b, s of g * n                (only when w is trained)

It is not bitwise equal to PaddleNLP's (``x * x`` is exact where Paddle's CPU ``pow`` is off by
up to 1 ulp): outputs and gradients agree within 1e-6 relative (``tests/test_rms_norm.py``),
and a 10-step loss curve within 1e-6 (docs/benchmarks.md).  It takes over only fp32 CPU calls
in dygraph without ``use_fused_rms_norm``; every other call runs PaddleNLP's forward unchanged.

:func:`fast_rms_norm` swaps ``forward`` of both classes for the block and restores it on exit
(``training/run.py``'s ``library_patches``).
"""

from __future__ import annotations

import contextlib
import importlib

import paddle

from ..kernels.rms_norm import RMSNormFunction, rms_norm
from .versions import check_versions

check_versions()

__all__ = ["RMSNormFunction", "rms_norm", "fast_rms_norm", "is_installed"]

#: (module, attribute[, signature]) this module patches (tests/test_integrations.py).
RELIED_ON = [
    ("paddlenlp.transformers.llama.modeling.LlamaRMSNorm", "forward", ("self", "hidden_states")),
    ("paddlenlp.transformers.qwen2.modeling.Qwen2RMSNorm", "forward", ("self", "hidden_states")),
]

_CLASSES = (
    ("paddlenlp.transformers.llama.modeling", "LlamaRMSNorm"),
    ("paddlenlp.transformers.qwen2.modeling", "Qwen2RMSNorm"),
)


def _handled(layer, hidden_states) -> bool:
    return (
        paddle.in_dynamic_mode()
        and not getattr(layer.config, "use_fused_rms_norm", False)
        and hidden_states.dtype == paddle.float32
        and layer.weight.dtype == paddle.float32
        and hidden_states.place.is_cpu_place()
    )


def _patched(original):
    def forward(self, hidden_states):
        if not _handled(self, hidden_states):
            return original(self, hidden_states)
        with paddle.amp.auto_cast(False):  # as PaddleNLP's: the norm runs in fp32 even under autocast
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    forward._paddlenlp_ext_original = original
    return forward


def _classes():
    return [getattr(importlib.import_module(module), name) for module, name in _CLASSES]


def is_installed() -> bool:
    return all(hasattr(cls.forward, "_paddlenlp_ext_original") for cls in _classes())


@contextlib.contextmanager
def fast_rms_norm():
    """``with fast_rms_norm(): ...``: Llama/Qwen2 RMSNorm layers use :func:`rms_norm` on CPU fp32 in the block.
    Nests: only what this block installed is restored on exit."""
    mine = []
    for cls in _classes():
        if not hasattr(cls.forward, "_paddlenlp_ext_original"):
            mine.append((cls, cls.forward))
            cls.forward = _patched(cls.forward)
    try:
        yield
    finally:
        for cls, original in mine:
            cls.forward = original
