"""Streaming, verified merge of a saved adapter into its base checkpoint.

``merge_adapter_checkpoint(base_dir, adapter_dir, output_dir, ...)`` writes a
complete PaddleNLP model directory whose weights are

    merged[module.weight] = base[module.weight] + compute_delta(...)

for every adapted module (LoRA, rsLoRA, LoRA+, PiSSA, VeRA and QLoRA adapters,
see ``docs/merge.md``); every other tensor is copied byte for byte.

Streaming: tensor metadata comes from the checkpoint headers, so the output
shards are planned before any data is read.  Each adapted weight is then read
with one positioned read into a reusable buffer, merged in place (fp32
arithmetic, in cache-sized row blocks) and handed to a writer thread; untouched
tensors are copied file-to-file in the kernel (``os.copy_file_range``).  Peak
memory is the adapter plus about three of the largest tensors, never a shard
and never the whole model (pdparams are the exception: paddle.load reads a
whole file).

Layout of the result: the same as PaddleNLP's ``save_pretrained``
(``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` +
``model.safetensors.index.json``, or the ``model_state*.pdparams`` equivalents),
plus config / generation config / tokenizer files and ``merge_info.json``.

The merge builds no model (``compute_delta`` is numpy, although its module
imports paddle); paddlenlp models are only loaded by ``verify``.

Modules (each owns one job):

    common    file names, MergeError, parse_size
    dtypes    safetensors dtype tags, bfloat16 <-> float32 bits
    reader    checkpoint headers, Checkpoint, TensorSource, BufferPool
    formats   AdapterBundle, adapter-vs-base and model_type checks
    delta     add_delta_inplace (the merge arithmetic), merge_dtype
    writer    shard plan, SafetensorsStreamWriter, temp dir + atomic publish
    verify    verify_merge (logits of merged vs base + adapter)
    cli       exit codes, --device / --tolerance / output-path checks
    pipeline  merge_adapter_checkpoint, MergeResult
"""

from .cli import EXIT_ERROR, EXIT_OK, EXIT_VERIFY_FAILED, report_merge, resolve_device
from .common import (
    MERGE_INFO_NAME,
    MODEL_CONFIG_NAME,
    PADDLE_WEIGHTS_INDEX_NAME,
    PADDLE_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    VERIFY_FAILED_MARKER,
    Log,
    MergeError,
    parse_size,
)
from .delta import CHUNK_ELEMENTS, MERGE_THREADS, add_delta_inplace, merge_dtype
from .dtypes import bf16_bits_to_f32, f32_to_bf16_bits, from_f32, to_f32
from .formats import AdapterBundle, check_adapter_against_base, check_model_type
from .checkpoint_merge import MergeResult, merge_adapter_checkpoint
from .reader import BufferPool, Checkpoint, TensorEntry, TensorSource
from .verify import DEFAULT_TOLERANCE, estimate_verify_bytes, probe_inputs, verify_merge
from .writer import MODEL_FILES, TOKENIZER_PATTERNS, SafetensorsStreamWriter, plan_shards, shard_file_names

__all__ = [
    "AdapterBundle",
    "BufferPool",
    "CHUNK_ELEMENTS",
    "Checkpoint",
    "DEFAULT_TOLERANCE",
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_VERIFY_FAILED",
    "Log",
    "MERGE_INFO_NAME",
    "MERGE_THREADS",
    "MODEL_CONFIG_NAME",
    "MODEL_FILES",
    "MergeError",
    "MergeResult",
    "PADDLE_WEIGHTS_INDEX_NAME",
    "PADDLE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SafetensorsStreamWriter",
    "TOKENIZER_PATTERNS",
    "TensorEntry",
    "TensorSource",
    "VERIFY_FAILED_MARKER",
    "add_delta_inplace",
    "report_merge",
    "bf16_bits_to_f32",
    "check_adapter_against_base",
    "check_model_type",
    "estimate_verify_bytes",
    "f32_to_bf16_bits",
    "from_f32",
    "merge_adapter_checkpoint",
    "merge_dtype",
    "parse_size",
    "plan_shards",
    "probe_inputs",
    "resolve_device",
    "shard_file_names",
    "to_f32",
    "verify_merge",
]
