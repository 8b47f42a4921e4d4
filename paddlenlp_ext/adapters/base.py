"""Shared adapter-layer interface.

Orientation: Paddle's ``nn.Linear`` stores ``weight`` as ``[in_features,
out_features]`` and computes ``y = x @ W + b``; every delta weight in this
package uses the same ``[in, out]`` orientation.

An :class:`AdapterLayer` wraps ``base_layer`` (an ``nn.Linear`` or any layer
exposing ``in_features`` / ``out_features`` / ``forward``, e.g. a quantized
linear that offers ``dequantize_weight()`` instead of a float ``weight``) and
adds a trainable low-rank branch.  Subclasses implement

* ``_adapter_forward(x)``  - the branch output for the (dropped-out) input,
* ``delta_weight()``       - the ``[in, out]`` fp32 tensor that ``merge`` adds,
* ``adapter_state_dict()`` - ``{suffix: Tensor}`` of what must be saved,
* ``numpy_delta(...)``     - the same delta from saved numpy tensors
  (classmethod, used by ``compute_delta`` without building a model).

Tensor-parallel bases (``ColumnParallelLinear`` / ``RowParallelLinear``) are
wrapped by the subclasses in :mod:`paddlenlp_ext.adapters.tp_layers`
(``tensor_parallel = True``), whose parameters are this rank's shards:
``in_features`` / ``out_features`` of such a layer are the LOCAL shard's, the
full sizes are in its ``shard`` spec.  The single-device classes refuse them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np
import paddle
import paddle.nn as nn

from .config import AdapterConfig


class AdapterError(RuntimeError):
    """Adapter misuse (merge into a quantized base, bad state dict, ...)."""


_TP_CLASS_MARKERS = ("ParallelLinear", "ParallelCoreLinear")


def is_tensor_parallel_linear(layer: nn.Layer) -> bool:
    """True for Column/RowParallelLinear (and their sequence-parallel / MC2 / quantized
    variants): their weight is one rank's shard and their forward communicates.  Which
    of them can carry adapters is decided by :func:`paddlenlp_ext.parallel.shard.shard_spec`."""
    return any(m in cls.__name__ for cls in type(layer).__mro__ for m in _TP_CLASS_MARKERS)


def is_quantized(layer: nn.Layer) -> bool:
    """A quantized linear exposes ``dequantize_weight()`` instead of a float weight."""
    return callable(getattr(layer, "dequantize_weight", None))


def is_linear_like(layer: nn.Layer) -> bool:
    if isinstance(layer, nn.Linear):
        return True
    return is_quantized(layer) and hasattr(layer, "in_features") and hasattr(layer, "out_features")


def base_in_out(layer: nn.Layer) -> Tuple[int, int]:
    """(in_features, out_features) of a linear-like layer; of the FULL layer for a tensor-parallel one."""
    if is_tensor_parallel_linear(layer):
        from ..parallel.shard import shard_spec

        spec = shard_spec(layer)
        return spec.in_features, spec.out_features
    if hasattr(layer, "in_features") and hasattr(layer, "out_features"):
        return int(layer.in_features), int(layer.out_features)
    w = getattr(layer, "weight", None)
    if w is not None and len(w.shape) == 2:
        return int(w.shape[0]), int(w.shape[1])
    raise TypeError(f"{type(layer).__name__} does not expose in_features/out_features nor a 2-D weight; cannot wrap it")


def _is_float_dtype(dtype) -> bool:
    return dtype in (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64)


def adapter_dtype(layer: nn.Layer):
    """dtype for adapter parameters: the base weight's float dtype, else the
    quantized layer's ``compute_dtype``/``dtype`` attribute, else the default."""
    w = getattr(layer, "weight", None)
    if w is not None and not is_quantized(layer) and _is_float_dtype(w.dtype):
        return w.dtype
    for attr in ("compute_dtype", "_dtype", "dtype"):
        d = getattr(layer, attr, None)
        if d is not None:
            if isinstance(d, str):
                d = getattr(paddle, d, None)
            if d is not None and _is_float_dtype(d):
                return d
    return paddle.get_default_dtype()


def float_base_weight(layer: nn.Layer, what: str = "this operation") -> paddle.Tensor:
    """The base layer's float ``[in, out]`` weight parameter, or a clear error."""
    if is_quantized(layer):
        raise AdapterError(
            f"{what} needs a float base weight, but the base layer {type(layer).__name__} is quantized. "
            "Merge offline instead: load the ORIGINAL (unquantized) checkpoint and add compute_delta(...) "
            "for every adapted module (see paddlenlp_ext.adapters.compute_delta)."
        )
    w = getattr(layer, "weight", None)
    if w is None or not _is_float_dtype(w.dtype):
        raise AdapterError(f"{what}: base layer {type(layer).__name__} has no float `weight`")
    return w


def to_numpy_f32(t: Any) -> np.ndarray:
    """Tensor / ndarray -> float32 ndarray (bf16 handled)."""
    if isinstance(t, np.ndarray):
        return t.astype(np.float32, copy=False)
    if isinstance(t, paddle.Tensor):
        if t.dtype != paddle.float32:
            t = t.astype(paddle.float32)
        return t.numpy()
    return np.asarray(t, dtype=np.float32)


class _Identity:
    def __call__(self, x):
        return x


class AdapterLayer(nn.Layer):
    """Base class of all adapter layers (see module docstring)."""

    #: name of the method (key in ``METHODS``)
    method: str = ""
    #: suffixes of ``adapter_state_dict()``, in order
    state_suffixes: Tuple[str, ...] = ()
    #: True: forward is the base layer's alone (``api.adapters_disabled``, e.g. DPO's reference model)
    disabled: bool = False
    #: True for the tensor-parallel subclasses (paddlenlp_ext.adapters.tp_layers): parameters are shards
    tensor_parallel: bool = False

    def __init__(self, base_layer: nn.Layer, config: AdapterConfig, *, init_weights: bool = True, shared: Any = None):
        super().__init__()
        self.config = config
        self.base_layer = base_layer
        self.in_features, self.out_features = self._base_dims(base_layer)
        self.merged = False
        self._param_dtype = adapter_dtype(base_layer)
        self.dropout = nn.Dropout(p=config.dropout) if config.dropout > 0 else _Identity()

    def _base_dims(self, base_layer: nn.Layer) -> Tuple[int, int]:
        """(in, out) of the weight this layer adapts; the tensor-parallel subclasses return the local shard's."""
        if is_tensor_parallel_linear(base_layer):
            raise NotImplementedError(
                f"{type(base_layer).__name__} is tensor parallel: {type(self).__name__} wraps single-device linears "
                "only; apply_adapters() wraps tensor-parallel targets in the layers of "
                "paddlenlp_ext.adapters.tp_layers"
            )
        if not is_linear_like(base_layer):
            raise TypeError(
                f"{type(base_layer).__name__} is not a linear layer (nn.Linear or a quantized linear exposing "
                "in_features/out_features/dequantize_weight)"
            )
        return base_in_out(base_layer)

    # ----------------------------------------------------------- interface
    @classmethod
    def build_shared(cls, config: AdapterConfig, base_layers: Sequence[nn.Layer]) -> Any:
        """State shared by every adapted layer of one model (None by default)."""
        return None

    def _adapter_forward(self, x: paddle.Tensor) -> paddle.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def delta_weight(self) -> paddle.Tensor:  # pragma: no cover - abstract
        """fp32 ``[in, out]`` tensor that ``merge()`` adds to the base weight."""
        raise NotImplementedError

    def adapter_state_dict(self) -> Dict[str, paddle.Tensor]:
        return {s: getattr(self, s) for s in self.state_suffixes}

    def saved_shapes(self) -> Dict[str, list]:
        """``{suffix: shape}`` in a saved (complete) adapter; the tensor-parallel layers' are the full shapes."""
        return {s: [int(v) for v in t.shape] for s, t in self.adapter_state_dict().items()}

    @classmethod
    def expected_suffixes(cls, config: AdapterConfig, in_features: int, out_features: int) -> Tuple[str, ...]:
        """Suffixes a saved module of this type holds; shape-dependent for LoKr
        (which overrides this), ``state_suffixes`` for every other method."""
        return tuple(cls.state_suffixes)

    @classmethod
    def numpy_delta(
        cls, config: AdapterConfig, tensors: Mapping[str, np.ndarray], in_features: int, out_features: int
    ) -> np.ndarray:  # pragma: no cover - abstract
        """``[in, out]`` float32 delta such that
        ``merged_weight = original_base_weight + delta``."""
        raise NotImplementedError

    # -------------------------------------------------------------- forward
    def forward(self, x: paddle.Tensor, *args, **kwargs) -> paddle.Tensor:
        out = self.base_layer(x, *args, **kwargs)
        if self.merged or self.disabled:
            return out
        h = x if x.dtype == self._param_dtype else x.astype(self._param_dtype)
        delta = self._adapter_forward(self.dropout(h))
        if delta.dtype != out.dtype:
            delta = delta.astype(out.dtype)
        return out + delta

    # ---------------------------------------------------------- merge/unmerge
    @paddle.no_grad()
    def merge(self) -> None:
        """Add ``delta_weight()`` into the base weight in place (idempotent)."""
        if self.merged:
            return
        w = float_base_weight(self.base_layer, f"merge() of a {self.method} adapter")
        new = w.astype(paddle.float32) + self.delta_weight()
        w.set_value(new.astype(w.dtype))
        self.merged = True

    @paddle.no_grad()
    def unmerge(self) -> None:
        """Subtract ``delta_weight()`` from the base weight (idempotent).
        Exact in fp32; in fp16/bf16 the round trip loses the rounding of the
        merged weight."""
        if not self.merged:
            return
        w = float_base_weight(self.base_layer, f"unmerge() of a {self.method} adapter")
        new = w.astype(paddle.float32) - self.delta_weight()
        w.set_value(new.astype(w.dtype))
        self.merged = False

    # ------------------------------------------------------------ load/save
    def _check_state(self, d: Mapping[str, Any]) -> Dict[str, Any]:
        expected = self.adapter_state_dict()
        missing = [k for k in expected if k not in d]
        unexpected = [k for k in d if k not in expected]
        if missing or unexpected:
            raise AdapterError(
                f"{self.method} adapter state mismatch: missing {missing}, unexpected {unexpected} "
                f"(expected keys {list(expected)})"
            )
        for k, ref in expected.items():
            shape = tuple(int(s) for s in d[k].shape)
            if shape != tuple(int(s) for s in ref.shape):
                raise AdapterError(
                    f"{self.method} adapter tensor {k!r}: shape {list(shape)} does not match the layer's "
                    f"{list(ref.shape)} (in_features={self.in_features}, out_features={self.out_features}, "
                    f"r={self.config.r})"
                )
        return dict(d)

    @paddle.no_grad()
    def load_adapter_state_dict(self, d: Mapping[str, Any]) -> None:
        """Load ``{suffix: Tensor|ndarray}`` (strict: same keys, same shapes)."""
        if self.merged:
            raise AdapterError("load_adapter_state_dict() on a merged layer; call unmerge() first")
        d = self._check_state(d)
        for k, ref in self.adapter_state_dict().items():
            ref.set_value(paddle.to_tensor(to_numpy_f32(d[k])).astype(ref.dtype))

    def extra_repr(self) -> str:
        return (
            f"method={self.method}, in_features={self.in_features}, out_features={self.out_features}, "
            f"r={self.config.r}, merged={self.merged}"
        )


# {sublayer name: the plain model's name} of a model that names its sublayers otherwise (a pipeline stage;
# set by ``api.apply_adapters``)
_LAYER_NAMES_ATTR = "_paddlenlp_ext_layer_names"


def iter_adapter_layers(model: nn.Layer) -> List[Tuple[str, AdapterLayer]]:
    """``[(module_name, adapter_layer)]`` in model order; names are the plain model's (also on a pipeline stage).

    Here, not in ``api``, so that ``parallel/`` (which ``api`` calls to save tensor-parallel adapters) reads a
    model's adapter layers without importing ``api`` back."""
    names = getattr(model, _LAYER_NAMES_ATTR, None) or {}
    return [(names.get(n, n), l) for n, l in model.named_sublayers() if isinstance(l, AdapterLayer)]


def holds_part_of_model(model: nn.Layer) -> bool:
    """True for a pipeline stage: it holds the adapters of its own layers only."""
    return getattr(model, _LAYER_NAMES_ATTR, None) is not None
