"""Streaming model loading: build the model empty, then fill it one checkpoint tensor at a time.

``AutoModelForCausalLM.from_pretrained`` + ``models.quantize.quantize_model`` holds the
whole full-precision model before quantizing it, which defeats QLoRA's point
(a 0.82B Llama peaked at 4.88 GB for nf4, as for fp32 LoRA).
:func:`load_model_streaming` instead

1. builds the model with every parameter lazy (no memory;
   :func:`paddlenlp_ext.integrations.lazy_init.lazy_skeleton`);
2. validates before reading any tensor data what can be validated: the weight
   files (:func:`.checkpoint.find_checkpoint`: index, shards on disk, headers),
   the quantization settings against every target layer's shape, and -- when
   the names/shapes are known from headers or the index -- missing, unexpected
   and wrongly shaped tensors;
3. streams the checkpoint (:func:`.checkpoint.iter_tensors`): the ``.weight``
   of a target Linear is quantized on arrival into a
   :class:`~paddlenlp_ext.quant.QuantizedLinear` that replaces the lazy Linear
   (it shares the Linear's bias parameter, which is filled whenever the bias
   tensor arrives -- before or after the weight, in any shard); every other
   tensor fills its parameter in the parameter's dtype (the run's dtype);
4. checks that every parameter and buffer holds data.

Peak memory: the runtime + the quantized layers + the other parameters in the
run's dtype + one tensor in flight (safetensors) or what is left of one
``.pdparams`` file.  Without ``quantization`` the same loader fills a
bf16/fp16 model straight from an fp32 checkpoint without the 2x a full fp32
load would need.

The result is identical to ``from_pretrained(model_dir, config=config,
dtype=dtype)`` followed by ``quantize_model`` with the same settings:
parameters cast by paddle to the parameter's dtype, and a quantized weight is
first cast to the Linear's dtype (what ``quantize_model`` sees), so every code,
scale and parameter is bit-identical (``tests/test_loading.py``).
"""

from __future__ import annotations

import logging
import os
import re
import resource
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .checkpoint import Checkpoint, CheckpointError, find_checkpoint, iter_tensors
from .load_checks import QUANT_KEYS, KeyMap, check_hf_config, check_quantization, few_names, missing_message, precheck

__all__ = ["load_model_streaming", "CheckpointError", "QUANT_KEYS"]

_log = logging.getLogger("paddlenlp_ext.models.loading")


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _peak_rss() -> int:
    """This process's peak RSS: VmHWM on Linux (ru_maxrss also counts the parent's RSS at exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: ru_maxrss below
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def _as_tensor(arr):
    import paddle

    return arr if isinstance(arr, paddle.Tensor) else paddle.to_tensor(arr)  # uint16 -> bfloat16 (Paddle's rule)


def _quant_weight_values(arr, run_dtype) -> np.ndarray:
    """float32 numpy holding the values the Linear would hold in ``run_dtype`` (what quantize_model sees)."""
    import paddle

    if isinstance(arr, np.ndarray) and arr.dtype == np.float32 and run_dtype == paddle.float32:
        return arr
    t = _as_tensor(arr)
    if t.dtype != run_dtype:
        t = t.astype(run_dtype)  # the cast from_pretrained does
    return t.astype("float32").numpy() if t.dtype != paddle.float32 else t.numpy()


def _device_place():
    """The current device's place when it is a GPU (lets ``from_weight`` pick the fused layout), else None."""
    import paddle

    dev = paddle.device.get_device()
    if dev.startswith("gpu"):
        return paddle.CUDAPlace(int(dev.split(":")[1]) if ":" in dev else 0)
    return None


def _quantized_layer(lin, arr, quant: Dict[str, Any], place):
    """The QuantizedLinear for the lazy Linear ``lin`` with weight ``arr``; it shares ``lin.bias`` (filled in
    place whenever the bias tensor arrives, as ``quantize_model`` shares the bias of the Linear it replaces)."""
    from ..quant import QuantizedLinear

    return QuantizedLinear.from_weight(
        _quant_weight_values(arr, lin.weight.dtype), lin.bias, quant["weight_quantize_algo"],
        block_size=quant["weight_blocksize"], double_quant=quant["weight_double_quant"],
        double_quant_block_size=quant["weight_double_quant_block_size"],
        weight_dtype=str(lin.weight.dtype).replace("paddle.", ""), place=place,
    )  # fmt: skip


def _check_tied_copy(param, arr, key: str, first: str, path: str) -> None:
    """A checkpoint holding both names of a tied parameter must hold the same values under both."""
    import paddle

    if not bool(paddle.equal_all(_as_tensor(arr).astype(param.dtype), param).item()):
        raise CheckpointError(
            f"{key!r} in {os.path.basename(path)} differs from {first!r}, but the model ties them "
            "(config tie_word_embeddings=true): set tie_word_embeddings to false in config.json"
        )


#: model_type -> the config key that gives transformers 4.55's routed experts a bias (5.x's fused ones have none)
_ROUTED_BIAS_KEY = {"ernie4_5_moe": "use_bias", "deepseek_v2": "mlp_bias"}
_ROUTED = re.compile(r"\.experts\.\d+\.\w+\.(weight|bias)$")


def _routed_expert_bias(ckpt: Checkpoint, config: Any) -> None:
    """Build the routed experts without a bias when the checkpoint is in transformers 5.x's layout.

    With ``use_bias`` (ernie4_5_moe) / ``mlp_bias`` (deepseek_v2) true, 4.55 gives every routed expert's
    Linears a bias and 5.x (``Ernie4_5_MoeExperts`` / ``DeepseekV2Experts``: fused 3-D weights) none; both
    save per-expert names, so the checkpoint's tensor names tell which one built it.  With routed-expert
    weights and not one routed-expert bias, ``config.routed_expert_bias = False`` (read by
    ``decoder.moe_spec``); a checkpoint with some of them keeps the biases (any missing one is then named)."""
    key = _ROUTED_BIAS_KEY.get(ckpt.hf_model_type)
    if key is None or not getattr(config, key, False) or not ckpt.names_known:
        return
    kinds = {m.group(1) for m in map(_ROUTED.search, ckpt.tensors) if m}
    if kinds == {"weight"}:
        config.routed_expert_bias = False


def _replace(model, name: str, new) -> None:
    parent = model
    *path, attr = name.split(".")
    for part in path:
        parent = dict(parent.named_children())[part]
    setattr(parent, attr, new)


def decoder_class_for(config, hf_layout: bool = False):
    """(our decoder's causal-LM class, config as its config class) for a row the table builds with the decoder
    whose model_type PaddleNLP also has (mixtral, qwen2_moe: the Auto classes would pick PaddleNLP's, which
    crash on Paddle 3.3), or whose transformers layout (``hf_layout``), or a config its PaddleNLP classes refuse,
    trains on the decoder (``family_table.layout_row``: qwen3_moe, whose PaddleNLP layout stays on models/qwen3);
    (None, config) otherwise."""
    from .family_table import layout_row

    family = layout_row(getattr(config, "model_type", None), hf_layout, config)
    if family is None or not family.decoder or family.arch is None:
        return None, config
    from .decoder import classes_for

    config_cls, _, lm_cls = classes_for(config.model_type)
    if not isinstance(config, config_cls):
        config = config_cls(**config.to_dict())
    return lm_cls, config


def load_model_streaming(
    model_dir: str,
    config: Any,
    dtype: str,
    quantization: Optional[Dict[str, Any]] = None,
    target_modules: Optional[Sequence[str]] = None,
    logger: Optional[Any] = None,
    max_seq_len: Optional[int] = None,
    model_class: Optional[Any] = None,
) -> Tuple[Any, Dict[str, Any]]:
    """Load the causal LM of ``model_dir`` tensor by tensor, quantizing target Linears on arrival.

    Args:
        model_dir: local directory with the weights (safetensors or pdparams,
            single file or sharded; see :mod:`.checkpoint`).
        config: the PaddleNLP config to build the model from (``AutoConfig``,
            with the run's edits; must name ``architectures``).
        dtype: the run's dtype (``float32``, ``bfloat16``, ``float16``): every
            non-quantized parameter is loaded in it (as ``from_pretrained(dtype=)``).
        quantization: None, or ``{"weight_quantize_algo", "weight_blocksize",
            "weight_double_quant", "weight_double_quant_block_size"}``.
        target_modules: layers to quantize (regexes, as ``quantize_model``);
            default: the family's decoder linears.
        logger: object with ``.info``/``.warning`` (default: this module's logger).
        max_seq_len: the longest sequence the caller will feed; a transformers-layout
            checkpoint whose sliding window is shorter is refused (see
            :func:`.hf_layout.config_problems`; None: any window is refused).
        model_class: the causal-LM class to build (default: what ``AutoModelForCausalLM`` picks for
            the config; the decoder's parity tests build our decoder for any row this way).

    Returns ``(model, stats)``; stats: ``quantized_layers``, ``params_quantized``,
    ``bytes_quantized`` (codes + scales), ``tensors_loaded``, ``files`` (names
    read), ``format``, ``load_seconds``, ``rss_before_bytes``, ``peak_rss_bytes``
    (process peak so far: VmHWM, or ``ru_maxrss`` off Linux).

    Raises :class:`CheckpointError` (a ``ValueError``) for a checkpoint that does
    not fit the model (names the tensor and file) and ``ValueError`` for
    quantization settings a target layer cannot take -- both before any tensor
    data is read when the format allows it (pdparams shapes are checked on arrival).
    """
    from ..integrations import lazy_init
    from .registration import register_decoder, register_qwen3
    from ..quant.formats import check_target_shape
    from .quantize import select_targets

    log = logger if logger is not None else _log
    t0, rss0 = time.perf_counter(), _rss()
    quant = check_quantization(quantization)
    ckpt = find_checkpoint(model_dir)
    if model_class is None:
        model_class, config = decoder_class_for(config, hf_layout=ckpt.hf_model_type is not None)
    # our decoder (models/decoder), or one pipeline stage of it (models/decoder/pipe.py)
    decoder = model_class is not None and (
        hasattr(model_class, "body_class") or getattr(model_class, "decoder_pipe", False)
    )
    if ckpt.hf_model_type is not None:
        check_hf_config(model_dir, config, max_seq_len, decoder=decoder)
        _routed_expert_bias(ckpt, config)
    if int(getattr(config, "tensor_parallel_degree", 1) or 1) > 1 and not decoder:
        raise ValueError(
            "load_model_streaming splits checkpoints for tensor parallelism only for our decoder's rows "
            f"(tensor_parallel_degree={config.tensor_parallel_degree}): load with from_pretrained"
        )
    if quant and int(getattr(config, "tensor_parallel_degree", 1) or 1) > 1:
        raise ValueError(
            "load_model_streaming quantizes no tensor-parallel shards: load in float, then "
            "models.quantize.quantize_model (each rank quantizes its own shard)"
        )
    if not getattr(config, "architectures", None):
        raise CheckpointError(
            f'the config of {model_dir} names no architectures (e.g. ["LlamaForCausalLM"]): '
            "AutoModelForCausalLM cannot choose the model class"
        )

    register_qwen3()  # our classes known to PaddleNLP's Auto classes, which build the skeleton
    register_decoder()
    model = lazy_init.lazy_skeleton(config, dtype, model_class)
    expected = dict(model.state_dict())
    for p in list(expected.values()):  # a pipeline stage's copy of a tied weight reads the tensor it copies
        source = getattr(p, "tied_from", None)
        if source and source not in expected:
            expected[source] = p
    groups: Dict[int, List[str]] = {}  # tied parameters: one entry, several keys
    for k, t in expected.items():
        groups.setdefault(id(t), []).append(k)
    ignore_missing, ignore_unexpected = lazy_init.ignored_key_patterns(model)
    if getattr(model_class, "decoder_pipe", False):  # one stage: the other stages' tensors are not read
        ignore_unexpected = ignore_unexpected + [r".*"]
    keymap = KeyMap(expected, getattr(model, "base_model_prefix", "") or "")

    targets: Dict[str, Any] = {}
    if quant:
        # the same rules as quantize_model (one definition): exact nn.Linear, family targets, TP refused
        targets, skipped = select_targets(model, target_modules)
        if skipped:
            log.info(f"load_model_streaming: not quantized (not a plain nn.Linear): {few_names(skipped)}")
        for name, lin in targets.items():  # every target, before reading anything
            check_target_shape(
                name,
                int(lin.weight.shape[0]),
                int(lin.weight.shape[1]),
                quant["weight_quantize_algo"],
                quant["weight_blocksize"],
            )
        if not targets:
            log.warning(f"load_model_streaming: no nn.Linear matched target_modules={target_modules}")
    target_of = {f"{name}.weight": name for name in targets}

    skip: set = set()
    if ckpt.names_known:
        precheck(ckpt, keymap, expected, groups, ignore_missing, ignore_unexpected, skip)

    place = _device_place() if quant else None
    stats: Dict[str, Any] = {
        "format": ckpt.fmt,
        "layout": "transformers" if ckpt.hf_model_type else "paddlenlp",
        "quantized_layers": 0,
        "params_quantized": 0,
        "bytes_quantized": 0,
        "tensors_loaded": 0,
        "files": [],
    }
    filled: Dict[int, str] = {}  # id(param) -> the key that filled it
    current, n_files = None, len(ckpt.files)
    for key, arr, path in iter_tensors(ckpt, skip):
        if path != current:
            if current is not None:
                log.info(
                    f"load_model_streaming: read {os.path.basename(current)} "
                    f"({len(stats['files'])}/{n_files}), rss {_rss() / 2**30:.2f} GiB"
                )
            current = path
            stats["files"].append(os.path.basename(path))
        mk = keymap(key)
        if mk is None:  # only for a single .pdparams (otherwise refused by precheck)
            if any(re.search(p, key) for p in ignore_unexpected):
                continue
            raise CheckpointError(f"checkpoint tensor {key!r} in {os.path.basename(path)} is not in the model")
        param = expected[mk]
        full_shape = getattr(param, "tp_full_shape", None)  # a tensor-parallel shard (parallel/layers.py)
        if full_shape is not None and tuple(arr.shape) == tuple(full_shape):
            arr = np.ascontiguousarray(param.tp_take(arr))  # this rank's part of the single-device tensor
        if tuple(arr.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor {key!r} in {os.path.basename(path)} has shape {list(arr.shape)}, but the model built from "
                f"config.json expects {list(param.shape)}"
            )
        stats["tensors_loaded"] += 1
        layer_name = target_of.pop(mk, None)
        if layer_name is not None:  # a target's weight: quantize it, replace the lazy Linear
            q = _quantized_layer(targets.pop(layer_name), arr, quant, place)
            del arr
            _replace(model, layer_name, q)
            stats["quantized_layers"] += 1
            stats["params_quantized"] += q.num_weight_params
            stats["bytes_quantized"] += q.quantized_nbytes()
            del q
        elif id(param) in filled:  # a tied parameter's second name (e.g. lm_head.weight = embed_tokens.weight)
            _check_tied_copy(param, arr, key, filled[id(param)], path)
        else:
            lazy_init.materialize(param, arr)
            del arr
        filled.setdefault(id(param), mk)
    if current is not None:
        log.info(
            f"load_model_streaming: read {os.path.basename(current)} ({len(stats['files'])}/{n_files}), "
            f"rss {_rss() / 2**30:.2f} GiB"
        )

    missing = [
        keys[0]
        for pid, keys in groups.items()
        if pid not in filled and not any(re.search(p, k) for k in keys for p in ignore_missing)
    ]
    if missing:
        raise CheckpointError(missing_message(missing, ckpt))
    lazy = lazy_init.lazy_tensors(model)
    if lazy:
        raise CheckpointError(f"after loading {model_dir}, {len(lazy)} model tensor(s) hold no data: {few_names(lazy)}")

    if model.can_generate() and os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        from paddlenlp.generation import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    stats["load_seconds"] = round(time.perf_counter() - t0, 3)
    stats["rss_before_bytes"] = rss0
    stats["peak_rss_bytes"] = _peak_rss()
    log.info(
        f"load_model_streaming: {stats['tensors_loaded']} tensors from {len(stats['files'])} {ckpt.fmt} file(s) in "
        f"{stats['load_seconds']:.1f}s as {dtype}"
        + (
            f", {quant['weight_quantize_algo']} quantized {stats['quantized_layers']} layers "
            f"({stats['bytes_quantized'] / 2**20:.1f} MiB)"
            if quant
            else ""
        )
        + f", peak rss {stats['peak_rss_bytes'] / 2**30:.2f} GiB"
    )
    return model, stats
