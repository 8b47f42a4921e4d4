"""Reading the base checkpoint: headers first, then one tensor at a time.

Owns: ``TensorEntry`` (one tensor's metadata; safetensors headers are parsed by
the loader's ``models.checkpoint.read_safetensors_header``), pdparams loading, ``Checkpoint.open`` (finds the weight layout of a
PaddleNLP model directory and lists every tensor without reading data),
``TensorSource`` (positioned reads into reusable buffers) and ``BufferPool``.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .common import (
    PADDLE_WEIGHTS_INDEX_NAME,
    PADDLE_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    MergeError,
)
from .dtypes import NP_OF_TAG, TAG_OF_NP


@dataclass
class TensorEntry:
    name: str
    file: str  # absolute path of the source file
    dtype: str  # safetensors tag (pdparams tensors are mapped onto tags; paddle bf16 -> "U16")
    shape: Tuple[int, ...]
    nbytes: int
    offset: int = -1  # absolute byte offset of the data (safetensors only)
    transpose: bool = False  # stored [out, in] (transformers' nn.Linear): ``shape`` is Paddle's [in, out]
    source_name: Optional[str] = None  # the name in the file when it differs (transformers layout)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def itemsize(self) -> int:
        return np.dtype(NP_OF_TAG[self.dtype]).itemsize


def _safetensors_entries(path: str) -> List[TensorEntry]:
    """Every tensor of a safetensors file in file order (so a shard is read front to back).

    The header is parsed and validated by the loader's parser (one parser in the project),
    with the merge's wider tag table.
    """
    from ..models.checkpoint import CheckpointError, read_safetensors_header

    try:
        infos = read_safetensors_header(path, tags=NP_OF_TAG)
    except CheckpointError as e:
        raise MergeError(str(e)) from None
    return [TensorEntry(t.name, path, t.dtype, t.shape, t.nbytes, t.offset) for t in infos]


def load_pdparams(path: str) -> Dict[str, np.ndarray]:
    """Whole pdparams file -> {name: numpy} (bf16 as uint16, like Tensor.numpy())."""
    import paddle

    state = paddle.load(path, return_numpy=True)
    if not isinstance(state, dict):
        raise MergeError(f"{path}: expected a state dict, got {type(state).__name__}")
    out = {}
    for k, v in state.items():
        arr = v.numpy() if hasattr(v, "numpy") else np.asarray(v)
        out[k] = arr
    return out


def _pdparams_entries(path: str) -> List[TensorEntry]:
    state = load_pdparams(path)
    out = []
    for k, v in state.items():
        tag = TAG_OF_NP.get(v.dtype)
        if tag is None:
            raise MergeError(f"{path}: tensor {k!r} has unsupported dtype {v.dtype}")
        out.append(TensorEntry(k, path, tag, tuple(int(s) for s in v.shape), int(v.nbytes)))
    del state
    return out


def _index_files(path: str, d: str) -> Tuple[List[str], Dict[str, str]]:
    """(sorted shard paths, weight_map) of the checkpoint index ``path`` in directory ``d``."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            index_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise MergeError(f"{path}: not a valid checkpoint index ({e})") from None
    files, seen = [], set()
    for fname in index_map.values():
        if fname not in seen:
            seen.add(fname)
            files.append(os.path.join(d, fname))
    files.sort()
    missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
    if missing:
        raise MergeError(f"{path} lists shard files that do not exist in {d}: {missing}")
    return files, index_map


@dataclass
class Checkpoint:
    """A PaddleNLP model directory's weights: format, files and every tensor's metadata."""

    directory: str
    fmt: str  # "safetensors" | "pdparams"
    files: List[str]
    entries: List[TensorEntry]
    index_file: Optional[str] = None

    @property
    def hf_layout(self) -> bool:
        """Whether the files are in transformers layout (entries renamed, Linear weights transposed on read)."""
        return any(e.source_name is not None for e in self.entries)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def file_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)

    @classmethod
    def open(cls, directory: str) -> "Checkpoint":
        d = directory
        # the order PaddleNLP's from_pretrained prefers them in
        candidates = [
            ("safetensors", SAFE_WEIGHTS_INDEX_NAME, True),
            ("safetensors", SAFE_WEIGHTS_NAME, False),
            ("pdparams", PADDLE_WEIGHTS_INDEX_NAME, True),
            ("pdparams", PADDLE_WEIGHTS_NAME, False),
        ]
        for fmt, name, is_index in candidates:
            path = os.path.join(d, name)
            if not os.path.isfile(path):
                continue
            if not is_index:
                files = [path]
                index_map = None
            else:
                files, index_map = _index_files(path, d)
            reader = _safetensors_entries if fmt == "safetensors" else _pdparams_entries
            entries: List[TensorEntry] = []
            where: Dict[str, str] = {}
            for fpath in files:
                for ent in reader(fpath):
                    if ent.name in where:
                        raise MergeError(
                            f"tensor {ent.name!r} appears in two checkpoint files: "
                            f"{os.path.basename(where[ent.name])} and {os.path.basename(fpath)}"
                        )
                    where[ent.name] = fpath
                    entries.append(ent)
            if index_map is not None:
                bad = [k for k, fname in index_map.items() if where.get(k) != os.path.join(d, fname)]
                if bad:
                    raise MergeError(
                        f"{path} does not match the shard files: {len(bad)} tensors are missing from the shard "
                        f"the index names, e.g. {bad[:5]}"
                    )
            if not entries:
                raise MergeError(f"{path}: the checkpoint holds no tensors")
            if fmt == "safetensors":
                entries = _to_paddle_layout(d, entries)
            return cls(d, fmt, files, entries, path if is_index else None)
        raise MergeError(
            f"no model weights found in {d}: expected one of {SAFE_WEIGHTS_INDEX_NAME}, {SAFE_WEIGHTS_NAME}, "
            f"{PADDLE_WEIGHTS_INDEX_NAME}, {PADDLE_WEIGHTS_NAME}"
        )


def _to_paddle_layout(d: str, entries: List[TensorEntry]) -> List[TensorEntry]:
    """A transformers-layout checkpoint's entries under PaddleNLP's names and shapes (transposed on read);
    PaddleNLP-layout entries unchanged.  The merged model is written in PaddleNLP's layout."""
    from ..models import hf_layout

    try:
        model_type = hf_layout.detect_layout([e.name for e in entries], hf_layout.read_config_json(d), where=d)
    except hf_layout.HFLayoutError as e:
        raise MergeError(str(e)) from None
    if model_type is None:
        return entries
    out = []
    for e in entries:
        name, transpose = hf_layout.paddle_name(e.name, model_type)
        transpose = transpose and len(e.shape) == 2
        out.append(
            TensorEntry(
                name,
                e.file,
                e.dtype,
                hf_layout.converted_shape(e.shape, transpose),
                e.nbytes,
                e.offset,
                transpose=transpose,
                source_name=e.name,
            )
        )
    return out


class BufferPool:
    """Reusable byte buffers for the tensors in flight (read -> merged in place -> queued ->
    written).  Re-using them avoids page-faulting and zero-filling fresh memory for every
    tensor.  At most ``max_buffers`` are kept: when a bigger buffer is needed and only
    smaller ones are free, a free one is dropped first."""

    def __init__(self, max_buffers: int):
        self.max_buffers = max(1, int(max_buffers))
        self._free: List[np.ndarray] = []
        self._count = 0
        # the writer thread releases buffers while the main thread acquires them
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` (1-D); the smallest free one that fits."""
        with self._lock:  # (indices, not list.remove: arrays compare element-wise)
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
            if self._free and self._count >= self.max_buffers:
                self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].nbytes))
                self._count -= 1
            self._count += 1
        return np.empty(max(int(nbytes), 1), dtype=np.uint8)

    def release(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)


class TensorSource:
    """Reads tensors of a Checkpoint one at a time; a file is opened on first use and
    released as soon as all of its tensors have been read (``release``)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.remaining: Dict[str, int] = {}
        for e in ckpt.entries:
            self.remaining[e.file] = self.remaining.get(e.file, 0) + 1
        self._open: Dict[str, Any] = {}

    def read(self, ent: TensorEntry, pool: Optional[BufferPool] = None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """(array, pooled buffer or None): the tensor's data (raw uint16 for bf16), in a
        buffer from ``pool`` when given (the caller returns it to the pool)."""
        buf = None
        if self.ckpt.fmt == "pdparams":
            state = self._open.get(ent.file)
            if state is None:
                state = self._open[ent.file] = load_pdparams(ent.file)
            arr = state.pop(ent.name)
            if tuple(arr.shape) != ent.shape:
                raise MergeError(f"{ent.file}: tensor {ent.name!r} changed shape between reads")
        else:
            # One positioned read straight into a numpy buffer (offsets from the validated header):
            # no mmap, so no mapped pages of the shard pile up in RSS; about twice as fast as
            # safe_open(...).get_tensor (mmap + copy); and it works for BF16, which numpy lacks.
            f = self._open.get(ent.file)
            if f is None:
                f = self._open[ent.file] = open(ent.file, "rb", buffering=0)
            dt = np.dtype(NP_OF_TAG[ent.dtype])
            # transformers' Linear weight: read as stored ([out, in]) into a fresh array, then transposed
            # into the (pooled) destination as ent.shape ([in, out])
            stored = np.empty(ent.shape[::-1], dtype=dt) if ent.transpose else None
            if pool is not None:
                buf = pool.acquire(ent.nbytes)
                arr = buf[: ent.nbytes].view(dt).reshape(ent.shape)  # a view of the pooled bytes: ent.shape
            else:
                arr = np.empty(ent.shape, dtype=dt)
            view = memoryview((stored if stored is not None else arr).reshape(-1)).cast("B")
            got = 0
            while got < ent.nbytes:
                n = os.preadv(f.fileno(), [view[got:]], ent.offset + got)
                if n <= 0:
                    raise MergeError(f"{ent.file}: short read for tensor {ent.name!r} (truncated file?)")
                got += n
            if stored is not None:
                np.copyto(arr, stored.T)
                del stored
        self.skip(ent)
        return arr, buf

    def skip(self, ent: TensorEntry) -> None:
        """Count ``ent`` as consumed (closing its file after the last one) without reading it."""
        self.remaining[ent.file] -= 1
        if self.remaining[ent.file] == 0:
            self._close(ent.file)

    def _close(self, path: str) -> None:
        h = self._open.pop(path, None)
        if h is not None and hasattr(h, "close"):
            h.close()
        del h  # refcounting frees a pdparams dict; no gc.collect (slow once paddle is loaded)

    def close(self) -> None:
        for p in list(self._open):
            self._close(p)
