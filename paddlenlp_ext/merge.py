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
"""

from __future__ import annotations

import fnmatch
import gc
import json
import os
import re
import shutil
import struct
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .adapters.config import CONFIG_NAME as ADAPTER_CONFIG_NAME
from .adapters.config import WEIGHTS_NAME as ADAPTER_WEIGHTS_NAME
from .adapters.config import AdapterConfig

# PaddleNLP file names (paddlenlp.utils.env)
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PADDLE_WEIGHTS_NAME = "model_state.pdparams"
PADDLE_WEIGHTS_INDEX_NAME = "model_state.pdparams.index.json"
MODEL_CONFIG_NAME = "config.json"

VERIFY_FAILED_MARKER = "MERGE_VERIFY_FAILED"
MERGE_INFO_NAME = "merge_info.json"

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_VERIFY_FAILED = 3

#: default --tolerance by the dtype of the merged weights (relative logit error,
#: see ``verify_merge``): fp32 is exact up to fp32 summation order; bf16/fp16
#: round the merged weight once, which moves logits by ~1e-3..1e-2.
DEFAULT_TOLERANCE = {"float64": 1e-4, "float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}

#: non-weight files copied from the base model (tokenizer group falls back to the adapter dir)
MODEL_FILES = ("config.json", "generation_config.json")
TOKENIZER_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "*.model", "vocab*", "merges.txt",
    "chat_template*", "spiece.model", "sentencepiece*",
)


class MergeError(Exception):
    """A problem with the inputs or the output location (nothing is written)."""


Log = Callable[[str], None]


# ------------------------------------------------------------------ dtypes
# safetensors dtype tag -> numpy dtype used to hold the raw data
_NP_OF_TAG = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
}
_TAG_OF_NP = {np.dtype(v): k for k, v in _NP_OF_TAG.items() if k not in ("BF16", "F8_E4M3", "F8_E5M2")}
#: tags that hold floating-point weights an adapter delta can be added to.  "U16" is
#: PaddleNLP's bfloat16: paddle's ``Tensor.numpy()`` returns bf16 as uint16, and
#: ``save_pretrained`` writes it with the safetensors tag U16 (paddle.to_tensor of
#: a uint16 array is bfloat16 again).
_FLOAT_TAGS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "U16": "bfloat16"}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 stored as uint16 -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even (as paddle's cast); NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    out = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def to_f32(arr: np.ndarray, tag: str) -> np.ndarray:
    return bf16_bits_to_f32(arr) if _FLOAT_TAGS.get(tag) == "bfloat16" else np.asarray(arr, dtype=np.float32)


def from_f32(x: np.ndarray, tag: str) -> np.ndarray:
    kind = _FLOAT_TAGS[tag]
    if kind == "bfloat16":
        return f32_to_bf16_bits(x)
    return np.asarray(x, dtype=np.dtype(kind))


def parse_size(size) -> int:
    """``"1GB"`` -> 10**9, ``"500MiB"`` -> 500 * 2**20, ints pass through (PaddleNLP's convention)."""
    if isinstance(size, (int, np.integer)):
        return int(size)
    s = str(size).strip().upper().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]I?B|B)?", s)
    if not m:
        raise MergeError(f"max_shard_size: cannot parse {size!r} (examples: 1GB, 500MB, 2GiB, 1000000)")
    num, unit = float(m.group(1)), m.group(2) or "B"
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    n = int(num * mult)
    if n <= 0:
        raise MergeError(f"max_shard_size must be positive, got {size!r}")
    return n


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024.0
    return f"{n:.1f} TiB"


# --------------------------------------------------------- reading checkpoints
@dataclass
class TensorEntry:
    name: str
    file: str  # absolute path of the source file
    dtype: str  # safetensors tag (pdparams tensors are mapped onto tags; paddle bf16 -> "U16")
    shape: Tuple[int, ...]
    nbytes: int
    offset: int = -1  # absolute byte offset of the data (safetensors only)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def itemsize(self) -> int:
        return np.dtype(_NP_OF_TAG[self.dtype]).itemsize


def read_safetensors_header(path: str) -> Tuple[Dict[str, Any], int]:
    """(header dict, data start offset) of a safetensors file, validated against the file size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise MergeError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 * 2**20):
            raise MergeError(f"{path}: not a safetensors file (bad header length {n})")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MergeError(f"{path}: corrupt safetensors header: {e}") from None
    start = 8 + n
    for k, v in header.items():
        if k == "__metadata__":
            continue
        b, e = v["data_offsets"]
        if v["dtype"] not in _NP_OF_TAG:
            raise MergeError(f"{path}: tensor {k!r} has unsupported dtype {v['dtype']}")
        if not (0 <= b <= e and start + e <= size):
            raise MergeError(f"{path}: tensor {k!r} lies outside the file (truncated checkpoint?)")
    return header, start


def _safetensors_entries(path: str) -> List[TensorEntry]:
    header, start = read_safetensors_header(path)
    items = [(k, v) for k, v in header.items() if k != "__metadata__"]
    items.sort(key=lambda kv: kv[1]["data_offsets"][0])
    out = []
    for k, v in items:
        b, e = v["data_offsets"]
        shape = tuple(int(s) for s in v["shape"])
        ent = TensorEntry(k, path, v["dtype"], shape, int(e - b), start + int(b))
        if ent.numel * ent.itemsize != ent.nbytes:
            raise MergeError(f"{path}: tensor {k!r} byte size {ent.nbytes} does not match shape {list(shape)}")
        out.append(ent)
    return out


def _load_pdparams(path: str) -> Dict[str, np.ndarray]:
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
    state = _load_pdparams(path)
    out = []
    for k, v in state.items():
        tag = _TAG_OF_NP.get(v.dtype)
        if tag is None:
            raise MergeError(f"{path}: tensor {k!r} has unsupported dtype {v.dtype}")
        out.append(TensorEntry(k, path, tag, tuple(int(s) for s in v.shape), int(v.nbytes)))
    del state
    return out


@dataclass
class Checkpoint:
    """A PaddleNLP model directory's weights: format, files and every tensor's metadata."""

    directory: str
    fmt: str  # "safetensors" | "pdparams"
    files: List[str]
    entries: List[TensorEntry]
    index_file: Optional[str] = None

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def file_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)

    @classmethod
    def open(cls, directory: str) -> "Checkpoint":
        d = directory
        candidates = [
            ("safetensors", SAFE_WEIGHTS_INDEX_NAME, True), ("safetensors", SAFE_WEIGHTS_NAME, False),
            ("pdparams", PADDLE_WEIGHTS_INDEX_NAME, True), ("pdparams", PADDLE_WEIGHTS_NAME, False),
        ]
        for fmt, name, is_index in candidates:
            path = os.path.join(d, name)
            if not os.path.isfile(path):
                continue
            if not is_index:
                files = [path]
                index_map = None
            else:
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
            return cls(d, fmt, files, entries, path if is_index else None)
        raise MergeError(
            f"no model weights found in {d}: expected one of {SAFE_WEIGHTS_INDEX_NAME}, {SAFE_WEIGHTS_NAME}, "
            f"{PADDLE_WEIGHTS_INDEX_NAME}, {PADDLE_WEIGHTS_NAME}"
        )


class TensorSource:
    """Reads tensors of a Checkpoint one at a time; a file is opened on first use and
    released as soon as all of its tensors have been read (``release``)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.remaining: Dict[str, int] = {}
        for e in ckpt.entries:
            self.remaining[e.file] = self.remaining.get(e.file, 0) + 1
        self._open: Dict[str, Any] = {}

    def read(self, ent: TensorEntry, pool: Optional["BufferPool"] = None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """(array, pooled buffer or None): the tensor's data (raw uint16 for bf16), in a
        buffer from ``pool`` when given (the caller returns it to the pool)."""
        buf = None
        if self.ckpt.fmt == "pdparams":
            state = self._open.get(ent.file)
            if state is None:
                state = self._open[ent.file] = _load_pdparams(ent.file)
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
            dt = np.dtype(_NP_OF_TAG[ent.dtype])
            if pool is not None:
                buf = pool.acquire(ent.nbytes)
                arr = buf[: ent.nbytes].view(dt).reshape(ent.shape)
            else:
                arr = np.empty(ent.shape, dtype=dt)
            view = memoryview(arr.reshape(-1)).cast("B")
            got = 0
            while got < ent.nbytes:
                n = os.preadv(f.fileno(), [view[got:]], ent.offset + got)
                if n <= 0:
                    raise MergeError(f"{ent.file}: short read for tensor {ent.name!r} (truncated file?)")
                got += n
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


# ---------------------------------------------------------- writing checkpoints
def plan_shards(entries: List[TensorEntry], max_shard_size: int) -> List[List[TensorEntry]]:
    """PaddleNLP's ``shard_checkpoint`` rule: walk the tensors in order, start a new
    shard when the next one would exceed the limit (a bigger tensor gets its own)."""
    shards: List[List[TensorEntry]] = []
    cur: List[TensorEntry] = []
    size = 0
    for e in entries:
        if cur and size + e.nbytes > max_shard_size:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur:
        shards.append(cur)
    return shards


def shard_file_names(n: int, safe: bool) -> List[str]:
    base = SAFE_WEIGHTS_NAME if safe else PADDLE_WEIGHTS_NAME
    if n == 1:
        return [base]
    stem, ext = os.path.splitext(base)
    return [f"{stem}-{i + 1:05d}-of-{n:05d}{ext}" for i in range(n)]


class BufferPool:
    """Reusable byte buffers for the tensors in flight (read -> merged in place -> queued ->
    written).  Re-using them avoids page-faulting and zero-filling fresh memory for every
    tensor.  At most ``max_buffers`` are kept: when a bigger buffer is needed and only
    smaller ones are free, a free one is dropped first."""

    def __init__(self, max_buffers: int):
        import threading

        self.max_buffers = max(1, int(max_buffers))
        self._free: List[np.ndarray] = []
        self._count = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> np.ndarray:
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


class SafetensorsStreamWriter:
    """Writes one safetensors file tensor by tensor: the header is built from the
    planned (name, dtype, shape) list, then each tensor's bytes are appended as it
    is produced.  Tensors are laid out largest-itemsize first (as
    ``safetensors.save_file`` does) so every tensor is aligned.

    A background thread does the writing, fed through a queue of at most
    ``queue_size`` jobs, so the next tensor is read and merged while the previous one
    is written (file I/O releases the GIL, and so do numpy's matmul and large
    element-wise ops).  A job is either an array (``write``; its pooled buffer is
    released after writing) or a byte range of a source file (``copy``), which is
    copied in the kernel with ``os.copy_file_range`` and never enters Python memory."""

    def __init__(self, path: str, entries: List[TensorEntry], metadata: Optional[Dict[str, str]] = None,
                 queue_size: int = 1):
        import queue
        import threading

        self.path = path
        self.order = sorted(entries, key=lambda e: (-e.itemsize, e.name))
        header: Dict[str, Any] = {"__metadata__": dict(metadata or {"format": "np"})}
        off = 0
        for e in self.order:
            header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
            off += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.expected_size = 8 + len(raw) + off
        self._f = open(path, "wb", buffering=0)
        self._write_all(struct.pack("<Q", len(raw)) + raw)
        self._next = 0
        self._error: Optional[BaseException] = None
        self._src_fds: Dict[str, Any] = {}
        self._q: "queue.Queue" = queue.Queue(maxsize=max(1, queue_size))
        self._thread = threading.Thread(target=self._drain, name="safetensors-writer", daemon=True)
        self._thread.start()

    # -- writer thread
    def _write_all(self, data) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += self._f.write(view[done:])

    def _copy_range(self, src: str, offset: int, nbytes: int) -> None:
        f = self._src_fds.get(src)
        if f is None:
            f = self._src_fds[src] = open(src, "rb", buffering=0)
        global _COPY_FILE_RANGE_OK
        while nbytes > 0 and _COPY_FILE_RANGE_OK:
            try:
                n = os.copy_file_range(f.fileno(), self._f.fileno(), min(nbytes, 1 << 30), offset)
            except (OSError, AttributeError):  # old kernel / other filesystem: plain reads and writes
                _COPY_FILE_RANGE_OK = False
                break
            if n <= 0:
                raise OSError(f"{src}: copy_file_range returned {n} with {nbytes} bytes left")
            offset += n
            nbytes -= n
        chunk = bytearray(min(nbytes, 64 << 20))
        while nbytes > 0:
            n = os.preadv(f.fileno(), [memoryview(chunk)[: min(nbytes, len(chunk))]], offset)
            if n <= 0:
                raise OSError(f"{src}: short read at offset {offset}")
            self._write_all(memoryview(chunk)[:n])
            offset += n
            nbytes -= n

    def _drain(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            kind, a, b, c = job
            try:
                if self._error is None:
                    if kind == "array":
                        self._write_all(a.reshape(-1))
                    else:
                        self._copy_range(a, b, c)
            except BaseException as e:  # surfaced by the next write() / close()
                self._error = e
            finally:
                if kind == "array" and c is not None:
                    c(b)  # release the pooled buffer

    # -- producer side
    def _check(self) -> None:
        if self._error is not None:
            raise MergeError(f"writing {self.path} failed: {self._error}") from self._error

    def _expect(self, name: str, shape, nbytes: int) -> None:
        self._check()
        e = self.order[self._next]
        if e.name != name:
            raise RuntimeError(f"writer expected tensor {e.name!r}, got {name!r}")
        if nbytes != e.nbytes or tuple(shape) != e.shape:
            raise RuntimeError(f"tensor {name!r}: {tuple(shape)}/{nbytes} bytes, planned {e.shape}/{e.nbytes}")
        self._next += 1

    def write(self, name: str, arr: np.ndarray, buffer: Optional[np.ndarray] = None,
              release: Optional[Callable[[np.ndarray], None]] = None) -> None:
        """Queue ``arr``; ``release(buffer)`` is called once it is written."""
        arr = np.ascontiguousarray(arr)
        self._expect(name, arr.shape, arr.nbytes)
        if arr.nbytes:
            self._q.put(("array", arr, buffer, release))
        elif release is not None:
            release(buffer)

    def copy(self, ent: TensorEntry) -> None:
        """Queue a verbatim copy of ``ent``'s bytes from its (safetensors) source file."""
        self._expect(ent.name, ent.shape, ent.nbytes)
        if ent.nbytes:
            self._q.put(("copy", ent.file, ent.offset, ent.nbytes))

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        for f in self._src_fds.values():
            f.close()
        self._src_fds.clear()

    def close(self) -> None:
        self._stop()
        self._f.close()
        self._check()
        if self._next != len(self.order):
            raise RuntimeError(f"{self.path}: {len(self.order) - self._next} planned tensors were not written")
        if os.path.getsize(self.path) != self.expected_size:
            raise MergeError(f"{self.path}: {os.path.getsize(self.path)} bytes written, expected {self.expected_size}")

    def abort(self) -> None:
        self._error = self._error or RuntimeError("aborted")
        self._stop()
        if not self._f.closed:
            self._f.close()


_COPY_FILE_RANGE_OK = hasattr(os, "copy_file_range")


def _to_paddle(arr: np.ndarray, tag: str):
    import paddle

    t = paddle.to_tensor(arr, place=paddle.CPUPlace())  # a uint16 array becomes bfloat16 (paddle's convention)
    return t


# ------------------------------------------------------------------ adapters
@dataclass
class AdapterBundle:
    directory: str
    config: AdapterConfig
    modules: Dict[str, Dict[str, np.ndarray]]  # module -> {suffix: array}
    nbytes: int

    @classmethod
    def open(cls, directory: str) -> "AdapterBundle":
        from safetensors.numpy import load_file

        if not os.path.isdir(directory):
            raise MergeError(f"adapter directory {directory} does not exist")
        missing = [n for n in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME) if not os.path.isfile(os.path.join(directory, n))]
        if missing:
            extra = ""
            if os.path.isfile(os.path.join(directory, "lora_config.json")):
                extra = " (this looks like a PaddleNLP lora_config.json/lora_model_state.pdparams adapter, " \
                        "which this tool does not read)"
            raise MergeError(f"adapter directory {directory} lacks {missing}{extra}")
        try:
            config = AdapterConfig.load(directory)
        except ValueError as e:
            raise MergeError(f"{os.path.join(directory, ADAPTER_CONFIG_NAME)}: {e}") from None
        try:
            tensors = load_file(os.path.join(directory, ADAPTER_WEIGHTS_NAME))
        except Exception as e:  # safetensors raises SafetensorError / OSError
            raise MergeError(f"cannot read {os.path.join(directory, ADAPTER_WEIGHTS_NAME)}: {e}") from None
        if not tensors:
            raise MergeError(f"{os.path.join(directory, ADAPTER_WEIGHTS_NAME)} holds no tensors")
        modules: Dict[str, Dict[str, np.ndarray]] = {}
        for k, v in tensors.items():
            if "." not in k:
                raise MergeError(f"adapter tensor key {k!r} is not of the form '<module>.<suffix>'")
            mod, suffix = k.rsplit(".", 1)
            modules.setdefault(mod, {})[suffix] = v
        return cls(directory, config, modules, sum(int(v.nbytes) for v in tensors.values()))


def _expected_adapter_shapes(cfg: AdapterConfig, in_f: int, out_f: int) -> Dict[str, Tuple[int, ...]]:
    r = cfg.r
    if cfg.layer_type == "vera":
        return {"vera_d": (r,), "vera_b": (out_f,)}
    shapes = {"lora_A": (in_f, r), "lora_B": (r, out_f)}
    if cfg.layer_type == "pissa":
        shapes.update(pissa_A0=(in_f, r), pissa_B0=(r, out_f))
    return shapes


def check_adapter_against_base(bundle: AdapterBundle, ckpt: Checkpoint) -> Dict[str, TensorEntry]:
    """{module: base weight entry} after checking every module exists, is a 2-D float
    weight and every adapter tensor has the shape the base weight implies.
    Raises MergeError listing all problems."""
    from .adapters.api import layer_class

    cfg = bundle.config
    suffixes = set(layer_class(cfg).state_suffixes)
    by_name = {e.name: e for e in ckpt.entries}
    targets: Dict[str, TensorEntry] = {}
    missing, problems = [], []
    for mod in sorted(bundle.modules):
        got = bundle.modules[mod]
        key = f"{mod}.weight"
        ent = by_name.get(key)
        if ent is None:
            missing.append(key)
            continue
        if set(got) != suffixes:
            problems.append(f"{mod}: adapter tensors {sorted(got)}, a {cfg.layer_type} adapter needs {sorted(suffixes)}")
            continue
        if len(ent.shape) != 2:
            problems.append(f"{key}: base tensor has shape {list(ent.shape)}, expected a 2-D [in, out] Linear weight")
            continue
        if ent.dtype not in _FLOAT_TAGS:
            problems.append(f"{key}: base tensor has dtype {ent.dtype}, not a floating-point weight")
            continue
        in_f, out_f = ent.shape
        for suffix, want in _expected_adapter_shapes(cfg, in_f, out_f).items():
            have = tuple(int(s) for s in got[suffix].shape)
            if have != want:
                problems.append(
                    f"{mod}.{suffix}: shape {list(have)} does not fit the base weight {key} of shape "
                    f"{list(ent.shape)} (expected {list(want)})"
                )
        if cfg.layer_type == "vera" and (
            cfg.vera_max_in is None or cfg.vera_max_out is None or in_f > cfg.vera_max_in or out_f > cfg.vera_max_out
        ):
            problems.append(f"{mod}: base weight {list(ent.shape)} exceeds vera_max_in/out "
                            f"[{cfg.vera_max_in}, {cfg.vera_max_out}] of the adapter config")
        targets[mod] = ent
    if missing:
        sample = [e.name for e in ckpt.entries[:6]]
        raise MergeError(
            f"{len(missing)} adapter module(s) have no weight in the base checkpoint {ckpt.directory}: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}. Base tensors look like {sample}. "
            "Is this adapter for a different model?"
        )
    if problems:
        raise MergeError(
            f"adapter {bundle.directory} does not match the base checkpoint {ckpt.directory} "
            f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
        )
    return targets


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise MergeError(f"{path} is not valid JSON: {e}") from None


def check_model_type(base_dir: str, adapter_dir: str, cfg: AdapterConfig, log: Log) -> Dict[str, Any]:
    base_cfg = _read_json(os.path.join(base_dir, MODEL_CONFIG_NAME))
    if base_cfg is None:
        raise MergeError(f"{base_dir} has no {MODEL_CONFIG_NAME}; the merged model needs the base model's config")
    base_type = base_cfg.get("model_type")
    ad_cfg = _read_json(os.path.join(adapter_dir, MODEL_CONFIG_NAME))
    seen = []
    if ad_cfg is not None and ad_cfg.get("model_type") is not None:
        seen.append((os.path.join(adapter_dir, MODEL_CONFIG_NAME), ad_cfg.get("model_type")))
    if cfg.model_type:
        seen.append((os.path.join(adapter_dir, ADAPTER_CONFIG_NAME), cfg.model_type))
    for where, t in seen:
        if base_type is not None and t != base_type:
            raise MergeError(
                f"model_type mismatch: the adapter was trained on a {t!r} model ({where}) but the base model is "
                f"{base_type!r} ({os.path.join(base_dir, MODEL_CONFIG_NAME)})"
            )
    if not seen:
        log(f"[merge] note: {adapter_dir} has no config.json; model_type not cross-checked")
    if ad_cfg is not None:
        diffs = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")
                 if k in ad_cfg and k in base_cfg and ad_cfg[k] != base_cfg[k]]
        if diffs:
            raise MergeError(
                "the adapter's config.json and the base config.json disagree on "
                + ", ".join(f"{k} ({ad_cfg[k]} vs {base_cfg[k]})" for k in diffs)
            )
    return base_cfg


def _copy_aux_files(base_dir: str, adapter_dir: str, dst: str) -> List[str]:
    copied = []
    for name in MODEL_FILES:
        for src_dir in (base_dir, adapter_dir):
            p = os.path.join(src_dir, name)
            if os.path.isfile(p):
                shutil.copy2(p, os.path.join(dst, name))
                copied.append(name)
                break

    def tok_files(d):
        out = []
        for n in sorted(os.listdir(d)):
            if os.path.isfile(os.path.join(d, n)) and any(fnmatch.fnmatch(n, p) for p in TOKENIZER_PATTERNS):
                out.append(n)
        return out

    names = tok_files(base_dir)
    src = base_dir
    if not names:
        names, src = tok_files(adapter_dir), adapter_dir
    for n in names:
        shutil.copy2(os.path.join(src, n), os.path.join(dst, n))
        copied.append(n)
    return copied


# --------------------------------------------------------------------- merge
@dataclass
class MergeResult:
    output_dir: str
    weight_files: List[str]
    modules_merged: List[str]
    checkpoint_bytes: int
    merge_seconds: float
    dtype: str
    tolerance: float
    verify: Optional[Dict[str, Any]] = None
    warnings: List[str] = field(default_factory=list)

    @property
    def verify_failed(self) -> bool:
        return bool(self.verify) and self.verify.get("status") == "failed"

    @property
    def exit_code(self) -> int:
        return EXIT_VERIFY_FAILED if self.verify_failed else EXIT_OK


def _dir_nonempty(p: str) -> bool:
    return os.path.isdir(p) and bool(os.listdir(p))


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def resolve_device(device: Optional[str]) -> str:
    """'gpu' when Paddle sees a CUDA device, else 'cpu'; an explicit 'gpu' without one is an error."""
    if device not in (None, "", "cpu", "gpu") and not str(device).startswith("gpu:"):
        raise MergeError(f"--device must be cpu or gpu, got {device!r}")
    if device == "cpu":
        return "cpu"
    import paddle

    has_gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if device in (None, ""):
        return "gpu" if has_gpu else "cpu"
    if not has_gpu:
        raise MergeError(f"--device {device}: this Paddle build has no usable GPU; use --device cpu")
    return device


def merge_dtype(targets: Mapping[str, TensorEntry]) -> str:
    """The loosest float dtype among the merged weights (decides the default tolerance)."""
    kinds = {_FLOAT_TAGS[e.dtype] for e in targets.values()}
    for k in ("bfloat16", "float16", "float32", "float64"):
        if k in kinds:
            return k
    return "float32"


def merge_adapter_checkpoint(
    model_name_or_path: str,
    lora_path: str,
    output_path: str,
    *,
    safe_serialization: bool = True,
    max_shard_size="1GB",
    overwrite: bool = False,
    verify: bool = True,
    tolerance: Optional[float] = None,
    device: Optional[str] = None,
    num_probes: int = 2,
    probe_length: int = 32,
    log: Log = print,
) -> MergeResult:
    """Merge the adapter in ``lora_path`` into the checkpoint in ``model_name_or_path``
    and write a complete model to ``output_path`` (see the module docstring).

    The output is assembled in a temporary directory next to ``output_path`` and
    renamed into place at the end; on any error the temporary directory is removed
    and nothing is left at ``output_path``.  With ``verify`` the merged model is
    compared with base + adapter on random probes; a failure keeps the output but
    writes ``MERGE_VERIFY_FAILED`` into it (``result.exit_code`` is then 3).
    Input problems raise :class:`MergeError`.
    """
    t0 = time.time()
    base_dir, adapter_dir, out_dir = model_name_or_path, lora_path, output_path
    if not os.path.isdir(base_dir):
        raise MergeError(
            f"--model_name_or_path {base_dir}: no such directory (this tool reads a local checkpoint; "
            "download the model first)"
        )
    for what, p in (("--model_name_or_path", base_dir), ("--lora_path", adapter_dir)):
        if os.path.exists(out_dir) and _same_path(p, out_dir):
            raise MergeError(f"the output path {out_dir} is the same directory as {what}; choose another one")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise MergeError(f"output path {out_dir} exists and is not a directory")
    if _dir_nonempty(out_dir) and not overwrite:
        raise MergeError(f"output directory {out_dir} exists and is not empty; pass --overwrite to replace it")
    max_bytes = parse_size(max_shard_size)
    dev = resolve_device(device) if verify else (device or "cpu")

    bundle = AdapterBundle.open(adapter_dir)
    cfg = bundle.config
    base_cfg = check_model_type(base_dir, adapter_dir, cfg, log)
    ckpt = Checkpoint.open(base_dir)
    targets = check_adapter_against_base(bundle, ckpt)
    dtype = merge_dtype(targets)
    tol = float(tolerance) if tolerance is not None else DEFAULT_TOLERANCE[dtype]
    if not tol > 0:
        raise MergeError(f"--tolerance must be > 0, got {tolerance}")
    notes: List[str] = []

    desc = cfg.layer_type + ("+rslora" if cfg.rslora else "") + (
        f"+lora_plus_scale={cfg.lora_plus_scale:g}" if cfg.method == "lora" and cfg.lora_plus_scale != 1.0 else "")
    log(f"[merge] base {base_dir}: {ckpt.fmt}, {len(ckpt.files)} file(s), {len(ckpt.entries)} tensors, "
        f"{_fmt_bytes(ckpt.total_bytes)}; adapter {adapter_dir}: {desc}, r={cfg.r}, "
        f"scaling={cfg.scaling:g}, {len(targets)} modules")
    if cfg.quantization:
        msg = (f"adapter was trained on a {cfg.quantization.get('weight_quantize_algo')}-quantized base (QLoRA); "
               "merging into the FULL-PRECISION base weights (the quantization error of the base is not baked in)")
        log(f"[merge] note: {msg}")
        notes.append(msg)
    if cfg.pissa:
        log("[merge] PiSSA: merged = W_orig + s*(A@B - A0@B0), against the original base weights")

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.merging-{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        weight_files, merged = _stream_merge(ckpt, bundle, targets, tmp, safe_serialization, max_bytes, log)
        _copy_aux_files(base_dir, adapter_dir, tmp)
        merge_seconds = time.time() - t0
        info = {
            "base_model": os.path.abspath(base_dir),
            "adapter": os.path.abspath(adapter_dir),
            "adapter_config": cfg.to_dict(),
            "merged_into": "full-precision base" if cfg.quantization else "base",
            "modules_merged": len(merged),
            "dtype": dtype,
            "weight_files": weight_files,
            "checkpoint_bytes": ckpt.total_bytes,
            "merge_seconds": round(merge_seconds, 3),
        }
        _write_json(os.path.join(tmp, MERGE_INFO_NAME), info)
        result = MergeResult(out_dir, weight_files, merged, ckpt.total_bytes, merge_seconds, dtype, tol,
                             warnings=notes)
        if verify:
            try:
                result.verify = verify_merge(base_dir, adapter_dir, tmp, cfg, ckpt, tol, dev, base_cfg,
                                             num_probes=num_probes, probe_length=probe_length, log=log)
            except Exception as e:  # the merge is complete; an unverifiable output is marked, not deleted
                log(f"[verify] FAILED to run: {type(e).__name__}: {e}")
                result.verify = {"status": "failed", "error": f"{type(e).__name__}: {e}", "tolerance": tol}
            info["verify"] = result.verify
            _write_json(os.path.join(tmp, MERGE_INFO_NAME), info)
            if result.verify_failed:
                with open(os.path.join(tmp, VERIFY_FAILED_MARKER), "w", encoding="utf-8") as f:
                    f.write("The merged weights did NOT reproduce base + adapter within tolerance.\n")
                    f.write(json.dumps(result.verify, indent=2) + "\n")
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")


def _publish(tmp: str, out_dir: str) -> None:
    """Atomically move the finished temp dir to ``out_dir`` (replacing an old one)."""
    old = None
    if os.path.exists(out_dir):
        if os.listdir(out_dir):
            old = f"{tmp}.old"
            os.rename(out_dir, old)
        else:
            os.rmdir(out_dir)
    os.rename(tmp, out_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)


#: elements of the delta computed per compute_delta call (~1 MiB of fp32 per block, cache-sized)
CHUNK_ELEMENTS = 2**18
#: threads that merge row blocks of one weight in parallel (numpy releases the GIL)
MERGE_THREADS = max(1, min(4, os.cpu_count() or 1))


def _apply_block(block: np.ndarray, delta: np.ndarray, tag: str) -> None:
    """block[...] = cast(float32(block) + delta); ``delta`` (fp32) may be clobbered."""
    if tag == "F32":
        block += delta
    elif tag == "F64":
        block += delta.astype(np.float64)
    else:  # fp16 / bf16: fp32 arithmetic, one rounding
        delta += to_f32(block, tag)
        block[...] = from_f32(delta, tag)


def add_delta_inplace(arr: np.ndarray, tag: str, cfg: AdapterConfig, tensors: Mapping[str, np.ndarray],
                      compute_delta: Callable[..., np.ndarray], executor=None) -> None:
    """``arr[...] = cast(float32(arr) + compute_delta(...))`` for one [in, out] base weight,
    in place in the freshly read buffer.

    For LoRA / rsLoRA / LoRA+ / PiSSA, row i of the delta only depends on row i of A
    (and A0), so the delta is computed in blocks of rows with ``compute_delta`` on the
    row slices (same formula, same fp32 arithmetic): each block stays in cache and
    no full-size delta is ever allocated.  VeRA's delta slices a shared projection by
    ``in_features``, so it is computed whole and then applied block by block.  With an
    ``executor`` the rows are split into contiguous ranges merged in parallel (disjoint
    rows; numpy releases the GIL), which matters for bf16/fp16 where the casts are
    CPU-bound.
    """
    in_f, out_f = arr.shape
    kind = cfg.layer_type
    step = max(1, CHUNK_ELEMENTS // max(out_f, 1))
    whole = None
    if kind not in ("lora", "pissa"):
        whole = compute_delta(kind, cfg, tensors, in_f, out_f)

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi, step):
            j = min(hi, i + step)
            if whole is not None:
                delta = whole[i:j]
            else:
                part = {k: (v[i:j] if k in ("lora_A", "pissa_A0") else v) for k, v in tensors.items()}
                delta = compute_delta(kind, cfg, part, j - i, out_f)
            _apply_block(arr[i:j], delta, tag)

    n = getattr(executor, "_max_workers", 1) if executor is not None else 1
    if n <= 1 or in_f < 2 * step:
        run(0, in_f)
        return
    bounds = [in_f * k // n for k in range(n + 1)]
    futures = [executor.submit(run, bounds[k], bounds[k + 1]) for k in range(n) if bounds[k] < bounds[k + 1]]
    for f in futures:
        f.result()


def _single_threaded_blas():
    """Context (already entered) limiting numpy's BLAS to one thread: the rank-r matmuls of a
    merge are tiny, and OpenBLAS's thread hand-off costs more than it saves, especially
    while our own threads run blocks in parallel (measured 2x on the bf16 benchmark).
    A no-op without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_limits

        ctx = threadpool_limits(limits=1, user_api="blas")
    except Exception:  # pragma: no cover - optional dependency
        import contextlib

        ctx = contextlib.nullcontext()
    ctx.__enter__()
    return ctx


def _stream_merge(
    ckpt: Checkpoint,
    bundle: AdapterBundle,
    targets: Dict[str, TensorEntry],
    out_dir: str,
    safe: bool,
    max_bytes: int,
    log: Log,
) -> Tuple[List[str], List[str]]:
    from .adapters.api import compute_delta

    cfg = bundle.config
    module_of = {ent.name: mod for mod, ent in targets.items()}
    consumed: Dict[str, int] = {mod: 0 for mod in targets}
    shards = plan_shards(ckpt.entries, max_bytes)
    names = shard_file_names(len(shards), safe)
    src = TensorSource(ckpt)
    pool = BufferPool(max_buffers=3)  # one being merged + one queued + one being written
    weight_map: Dict[str, str] = {}
    from concurrent.futures import ThreadPoolExecutor

    executor = ThreadPoolExecutor(max_workers=MERGE_THREADS, thread_name_prefix="merge") if MERGE_THREADS > 1 else None
    blas_limit = _single_threaded_blas()
    try:
        for i, (shard, fname) in enumerate(zip(shards, names)):
            ts = time.time()
            path = os.path.join(out_dir, fname)
            writer = SafetensorsStreamWriter(path, shard, queue_size=1) if safe else None
            pd_state: Dict[str, Any] = {}
            n_merged = 0
            try:
                for ent in writer.order if writer else shard:
                    weight_map[ent.name] = fname
                    mod = module_of.get(ent.name)
                    if mod is None and writer is not None and ckpt.fmt == "safetensors":
                        writer.copy(ent)  # untouched tensor: byte copy in the kernel
                        src.skip(ent)
                        continue
                    arr, buf = src.read(ent, pool if writer is not None else None)
                    if mod is not None:
                        if consumed[mod]:
                            raise MergeError(f"adapter module {mod!r} was merged twice")
                        add_delta_inplace(arr, ent.dtype, cfg, bundle.modules[mod], compute_delta, executor)
                        consumed[mod] += 1
                        n_merged += 1
                    if writer is not None:
                        writer.write(ent.name, arr, buf, pool.release if buf is not None else None)
                    else:
                        pd_state[ent.name] = _to_paddle(arr, ent.dtype)
                    del arr, buf
            except BaseException:
                if writer:
                    writer.abort()
                raise
            if writer:
                writer.close()
            else:
                import paddle

                paddle.save(pd_state, path)
                pd_state.clear()
            log(f"[merge] wrote {fname}: {len(shard)} tensors ({n_merged} merged), "
                f"{_fmt_bytes(sum(e.nbytes for e in shard))} in {time.time() - ts:.1f}s")
    finally:
        src.close()
        if executor is not None:
            executor.shutdown(wait=True)
        blas_limit.__exit__(None, None, None)
    leftovers = sorted(m for m, c in consumed.items() if c != 1)
    unused = sorted(set(bundle.modules) - set(consumed))
    if leftovers or unused:
        raise MergeError(f"adapter modules not merged exactly once: {leftovers + unused}")
    if len(names) > 1:
        index = {"metadata": {"total_size": int(sum(e.nbytes for e in ckpt.entries))},
                 "weight_map": {e.name: weight_map[e.name] for e in ckpt.entries}}
        idx_name = SAFE_WEIGHTS_INDEX_NAME if safe else PADDLE_WEIGHTS_INDEX_NAME
        with open(os.path.join(out_dir, idx_name), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2) + "\n")
        names = names + [idx_name]
    return names, sorted(targets)


# -------------------------------------------------------------------- verify
def estimate_verify_bytes(ckpt: Checkpoint) -> int:
    """Host memory a verification pass needs: one fp32 model while from_pretrained also
    holds its state dict (~2x), plus slack."""
    params = sum(e.numel for e in ckpt.entries)
    return int(params * 4 * 2.5) + 512 * 2**20


def _quiet_paddlenlp():
    try:
        from paddlenlp.utils.log import logger as pnlp_logger

        old = pnlp_logger.logger.level
        pnlp_logger.set_level("WARNING")
        return lambda: pnlp_logger.logger.setLevel(old)
    except Exception:  # pragma: no cover - logging is cosmetic
        return lambda: None


def _logits(model, probes: np.ndarray) -> np.ndarray:
    import paddle

    model.eval()
    with paddle.no_grad():
        out = model(input_ids=paddle.to_tensor(probes))
    logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
    return logits.astype("float32").numpy()


def probe_inputs(vocab_size: int, num: int, length: int, seed: int = 0) -> np.ndarray:
    """Random token ids (fixed seed), avoiding the first few ids (pad/bos/eos)."""
    rng = np.random.default_rng(seed)
    low = 3 if vocab_size > 8 else 0
    return rng.integers(low, vocab_size, size=(num, length)).astype("int64")


def verify_merge(
    base_dir: str,
    adapter_dir: str,
    merged_dir: str,
    cfg: AdapterConfig,
    ckpt: Checkpoint,
    tolerance: float,
    device: str,
    base_cfg: Mapping[str, Any],
    num_probes: int = 2,
    probe_length: int = 32,
    log: Log = print,
) -> Dict[str, Any]:
    """Run base + adapter and the merged model (both loaded in float32) on random probes.

    ``error = max|logits_merged - logits_ref| / max(1, max|logits_ref|)`` must be
    <= ``tolerance``.  For QLoRA adapters the reference is the full-precision base +
    adapter (what the merge represents); the gap to the quantized base + adapter
    (the model as trained) is reported but never fails.  Returns a dict with
    ``status`` "passed" / "failed" / "skipped"."""
    import psutil

    need = estimate_verify_bytes(ckpt)
    avail = int(psutil.virtual_memory().available)
    if need > avail:
        log(f"[verify] skipped: needs ~{_fmt_bytes(need)} of RAM to load the model in float32, only "
            f"{_fmt_bytes(avail)} available (the merge itself is complete; --no-verify silences this)")
        return {"status": "skipped", "reason": "not enough memory", "needed_bytes": need, "available_bytes": avail}

    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM

    from .adapters import load_adapter

    paddle.set_device(device)
    restore = _quiet_paddlenlp()
    vocab = int(base_cfg.get("vocab_size") or 0)
    if vocab <= 0:
        raise MergeError("verify: config.json has no vocab_size")
    probes = probe_inputs(vocab, num_probes, probe_length)
    t0 = time.time()

    def load(path, quant=None):
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        if quant:
            from .quant import quantize_model

            quantize_model(model, quant["weight_quantize_algo"], block_size=quant.get("weight_blocksize", 64),
                           double_quant=bool(quant.get("weight_double_quant", False)),
                           double_quant_block_size=quant.get("weight_double_quant_block_size", 256))
        return model

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = load(base_dir)
            base_only = _logits(model, probes)
            load_adapter(model, adapter_dir)  # the same base model, now with the adapter
            ref = _logits(model, probes)
            del model
            quant_logits = None
            if cfg.quantization:
                model = load(base_dir, quant=cfg.quantization)
                load_adapter(model, adapter_dir)
                quant_logits = _logits(model, probes)
                del model
            gc.collect()
            model = load(merged_dir)
            got = _logits(model, probes)
            del model
            gc.collect()
    finally:
        restore()
    scale = max(1.0, float(np.abs(ref).max()))
    diff = float(np.abs(got - ref).max())
    err = diff / scale
    effect = float(np.abs(ref - base_only).max())
    res: Dict[str, Any] = {
        "status": "passed" if err <= tolerance and np.isfinite(err) else "failed",
        "max_abs_logit_diff": diff,
        "relative_error": err,
        "logit_scale": scale,
        "tolerance": tolerance,
        "adapter_effect": effect,
        "reference": "full-precision base + adapter" if cfg.quantization else "base + adapter",
        "probes": [int(num_probes), int(probe_length)],
        "device": device,
        "seconds": round(time.time() - t0, 2),
    }
    log(f"[verify] {res['status'].upper()}: max |logit diff| merged vs {res['reference']} = {diff:.3e} "
        f"(relative {err:.3e}, tolerance {tolerance:g}) on {num_probes}x{probe_length} random tokens; "
        f"for scale, the adapter itself moves the logits by up to {effect:.3e}")
    if effect > 0 and diff >= 0.5 * effect:
        msg = ("the merge error is not small against the adapter's own effect on the logits; "
               "a lower --tolerance would make this check meaningful")
        res["note"] = msg
        log(f"[verify] warning: {msg}")
    if quant_logits is not None:
        qdiff = float(np.abs(got - quant_logits).max())
        res["quantized_base_gap"] = {"max_abs_logit_diff": qdiff, "relative": qdiff / scale}
        log(f"[verify] info: merged (full precision) vs {cfg.quantization.get('weight_quantize_algo')}-quantized "
            f"base + adapter (the model as trained): max |logit diff| = {qdiff:.3e} (relative {qdiff / scale:.3e}); "
            "this is the base's quantization error, not a merge error")
    if res["status"] == "failed":
        log(f"[verify] the merged model does not reproduce base + adapter; the output is kept but marked with "
            f"{VERIFY_FAILED_MARKER}")
    return res
