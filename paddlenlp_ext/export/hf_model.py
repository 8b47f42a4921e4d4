"""A PaddleNLP model directory -> transformers layout, streamed one tensor at a time.

``export_hf_model(model_dir, out_dir)`` reads any checkpoint the merge reader
reads (PaddleNLP or transformers layout; safetensors or pdparams; sharded or
not) and writes ``model.safetensors`` (or ``model-0000i-of-0000N.safetensors`` +
``model.safetensors.index.json``) with transformers' names
(``models.hf_layout.hf_name``): ``llama.layers.0.self_attn.q_proj.weight`` [in, out]
becomes ``model.layers.0.self_attn.q_proj.weight`` [out, in].  Untransposed
tensors are copied file to file in the kernel; a Linear weight is read, transposed
and handed to the writer thread, so memory stays at a few tensors.  Next to the
weights: config.json / generation_config.json (:mod:`.hf_config`) and the
tokenizer files, with a jinja chat template in tokenizer_config.json when the model has one.

``export_merged_hf`` merges an adapter with the verified streaming merge into a
temporary directory first, then exports that (two streaming passes; the
temporary directory is removed).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from ..merge.cli import check_paths
from ..merge.common import SAFE_WEIGHTS_INDEX_NAME, Log, fmt_bytes, parse_size
from ..merge.reader import BufferPool, Checkpoint, TensorEntry, TensorSource
from ..merge.writer import (
    SafetensorsStreamWriter,
    TOKENIZER_PATTERNS,
    make_temp_dir,
    plan_shards,
    publish,
    shard_file_names,
    write_json,
)
from ..models.hf_layout import hf_name, read_json_dict
from .hf_config import (
    TORCH_DTYPE,
    ExportError,
    ExportVerifyFailed,
    export_row,
    hf_config_from_paddle,
    hf_generation_config,
)

EXPORT_INFO_NAME = "export_info.json"


@dataclass
class ExportResult:
    output_dir: str
    weight_files: List[str]
    tensors: int
    transposed: int
    checkpoint_bytes: int
    seconds: float
    merge: Optional[Any] = None  # the MergeResult when an adapter was merged first


def _tied_decoder(hf_cfg: Dict[str, Any]) -> bool:
    """Whether ``hf_cfg`` is a decoder row with tied embeddings: our decoder's save_pretrained then also
    writes ``lm_head.weight`` (the shared embedding, [vocab, hidden]), which transformers does not read."""
    family = export_row(hf_cfg.get("model_type"))
    return bool(family and family.decoder and hf_cfg.get("tie_word_embeddings", family.arch.tie_default))


def _out_entries(ckpt: Checkpoint, model_type: str, tied_decoder: bool = False) -> List[tuple]:
    """[(source entry, output entry, transpose)] in checkpoint order; output entries carry HF names/shapes."""
    rows, seen = [], set()
    for ent in ckpt.entries:
        if tied_decoder and ent.name == "lm_head.weight":  # the embedding again (tied): not a tensor of its own
            continue
        name, transpose = hf_name(ent.name, model_type)
        if name in seen:
            raise ExportError(f"{ckpt.directory}: two tensors map to the transformers name {name!r}")
        seen.add(name)
        dtype = "BF16" if ent.dtype == "U16" else ent.dtype  # pdparams bf16 is read as raw uint16 bits
        shape = tuple(reversed(ent.shape)) if transpose else ent.shape
        out = dataclasses.replace(ent, name=name, dtype=dtype, shape=shape, transpose=False, source_name=None)
        rows.append((ent, out, transpose))
    return rows


def _torch_dtype(entries: List[TensorEntry]) -> str:
    """The dtype of the floating-point weights (the largest tensor's), as transformers names it."""
    floats = [e for e in entries if e.dtype in TORCH_DTYPE]
    if not floats:
        raise ExportError("the checkpoint has no floating-point tensors")
    return TORCH_DTYPE[max(floats, key=lambda e: e.nbytes).dtype]


def _copy_tokenizer(src_dirs: List[str], dst: str, log: Log) -> List[str]:
    """Copy the tokenizer files of the first directory that has any; put a ``chat_template.jinja``
    template into tokenizer_config.json (where transformers reads it)."""
    import fnmatch

    for d in src_dirs:
        names = sorted(
            n
            for n in os.listdir(d)
            if os.path.isfile(os.path.join(d, n)) and any(fnmatch.fnmatch(n, p) for p in TOKENIZER_PATTERNS)
        )
        if not names:
            continue
        for n in names:
            shutil.copy2(os.path.join(d, n), os.path.join(dst, n))
        tok_cfg = read_json_dict(os.path.join(dst, "tokenizer_config.json"), ExportError)
        # transformers' LlamaTokenizer looks for tokenizer.model; PaddleNLP's saves sentencepiece.bpe.model
        if (
            tok_cfg.get("tokenizer_class") == "LlamaTokenizer"
            and "tokenizer.model" not in names
            and "sentencepiece.bpe.model" in names
        ):
            shutil.copy2(os.path.join(d, "sentencepiece.bpe.model"), os.path.join(dst, "tokenizer.model"))
            names.append("tokenizer.model")
        jinja = os.path.join(d, "chat_template.jinja")
        if os.path.isfile(jinja) and "chat_template" not in tok_cfg:
            with open(jinja, encoding="utf-8") as f:
                tok_cfg["chat_template"] = f.read()
            write_json(os.path.join(dst, "tokenizer_config.json"), tok_cfg)
        if "chat_template.json" in names and "chat_template" not in tok_cfg:
            log(
                "[export] note: chat_template.json is PaddleNLP's own template format (system / conversation "
                "turns), which transformers does not read; the exported tokenizer has no chat template. Put a "
                "jinja template in chat_template.jinja next to the model to export one"
            )
        return names
    return []


def export_hf_model(
    model_dir: str,
    out_dir: str,
    *,
    max_shard_size="5GB",
    overwrite: bool = False,
    extra_dirs: Optional[List[str]] = None,
    log: Log = print,
) -> ExportResult:
    """Write ``model_dir`` (a complete model: config.json + weights) in transformers layout to ``out_dir``.

    ``extra_dirs``: where to look for tokenizer / generation config files the model
    directory lacks (e.g. the adapter directory).  Bad input raises :class:`ExportError`
    (or :class:`MergeError` from the checkpoint reader) before anything is written.
    """
    t0 = time.time()
    check_paths(model_dir, model_dir, out_dir, overwrite)
    cfg = read_json_dict(os.path.join(model_dir, "config.json"), ExportError)
    if not cfg:
        raise ExportError(f"{model_dir}: no config.json")
    ckpt = Checkpoint.open(model_dir)
    hf_cfg = hf_config_from_paddle(cfg, _torch_dtype(ckpt.entries))  # refuses an unsupported family first
    rows = _out_entries(ckpt, cfg["model_type"], _tied_decoder(hf_cfg))
    gen = read_json_dict(os.path.join(model_dir, "generation_config.json"), ExportError)
    for d in extra_dirs or []:
        gen = gen or read_json_dict(os.path.join(d, "generation_config.json"), ExportError)

    tmp = make_temp_dir(out_dir)
    try:
        files, transposed = _stream(ckpt, rows, tmp, parse_size(max_shard_size), log)
        write_json(os.path.join(tmp, "config.json"), hf_cfg)
        write_json(os.path.join(tmp, "generation_config.json"), hf_generation_config(gen, hf_cfg))
        tok = _copy_tokenizer([model_dir] + list(extra_dirs or []), tmp, log)
        if not tok:
            log(
                f"[export] note: no tokenizer files in {[model_dir] + list(extra_dirs or [])}; "
                "the output has weights and config only"
            )
        info = {
            "source": os.path.abspath(model_dir),
            "format": "transformers",
            "weight_files": files,
            "transposed_tensors": transposed,
            "torch_dtype": hf_cfg["torch_dtype"],
        }
        write_json(os.path.join(tmp, EXPORT_INFO_NAME), info)
        publish(tmp, out_dir)
    except BaseException:  # Ctrl-C included: never leave a half-written temp dir behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    res = ExportResult(out_dir, files, len(rows), transposed, ckpt.total_bytes, time.time() - t0)
    log(
        f"[export] {model_dir} -> {out_dir}: transformers {hf_cfg['architectures'][0]}, {res.tensors} tensors "
        f"({transposed} transposed), {fmt_bytes(res.checkpoint_bytes)}, {hf_cfg['torch_dtype']}, "
        f"{len(files)} file(s) in {res.seconds:.1f}s"
    )
    return res


def _stream(ckpt: Checkpoint, rows: List[tuple], out_dir: str, max_bytes: int, log: Log) -> tuple:
    """Write every tensor under its transformers name; returns (file names, number transposed)."""
    by_out = {o.name: (src, tr) for src, o, tr in rows}
    outs = [o for _, o, _ in rows]
    shards = plan_shards(outs, max_bytes)
    names = shard_file_names(len(shards), True)
    source = TensorSource(ckpt)
    pool = BufferPool(max_buffers=3)
    weight_map: Dict[str, str] = {}
    transposed = 0
    try:
        for shard, fname in zip(shards, names):
            writer = SafetensorsStreamWriter(os.path.join(out_dir, fname), shard, metadata={"format": "pt"})
            try:
                for out in writer.order:
                    src, tr = by_out[out.name]
                    weight_map[out.name] = fname
                    if not tr and ckpt.fmt == "safetensors" and not src.transpose:
                        writer.copy(dataclasses.replace(src, name=out.name))  # bytes as they are, in the kernel
                        source.skip(src)
                        continue
                    arr, buf = source.read(src, pool)  # Paddle orientation [in, out]
                    if tr:
                        t = np.ascontiguousarray(arr.T)  # [out, in], transformers' nn.Linear
                        if buf is not None:
                            pool.release(buf)
                        writer.write(out.name, t)
                        transposed += 1
                    else:
                        writer.write(out.name, arr, buf, pool.release if buf is not None else None)
                    del arr, buf
            except BaseException:
                writer.abort()
                raise
            writer.close()
    finally:
        source.close()
    if len(names) > 1:
        index = {
            "metadata": {"total_size": int(sum(o.nbytes for o in outs))},
            "weight_map": {o.name: weight_map[o.name] for o in outs},
        }
        write_json(os.path.join(out_dir, SAFE_WEIGHTS_INDEX_NAME), index)
        names = names + [SAFE_WEIGHTS_INDEX_NAME]
    return names, transposed


def export_merged_hf(
    base_dir: str,
    adapter_dir: str,
    out_dir: str,
    *,
    max_shard_size="5GB",
    overwrite: bool = False,
    log: Log = print,
    **merge_kwargs,
) -> ExportResult:
    """Merge ``adapter_dir`` into ``base_dir`` (the verified streaming merge, into a temporary
    directory next to ``out_dir``) and export the merged model in transformers layout.

    A failed verification stops before the export: the merged model is kept in
    ``<out_dir>.merged-unverified`` for inspection and :class:`ExportVerifyFailed` is raised.
    """
    from ..merge import merge_adapter_checkpoint

    check_paths(base_dir, adapter_dir, out_dir, overwrite)
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.paddle-merged-{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    try:
        merged = merge_adapter_checkpoint(
            base_dir, adapter_dir, tmp, max_shard_size=max_shard_size, log=log, **merge_kwargs
        )
        if merged.verify_failed:
            kept = os.path.abspath(out_dir) + ".merged-unverified"
            shutil.rmtree(kept, ignore_errors=True)
            os.rename(tmp, kept)
            raise ExportVerifyFailed(
                f"the merged model failed verification ({merged.verify}); nothing exported, "
                f"the merged model is kept in {kept}"
            )
        res = export_hf_model(
            tmp,
            out_dir,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            extra_dirs=[base_dir, adapter_dir],
            log=log,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info_path = os.path.join(out_dir, EXPORT_INFO_NAME)
    info = read_json_dict(info_path, ExportError)
    info.update(source=os.path.abspath(base_dir), adapter=os.path.abspath(adapter_dir), verify=merged.verify)
    write_json(info_path, info)
    res.merge = merged
    return res
