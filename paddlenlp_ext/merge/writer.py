"""Writing the merged checkpoint: shard plan, streaming writer, atomic publish.

Owns: PaddleNLP's sharding rule and file names (``plan_shards``,
``shard_file_names``, the index file), ``SafetensorsStreamWriter`` (header
first, then tensors from a writer thread; untouched tensors are copied in the
kernel with ``os.copy_file_range``, falling back to plain reads and writes),
pdparams output, the config / tokenizer files copied next to the weights, and
the temporary directory that is renamed onto the output path at the end.
"""

from __future__ import annotations

import fnmatch
import json
import os
import queue
import shutil
import struct
import threading
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from .common import (
    PADDLE_WEIGHTS_INDEX_NAME,
    PADDLE_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    MergeError,
)
from .reader import TensorEntry

#: non-weight files copied from the base model (tokenizer group falls back to the adapter dir)
MODEL_FILES = ("config.json", "generation_config.json")
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "*.model",
    "vocab*",
    "merges.txt",
    "chat_template*",
    "spiece.model",
    "sentencepiece*",
)

#: False once os.copy_file_range is missing or refused (old kernel, other filesystem):
#: from then on every writer copies with plain reads and writes
_COPY_FILE_RANGE_OK = hasattr(os, "copy_file_range")


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

    def __init__(
        self, path: str, entries: List[TensorEntry], metadata: Optional[Dict[str, str]] = None, queue_size: int = 1
    ):
        self.path = path
        self.order = sorted(entries, key=lambda e: (-e.itemsize, e.name))
        header: Dict[str, Any] = {"__metadata__": dict(metadata or {"format": "np"})}
        off = 0
        for e in self.order:
            header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
            off += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # pad so the data (and every tensor in it) starts 8-byte aligned
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

    def write(
        self,
        name: str,
        arr: np.ndarray,
        buffer: Optional[np.ndarray] = None,
        release: Optional[Callable[[np.ndarray], None]] = None,
    ) -> None:
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


def to_paddle(arr: np.ndarray):
    """numpy -> CPU paddle Tensor for pdparams output; a uint16 array becomes bfloat16 (paddle's convention)."""
    import paddle

    return paddle.to_tensor(arr, place=paddle.CPUPlace())


def save_pdparams(state: Dict[str, Any], path: str) -> None:
    import paddle

    paddle.save(state, path)


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")


def write_index(out_dir: str, safe: bool, entries: List[TensorEntry], weight_map: Dict[str, str]) -> str:
    """Write the ``*.index.json`` of a sharded output (tensors in checkpoint order); returns its name."""
    index = {
        "metadata": {"total_size": int(sum(e.nbytes for e in entries))},
        "weight_map": {e.name: weight_map[e.name] for e in entries},
    }
    idx_name = SAFE_WEIGHTS_INDEX_NAME if safe else PADDLE_WEIGHTS_INDEX_NAME
    write_json(os.path.join(out_dir, idx_name), index)
    return idx_name


def _write_model_config(src: str, dst: str) -> None:
    """The merged model's config.json: the base's, in transformers 4.55's spelling when it was saved by 5.x
    (``rope_parameters`` -> ``rope_theta`` + ``rope_scaling``), which PaddleNLP's own loader reads right."""
    from ..models.hf_config_read import canonical_config

    with open(src, "r", encoding="utf-8") as f:
        raw = json.load(f)
    canon, problems = canonical_config(raw)
    # problems: refused before the merge (formats.check_model_type).  A 4.x-spelled config is kept as saved:
    # its canonical form renames rope_scaling "type" to "rope_type", which transformers 4.55's Phi-3 refuses
    if problems or canon == raw or "rope_parameters" not in raw:
        shutil.copy2(src, dst)
    else:
        write_json(dst, canon)


def copy_aux_files(base_dir: str, adapter_dir: str, dst: str) -> List[str]:
    """Copy config / generation config (base first, else adapter dir) and the tokenizer
    files (the base's, or the adapter dir's when the base has none) into ``dst``."""
    copied = []
    for name in MODEL_FILES:
        for src_dir in (base_dir, adapter_dir):
            p = os.path.join(src_dir, name)
            if os.path.isfile(p):
                if name == "config.json":
                    _write_model_config(p, os.path.join(dst, name))
                else:
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
    from ..reward.io import carry_reward_files  # a reward adapter's score head stays with the merged model

    return copied + carry_reward_files(adapter_dir, dst)


def make_temp_dir(out_dir: str) -> str:
    """A fresh hidden ``.<name>.merging-<pid>`` next to ``out_dir``: same filesystem, so
    ``publish`` is a rename, and never mistaken for a model if a crash leaves it behind."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.merging-{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def publish(tmp: str, out_dir: str) -> None:
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
