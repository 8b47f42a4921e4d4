"""Model-level adapter API (re-exported by ``paddlenlp_ext.adapters``)."""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import paddle
import paddle.nn as nn

from .base import (  # noqa: F401  (iter_adapter_layers, holds_part_of_model: also this module's API)
    _LAYER_NAMES_ATTR,
    AdapterError,
    AdapterLayer,
    holds_part_of_model,
    is_linear_like,
    is_tensor_parallel_linear,
    iter_adapter_layers,
    to_numpy_f32,
)
from .config import CONFIG_NAME, WEIGHTS_NAME, AdapterConfig
from .methods import layer_types, load_object
from .pissa import PiSSALinear


class _LayerClasses(dict):
    """``{layer type: adapter layer class}`` read from the method table (``adapters.methods``), so a
    method registered after this module was imported is found too; classes are imported on first use."""

    def _refresh(self) -> None:
        types = layer_types()
        for name in [n for n in dict.keys(self) if n not in types]:  # unregistered since
            dict.__delitem__(self, name)
        for name, path in types.items():
            if not dict.__contains__(self, name):
                dict.__setitem__(self, name, load_object(path))

    def __getitem__(self, name):
        self._refresh()
        return dict.__getitem__(self, name)

    def __iter__(self):
        self._refresh()
        return dict.__iter__(self)

    def __len__(self):
        self._refresh()
        return dict.__len__(self)

    def __contains__(self, name):
        self._refresh()
        return dict.__contains__(self, name)

    def keys(self):
        self._refresh()
        return dict.keys(self)

    def items(self):
        self._refresh()
        return dict.items(self)


#: layer type -> adapter layer class ("lora", "pissa" for lora+pissa, "vera", "lokr", and any registered
#: method).  ``AdapterConfig.layer_type`` gives the key.
METHODS: Dict[str, type] = _LayerClasses()

_MODEL_CONFIG_ATTR = "_paddlenlp_ext_adapter_config"


def layer_class(config: AdapterConfig) -> type:
    if config.layer_type not in layer_types():
        raise ValueError(f"no adapter implementation for {config.layer_type!r}; known: {sorted(METHODS)}")
    return METHODS[config.layer_type]


# --------------------------------------------------------------------- helpers
def _parent_and_attr(model: nn.Layer, name: str) -> Tuple[nn.Layer, str]:
    parts = name.split(".")
    parent = model
    for p in parts[:-1]:
        parent = dict(parent.named_children())[p]
    return parent, parts[-1]


def _replace(model: nn.Layer, name: str, new: nn.Layer) -> None:
    parent, attr = _parent_and_attr(model, name)
    if attr not in dict(parent.named_children()):
        raise KeyError(f"{name} is not a sublayer of the model")
    setattr(parent, attr, new)


def count_parameters(model: nn.Layer) -> Tuple[int, int]:
    """(trainable, total) parameter element counts."""
    trainable = total = 0
    for p in model.parameters():
        n = int(np.prod(p.shape)) if len(p.shape) else 1
        total += n
        if not p.stop_gradient:
            trainable += n
    return trainable, total


def get_adapter_config(model: nn.Layer) -> Optional[AdapterConfig]:
    """The (resolved) config the model's adapters were built with, if any."""
    return getattr(model, _MODEL_CONFIG_ATTR, None)


# ------------------------------------------------------------------- applying
def apply_adapters(model: nn.Layer, config: AdapterConfig, *, init_weights: bool = True,
                   collectives: Any = None, layer_names: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:  # fmt: skip
    """Wrap every linear sublayer whose full name ``re.fullmatch``-es one of
    ``config.target_modules`` (default: linears inside ``...layers.<i>.``) in
    the adapter layer for ``config``, freeze every base parameter and return
    ``{"method", "adapted_modules", "trainable_params", "total_params"}``.

    ``init_weights=False`` skips data-dependent initialisation (PiSSA's SVD);
    ``load_adapter`` uses it before loading saved weights.
    For VeRA, ``config.vera_max_in/out`` are filled in place when None.

    Tensor-parallel targets (Paddle's ``ColumnParallelLinear`` / ``RowParallelLinear``
    or quantized ones, ``tensor_parallel_degree > 1``) get the layers of
    :mod:`paddlenlp_ext.adapters.tp_layers` (LoRA family and VeRA); their
    collectives come from each layer's ``model_parallel_group`` unless
    ``collectives`` (a :class:`paddlenlp_ext.parallel.Collectives`) is given.
    PiSSA, LoKr and sequence-parallel / other tensor-parallel classes raise
    NotImplementedError naming the module.

    ``layer_names`` (a pipeline stage, whose sublayers are named by position):
    ``{sublayer name: the plain model's name}``.  Targets are matched, and
    adapters named and saved, by the plain names, so ``target_modules`` and
    checkpoints are the same as on one device; the stage holds only its own
    layers' adapters (``holds_part_of_model``).  VeRA is refused there: its
    shared projections are sized over every adapted layer of the model.
    """
    if not isinstance(config, AdapterConfig):
        raise TypeError(f"config must be an AdapterConfig, got {type(config).__name__}")
    config.validate()
    if iter_adapter_layers(model):
        raise AdapterError("model already has adapter layers; apply_adapters() must be called on a plain base model")
    if layer_names is not None and not config.row.supports.pipeline_parallel:
        why = config.row.refusals.get("pipeline_parallel", "it has not been verified on pipeline stages")
        raise NotImplementedError(f"{config.row.title} on a pipeline stage: {why}")
    plain = dict(layer_names or {})
    patterns = [re.compile(p) for p in config.resolved_target_modules]
    matched: List[Tuple[str, nn.Layer]] = []
    linear_names: List[str] = []
    tp_names: List[str] = []
    for name, layer in model.named_sublayers():
        if any(name.startswith(t + ".") for t in tp_names):
            continue  # the inside of a tensor-parallel linear (a quantized shard) is not a target of its own
        tp = is_tensor_parallel_linear(layer)
        if tp:
            tp_names.append(name)
        if tp or is_linear_like(layer):
            linear_names.append(plain.get(name, name))
        if not any(p.fullmatch(plain.get(name, name)) for p in patterns):
            continue
        if tp:
            from .tp_layers import check_parallel_target

            check_parallel_target(config, name, layer)
            matched.append((name, layer))
        elif is_linear_like(layer):
            matched.append((name, layer))
    if not matched:
        shown = linear_names[:20]
        more = f" (+{len(linear_names) - 20} more)" if len(linear_names) > 20 else ""
        raise ValueError(
            f"no linear module matched target_modules={config.resolved_target_modules} (re.fullmatch against full "
            f"sublayer names); linear modules available: {shown}{more}"
        )

    for p in model.parameters():
        p.stop_gradient = True

    n_tp = sum(is_tensor_parallel_linear(layer) for _, layer in matched)
    if collectives is not None and not n_tp:
        raise ValueError("apply_adapters: collectives given, but no target module is tensor parallel")
    cls = layer_class(config)
    shared = cls.build_shared(config, [layer for _, layer in matched])  # VeRA: over the full layer sizes
    if n_tp:
        from .tp_layers import parallel_layer_class

        tp_cls = parallel_layer_class(config)
    for name, layer in matched:
        if is_tensor_parallel_linear(layer):
            new = tp_cls(layer, config, init_weights=init_weights, shared=shared, collectives=collectives)
        else:
            new = cls(layer, config, init_weights=init_weights, shared=shared)
        _replace(model, name, new)
    setattr(model, _MODEL_CONFIG_ATTR, config)
    if layer_names is not None:
        setattr(model, _LAYER_NAMES_ATTR, plain)

    trainable, total = count_parameters(model)
    return {
        "method": config.layer_type,
        "adapted_modules": [plain.get(n, n) for n, _ in matched],
        "trainable_params": trainable,
        "total_params": total,
    }


# ---------------------------------------------------------------- state dicts
def adapter_state_dict(model: nn.Layer) -> Dict[str, paddle.Tensor]:
    """``{f"{module_name}.{suffix}": Tensor}`` for every adapter layer;
    ``module_name`` is the adapted Linear's name in the base model."""
    out: Dict[str, paddle.Tensor] = {}
    for name, layer in iter_adapter_layers(model):
        for suffix, t in layer.adapter_state_dict().items():
            out[f"{name}.{suffix}"] = t
    return out


def save_adapter(model: nn.Layer, config: Optional[AdapterConfig], output_dir: str) -> Dict[str, str]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (adapter
    tensors only, float32, safetensors numpy format).  ``config=None`` uses the
    config the adapters were applied with.  Returns the two paths.

    Tensor-parallel adapters are saved complete: the split tensors are gathered
    over the model-parallel group -- a collective, so EVERY rank of the group must
    call ``save_adapter`` -- and rank 0 of the group writes the files (the other
    ranks write nothing and return the same paths).  A pipeline stage gathers every
    stage's adapters over the pipeline group (every stage must call ``save_adapter``)
    and the first stage writes them."""
    from safetensors.numpy import save_file

    layers = iter_adapter_layers(model)
    if not layers:
        raise AdapterError("save_adapter: the model has no adapter layers")
    applied = get_adapter_config(model)
    if config is None:
        config = applied
    if config is None:
        raise AdapterError("save_adapter: no config given and the model carries none")
    if applied is not None and applied is not config:
        a, c = applied.to_dict(), config.to_dict()
        diff = [k for k in _COMPAT_KEYS if a[k] != c[k] and not (k.startswith("vera_max") and c[k] is None)]
        if diff:
            raise AdapterError(f"save_adapter: config differs from the one the adapters were built with in {diff}")
        for k in ("vera_max_in", "vera_max_out"):
            if c[k] is None:
                setattr(config, k, a[k])
    if any(l.merged for _, l in layers):
        raise AdapterError("save_adapter: adapters are merged; unmerge_adapters(model) first")
    state, write = adapter_state_dict(model), True
    if any(l.tensor_parallel for _, l in layers):
        from .tp_checkpoint import full_adapter_state_dict, is_checkpoint_writer

        state, write = full_adapter_state_dict(model), is_checkpoint_writer(model)
    if holds_part_of_model(model):  # a pipeline stage: every stage's adapters, gathered (a collective)
        from .pp_stage import gather_stage_states

        state, first_stage = gather_stage_states(model, state)
        write = write and first_stage
    w_path = os.path.join(output_dir, WEIGHTS_NAME)
    if not write:
        return {"config": os.path.join(output_dir, CONFIG_NAME), "weights": w_path}
    tensors = {k: np.ascontiguousarray(to_numpy_f32(v)) for k, v in state.items()}
    os.makedirs(output_dir, exist_ok=True)
    cfg_path = config.save(output_dir)
    save_file(tensors, w_path, metadata={"format": "np", "adapter_method": config.layer_type})
    return {"config": cfg_path, "weights": w_path}


def read_adapter_tensors(adapter_dir: str) -> Dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    path = os.path.join(adapter_dir, WEIGHTS_NAME)
    if not os.path.isfile(path):
        from .paddlenlp_format import is_paddlenlp_adapter, read_paddlenlp_tensors

        if is_paddlenlp_adapter(adapter_dir):  # PaddleNLP's lora_model_state.pdparams, in our naming
            return read_paddlenlp_tensors(adapter_dir)
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {adapter_dir}")
    return load_file(path)


def load_adapter_state_dict(model: nn.Layer, state: Mapping[str, Any]) -> None:
    """Strictly load ``{f"{module}.{suffix}": tensor}`` into the model's adapter
    layers: missing / unexpected keys or shape mismatches raise AdapterError
    naming the keys.  The tensors are the complete ones (as saved); each
    tensor-parallel layer keeps its rank's part."""
    layers = dict(iter_adapter_layers(model))
    expected = {f"{n}.{s}": shape for n, layer in layers.items() for s, shape in layer.saved_shapes().items()}
    missing = sorted(k for k in expected if k not in state)
    # a pipeline stage takes its own layers' tensors from the complete adapter
    unexpected = [] if holds_part_of_model(model) else sorted(k for k in state if k not in expected)
    if missing or unexpected:
        raise AdapterError(
            f"adapter weights do not match the model: missing keys {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}"
        )
    for k, shape in expected.items():
        got = [int(s) for s in state[k].shape]
        if got != shape:
            raise AdapterError(f"adapter weight {k!r}: shape {got} does not match the model's {shape}")
    per_layer: Dict[str, Dict[str, Any]] = {n: {} for n in layers}
    for k in expected:
        mod, suffix = k.rsplit(".", 1)
        per_layer[mod][suffix] = state[k]
    for n, layer in layers.items():
        layer.load_adapter_state_dict(per_layer[n])


_COMPAT_KEYS = (
    "method",
    "r",
    "alpha",
    "rslora",
    "pissa",
    "vera_seed",
    "vera_max_in",
    "vera_max_out",
    "lokr_factor",
    "lokr_decompose_both",
)


def load_adapter_weights(model: nn.Layer, adapter_dir: str) -> AdapterConfig:
    """Load ``adapter_dir``'s weights into a model that ALREADY has adapters
    (e.g. resuming training from a checkpoint written by ``save_adapter``).
    The saved config must agree with the model's on method, r, alpha, rslora,
    pissa, the VeRA projection parameters and the LoKr factorization (lokr_factor,
    lokr_decompose_both); loading is strict.  PiSSA
    residuals are moved from the model's current A0/B0 to the saved ones."""
    if not iter_adapter_layers(model):
        raise AdapterError("load_adapter_weights: the model has no adapters; use load_adapter() on a base model")
    saved = AdapterConfig.load(adapter_dir)
    current = get_adapter_config(model)
    if current is not None:
        a, b = current.to_dict(), saved.to_dict()
        diff = {k: (a[k], b[k]) for k in _COMPAT_KEYS if a[k] != b[k]}
        if diff:
            raise AdapterError(
                f"load_adapter_weights: {adapter_dir} was saved with a different adapter config "
                f"(model vs saved): {diff}"
            )
    if any(l.merged for _, l in iter_adapter_layers(model)):
        raise AdapterError("load_adapter_weights: adapters are merged; unmerge_adapters(model) first")
    load_adapter_state_dict(model, read_adapter_tensors(adapter_dir))
    return saved


def load_adapter(model: nn.Layer, adapter_dir: str, layer_names: Optional[Mapping[str, str]] = None) -> AdapterConfig:
    """Apply the adapters described by ``adapter_dir/adapter_config.json`` to a
    fresh (original) base model and load ``adapter_model.safetensors``.  For
    PiSSA the base weights become ``W - s*A0@B0`` (no SVD).  On error the model
    is left partially wrapped and should be discarded.  ``layer_names``: as
    :func:`apply_adapters` (a pipeline stage loads its own layers' tensors)."""
    config = AdapterConfig.load(adapter_dir)
    state = read_adapter_tensors(adapter_dir)
    apply_adapters(model, config, init_weights=False, layer_names=layer_names)
    load_adapter_state_dict(model, state)
    return config


# -------------------------------------------------------------------- merging
def merge_adapters(model: nn.Layer) -> List[str]:
    """merge() every adapter layer (refuses on quantized bases)."""
    layers = iter_adapter_layers(model)
    for _, layer in layers:
        layer.merge()
    return [n for n, _ in layers]


def unmerge_adapters(model: nn.Layer) -> List[str]:
    layers = iter_adapter_layers(model)
    for _, layer in layers:
        layer.unmerge()
    return [n for n, _ in layers]


def unwrap_merged(model: nn.Layer) -> List[str]:
    """Merge (if needed) and replace every adapter layer by its base layer,
    leaving a plain model whose weights include the adapters.  Returns the
    unwrapped module names."""
    layers = iter_adapter_layers(model)
    for _, layer in layers:
        layer.merge()
    for name, layer in layers:
        _replace(model, name, layer.base_layer)
    if hasattr(model, _MODEL_CONFIG_ATTR):
        setattr(model, _MODEL_CONFIG_ATTR, None)
    return [n for n, _ in layers]


@contextlib.contextmanager
def adapters_disabled(model: nn.Layer):
    """Within the block the model computes with its base weights alone (every adapter layer
    bypassed); nothing is copied.  DPO's reference model with adapters.  Not for merged
    adapters (their delta is inside the base weight) nor PiSSA (its base holds the residual):
    AdapterError."""
    layers = [layer for _, layer in iter_adapter_layers(model)]
    for layer in layers:
        if layer.merged:
            raise AdapterError("adapters_disabled() on merged adapters: the base weight includes them; unmerge first")
        if not layer.config.row.supports.reference_by_disabling:
            why = layer.config.row.refusals.get("reference_by_disabling", "its base is not the original model")
            raise AdapterError(f"adapters_disabled() with {layer.config.row.title}: {why}")
        if isinstance(layer, PiSSALinear):
            raise AdapterError(
                "adapters_disabled() with PiSSA: the base weight is the residual W - A0 B0, not the original model"
            )
    before = [layer.disabled for layer in layers]
    try:
        for layer in layers:
            layer.disabled = True
        yield model
    finally:
        for layer, was in zip(layers, before):
            layer.disabled = was


# -------------------------------------------------------- streaming merge math
def compute_delta(
    method: str,
    config: AdapterConfig,
    tensors_for_one_module: Mapping[str, Any],
    in_features: int,
    out_features: int,
) -> np.ndarray:
    """Delta weight ``[in, out]`` (float32 numpy) of one adapted module from
    its saved tensors (``{suffix: array}``, i.e. the safetensors keys
    ``f"{module}.{suffix}"`` with the module prefix stripped)::

        merged_weight = base_weight_from_original_checkpoint + compute_delta(...)

    ``base_weight_from_original_checkpoint`` is ``{module}.weight`` of the
    ORIGINAL base checkpoint ([in, out], Paddle orientation).  For PiSSA the
    delta includes the residual correction ``-s*A0@B0``; for VeRA the shared
    projections are regenerated from ``config`` (seed, r, vera_max_in/out);
    for LoKr the set of tensors depends on the module's shape (``lokr_shapes``).
    ``method`` is ``config.method`` (``"pissa"`` is accepted for lora+pissa).
    """
    if not isinstance(config, AdapterConfig):
        config = AdapterConfig.from_dict(config)
    if method not in (config.method, config.layer_type):
        raise ValueError(f"compute_delta: method {method!r} does not match config ({config.layer_type!r})")
    cls = layer_class(config)
    expected = set(cls.expected_suffixes(config, int(in_features), int(out_features)))
    got = set(tensors_for_one_module)
    if got != expected:
        raise ValueError(f"compute_delta({config.layer_type}): expected tensors {sorted(expected)}, got {sorted(got)}")
    return np.asarray(
        cls.numpy_delta(config, tensors_for_one_module, int(in_features), int(out_features)), dtype=np.float32
    )


def group_adapter_tensors(tensors: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """``{f"{module}.{suffix}": t}`` -> ``{module: {suffix: t}}`` (for streaming merges)."""
    out: Dict[str, Dict[str, Any]] = {}
    for k, v in tensors.items():
        mod, suffix = k.rsplit(".", 1)
        out.setdefault(mod, {})[suffix] = v
    return out
