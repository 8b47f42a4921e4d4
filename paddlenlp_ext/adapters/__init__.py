"""Parameter-efficient adapters: LoRA (+ rsLoRA, LoRA+, PiSSA), VeRA, LoKr, NEFTune.

Public API (see docs/methods.md)::

    AdapterConfig                                   # config.py (no paddle import)
    AdapterMethod, Supports, register_method, TABLE # methods.py: the method table (no paddle import)
    METHODS                                         # {"lora", "pissa", "vera", "lokr"} -> layer class
    apply_adapters(model, config, *, init_weights=True) -> dict
    adapter_state_dict(model) -> {f"{module}.{suffix}": Tensor}
    save_adapter(model, config, output_dir) -> {"config": path, "weights": path}
    load_adapter(model, adapter_dir) -> AdapterConfig          # fresh base model
    load_adapter_weights(model, adapter_dir) -> AdapterConfig  # model already has adapters (resume)
    merge_adapters(model) / unmerge_adapters(model) / unwrap_merged(model)
    adapters_disabled(model)                        # context manager: base weights only (DPO reference)
    count_parameters(model) -> (trainable, total)
    compute_delta(method, config, tensors_for_one_module, in_features, out_features) -> np.ndarray [in, out]
    vera_projections(seed, r, max_in, max_out) -> (A [r, max_in], B [max_out, r])
    factorization(dim, factor) -> (m, n);  lokr_shapes(config, in, out) -> {suffix: shape}
    attach_neftune(model, alpha) -> NEFTuneHook;  token_lengths_from_batch(...)

Attributes are imported lazily, so ``from paddlenlp_ext.adapters.config import
AdapterConfig`` (and ``paddlenlp_ext.adapters.AdapterConfig``) never imports
paddle.
"""

from __future__ import annotations

from ..lazy import lazy_exports

from .config import CONFIG_NAME, DEFAULT_TARGET_MODULES, WEIGHTS_NAME, AdapterConfig, AdapterConfigError
from .methods import TABLE, AdapterMethod, Supports, register_method

_LAZY = {
    # api
    "METHODS": "api",
    "apply_adapters": "api",
    "adapter_state_dict": "api",
    "save_adapter": "api",
    "load_adapter": "api",
    "load_adapter_state_dict": "api",
    "load_adapter_weights": "api",
    "read_adapter_tensors": "api",
    "merge_adapters": "api",
    "unmerge_adapters": "api",
    "unwrap_merged": "api",
    "adapters_disabled": "api",
    "count_parameters": "api",
    "compute_delta": "api",
    "group_adapter_tensors": "api",
    "iter_adapter_layers": "api",
    "get_adapter_config": "api",
    "layer_class": "api",
    # layers
    "AdapterLayer": "base",
    "AdapterError": "base",
    "LoRALinear": "lora",
    "PiSSALinear": "pissa",
    "VeRALinear": "vera",
    "VeRAShared": "vera",
    "vera_projections": "vera",
    "LoKrLinear": "lokr",
    "factorization": "lokr",
    "lokr_shapes": "lokr",
    "randomized_svd": "pissa",
    "exact_svd": "pissa",
    "pissa_factors": "pissa",
    # neftune
    "NEFTuneHook": "neftune",
    "attach_neftune": "neftune",
    "token_lengths_from_batch": "neftune",
}

__all__ = [
    "AdapterConfig",
    "AdapterConfigError",
    "AdapterMethod",
    "Supports",
    "register_method",
    "TABLE",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "DEFAULT_TARGET_MODULES",
] + sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
