"""Build a PaddleNLP model without allocating its weights, then fill it one parameter at a time.

The streaming checkpoint loader (:mod:`paddlenlp_ext.models.loading`) needs a
model whose parameters exist (names, shapes, dtypes, tied parameters shared)
but hold no memory, so that each checkpoint tensor can be put in place as it
is read and the full-precision model never exists whole.  That takes three
library internals, kept here:

* ``paddlenlp.transformers.model_utils.no_init_weights`` -- switches off the
  module-private ``_init_weights`` flag that makes every ``PretrainedModel``
  run ``init_weights`` after ``__init__`` (which would materialize every
  parameter, even under ``paddle.LazyGuard``);
* ``Tensor._is_initialized()`` -- whether a (lazy) parameter holds memory yet;
* ``DenseTensor._share_data_with`` -- put an existing tensor's storage into a
  lazy parameter without a copy (what PaddleNLP's own low-memory loader,
  ``_load_state_dict_into_meta_model``, does).

Measured on this machine (Paddle 3.3 CPU) for a lazy 65.5M-parameter fp32
embedding ``[16000, 4096]`` given a numpy array: ``param.initialize()`` +
``set_value`` 0.70 s (it runs the random initializer first and then copies);
``set_value(numpy)`` on the lazy parameter 0.19-0.26 s (one copy);
``paddle.to_tensor`` + ``_share_data_with`` 0.19 s (the copy is ``to_tensor``'s);
sharing a paddle tensor that already has the parameter's dtype: 25 us, and
``paddle.utils.dlpack.from_dlpack(array)`` (public; the tensor uses the numpy
array's memory, keeping the array alive) + ``_share_data_with``: 3 ms, no copy
at all.  :func:`materialize` therefore wraps a writable numpy array with
``from_dlpack`` on the CPU (``to_tensor`` on other devices, where the data has to
move anyway), casts with paddle when the dtype differs (bit-identical to
``from_pretrained``'s cast) and shares the result into the parameter.

The class attributes ``_keys_to_ignore_on_load_missing`` /
``_keys_to_ignore_on_load_unexpected`` of PaddleNLP models (which checkpoint
keys ``from_pretrained`` does not report) are read here too.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Tuple

import numpy as np
import paddle
from paddlenlp.transformers import AutoModelForCausalLM
from paddlenlp.transformers.model_utils import no_init_weights

from .versions import check_versions

check_versions()

__all__ = ["lazy_skeleton", "materialize", "is_materialized", "lazy_tensors", "ignored_key_patterns", "RELIED_ON"]

RELIED_ON = [
    ("paddlenlp.transformers.model_utils", "no_init_weights", ("_enable",)),
    ("paddlenlp.transformers.model_utils", "_init_weights", None),
    ("paddlenlp.transformers.AutoModelForCausalLM", "from_config", ("config", "kwargs")),
    ("paddle", "LazyGuard", ()),
    ("paddle.Tensor", "_is_initialized", None),
    ("paddle.Tensor", "get_tensor", None),
    ("paddle.base.libpaddle.DenseTensor", "_share_data_with", None),
    ("paddle.utils.dlpack", "from_dlpack", ("dlpack", "device", "copy")),
    ("paddle.Tensor", "view", None),
    ("paddlenlp.transformers.model_utils.PretrainedModel", "_keys_to_ignore_on_load_missing", None),
    ("paddlenlp.transformers.model_utils.PretrainedModel", "_keys_to_ignore_on_load_unexpected", None),
]


def lazy_skeleton(config: Any, dtype: str, model_class: Any = None) -> paddle.nn.Layer:
    """``AutoModelForCausalLM.from_config(config, dtype=dtype)`` with every parameter lazy (no memory).

    Tied parameters are shared as in a normal build (e.g. Llama's ``lm_head.weight``
    *is* ``llama.embed_tokens.weight`` with ``tie_word_embeddings``).  Buffers are
    built normally (they are small: rotary tables).  Our classes must be known to the Auto classes first
    (``models.registration``; ``models.loading`` registers them before calling this).
    """
    with no_init_weights(), paddle.LazyGuard():
        return (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype)


def is_materialized(tensor: paddle.Tensor) -> bool:
    """False for a parameter created under ``paddle.LazyGuard`` that holds no data yet."""
    return bool(tensor._is_initialized())


def materialize(param: paddle.Tensor, value: Any) -> None:
    """Give the (lazy) ``param`` the data of ``value``, in ``param``'s dtype, on the current device.

    ``value``: a numpy array (``uint16`` = bfloat16 bits, Paddle's convention) or a
    paddle tensor.  A float value of another dtype is cast by paddle (as
    ``from_pretrained`` casts a checkpoint to the model's dtype).  Without a cast
    nothing is copied on the CPU: a paddle tensor is shared, and a writable numpy
    array *becomes* the parameter's memory (do not reuse it afterwards); a
    read-only array, or another device, costs one copy.  ``param`` keeps its
    identity (name, ``stop_gradient``, sharing with tied layers).
    """
    shape = list(param.shape)
    if list(value.shape) != shape:
        raise ValueError(f"materialize {param.name}: value shape {list(value.shape)} != parameter shape {shape}")
    t = value if isinstance(value, paddle.Tensor) else _host_tensor(value)
    if t.dtype != param.dtype:
        if not (t.is_floating_point() and param.is_floating_point()):
            raise ValueError(f"materialize {param.name}: cannot cast a {t.dtype} value to a {param.dtype} parameter")
        t = t.astype(param.dtype)
    param.get_tensor()._share_data_with(t.get_tensor())


def _host_tensor(value: Any) -> paddle.Tensor:
    """A paddle tensor of a numpy array: zero-copy on the CPU when possible, else ``to_tensor`` (uint16 = bf16)."""
    arr = np.ascontiguousarray(value)
    if arr.flags.writeable and arr.size and paddle.device.get_device() == "cpu":
        if arr.dtype == np.uint16:  # bf16 bits: DLPack has no bf16 and paddle's uint16 has no view kernel
            return paddle.utils.dlpack.from_dlpack(arr.view(np.int16)).view(paddle.bfloat16)
        if arr.dtype in (np.float32, np.float16, np.float64):
            return paddle.utils.dlpack.from_dlpack(arr)
    return paddle.to_tensor(arr)


def _all_tensors(layer: paddle.nn.Layer) -> Iterator[Tuple[str, paddle.Tensor]]:
    yield from layer.named_parameters()
    for name, buf in layer.named_buffers():
        if buf is not None:
            yield name, buf


def lazy_tensors(layer: paddle.nn.Layer) -> List[str]:
    """Names of the parameters and buffers of ``layer`` that hold no data yet (empty when fully loaded)."""
    return [name for name, t in _all_tensors(layer) if not is_materialized(t)]


def ignored_key_patterns(model: paddle.nn.Layer) -> Tuple[List[str], List[str]]:
    """(missing, unexpected): regexes of checkpoint keys PaddleNLP's ``from_pretrained`` does not report
    for this model class (``re.search``-ed), e.g. Llama's ``self_attn.rotary_emb.inv_freq``."""
    cls = type(model)
    missing = list(getattr(cls, "_keys_to_ignore_on_load_missing", None) or [])
    unexpected = list(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or [])
    return missing, unexpected
