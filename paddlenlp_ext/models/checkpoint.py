"""Finding, validating and reading a PaddleNLP model checkpoint one tensor at a time.

Owns :class:`CheckpointError`, the weight layouts ``from_pretrained`` accepts
from a local directory (in its order of preference):

* ``model.safetensors.index.json`` + ``model-0000i-of-0000n.safetensors``
* ``model.safetensors``
* ``model_state.pdparams.index.json`` + ``model_state-0000i-of-0000n.pdparams``
* ``model_state.pdparams``

and :func:`iter_tensors`, which yields ``(name, numpy array, file)`` one at a
time.  A safetensors checkpoint in Hugging Face transformers layout
(``model.layers.N...`` names, Linear weights [out, in]; :mod:`.hf_layout`) is
presented in PaddleNLP's layout: :func:`find_checkpoint` renames its tensors (and
reports the transposed shapes) and :func:`iter_tensors` transposes each Linear
weight right after reading it, so callers see only PaddleNLP names and shapes.  bfloat16 tensors arrive as ``uint16`` arrays of their bits (safetensors
tags ``BF16`` and ``U16`` -- PaddleNLP's ``save_pretrained`` writes bf16 as
``U16`` -- and ``paddle.load(..., return_numpy=True)``): Paddle's convention,
``paddle.to_tensor`` of a uint16 array is bfloat16.

safetensors are read with one positioned read per tensor into a fresh numpy
array (which :func:`~paddlenlp_ext.integrations.lazy_init.materialize` then
turns into the parameter without a copy), from offsets in the file's JSON
header (validated against the file size).  Not ``safetensors.safe_open``: it memory-maps the file, and every page
it touches stays in the process's RSS until the file is closed -- measured
here: iterating a 384 MB file with ``safe_open(..., framework="np")`` and
dropping each tensor at once still raised RSS by 400 MB, the positioned reads
by 16 MB (one tensor).  A ``.pdparams`` file cannot be read per tensor (it is
a pickle): each one is loaded whole (``paddle.load(return_numpy=True)``, about
1x the file in RAM) and its arrays are handed out (and dropped here) one by one.

Everything that can be checked without reading tensor data is checked by
:func:`find_checkpoint` (index readable, every shard on disk, headers valid,
index and shards agree); shapes and names against the model are checked by
the loader (:mod:`.loading`).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PADDLE_WEIGHTS_NAME = "model_state.pdparams"
PADDLE_WEIGHTS_INDEX_NAME = "model_state.pdparams.index.json"
#: (format, file name, is an index) in the order PaddleNLP's from_pretrained prefers them
LAYOUTS = (
    ("safetensors", SAFE_WEIGHTS_INDEX_NAME, True),
    ("safetensors", SAFE_WEIGHTS_NAME, False),
    ("pdparams", PADDLE_WEIGHTS_INDEX_NAME, True),
    ("pdparams", PADDLE_WEIGHTS_NAME, False),
)

#: safetensors dtype tag -> numpy dtype holding the raw data (bf16 as its uint16 bits)
NP_OF_TAG = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip
_MAX_HEADER = 100 * 2**20


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model or is damaged; the message names the file and tensor."""


class HFLayoutCheckpointError(CheckpointError):
    """A transformers-layout checkpoint that is not read as it is (its family's, or a contradictory config)."""


@dataclass
class TensorInfo:
    """What is known about one checkpoint tensor before reading it (``shape``/``dtype`` None: not yet known)."""

    name: str
    file: str  # absolute path
    shape: Optional[Tuple[int, ...]] = None
    dtype: Optional[str] = None  # safetensors tag
    offset: int = -1  # absolute byte offset of the data (safetensors)
    nbytes: int = 0
    source_name: Optional[str] = None  # the name in the file when it differs (transformers layout)
    transpose: bool = False  # stored [out, in] (transformers' nn.Linear): transposed when read


@dataclass
class Checkpoint:
    """The weight files of a model directory and every tensor known without reading data.

    ``tensors`` is complete for safetensors and for an indexed pdparams
    checkpoint (names only, no shapes); empty for a single ``model_state.pdparams``
    (its names are known once it is loaded).
    """

    directory: str
    fmt: str  # "safetensors" | "pdparams"
    files: List[str]
    index_file: Optional[str] = None
    tensors: Dict[str, TensorInfo] = field(default_factory=dict)
    hf_model_type: Optional[str] = None  # set when the files are in transformers layout (converted on read)

    @property
    def names_known(self) -> bool:
        return bool(self.tensors)

    @property
    def shapes_known(self) -> bool:
        return self.fmt == "safetensors"

    def file_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)


def read_safetensors_header(path: str, tags: Optional[Dict[str, type]] = None) -> List[TensorInfo]:
    """Every tensor of a safetensors file, in data order, validated against the file size.

    ``tags``: the dtype tags accepted (tag -> numpy holder; default :data:`NP_OF_TAG`, what a
    model loads); the merge passes its wider table.  The one header parser of the project:
    the merge's reader uses it too (and turns :class:`CheckpointError` into its own error).
    """
    tags = NP_OF_TAG if tags is None else tags
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{path}: not a safetensors file (header length {n} for a {size}-byte file)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    start = 8 + n
    out = []
    for name, v in header.items():
        if name == "__metadata__":
            continue
        try:
            tag, shape, (b, e) = v["dtype"], tuple(int(s) for s in v["shape"]), v["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name!r}: {v!r}") from None
        if tag not in tags:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {tag}")
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not (0 <= b <= e and start + e <= size):
            raise CheckpointError(f"{path}: tensor {name!r} lies outside the file (truncated checkpoint?)")
        if numel * np.dtype(tags[tag]).itemsize != e - b:
            raise CheckpointError(f"{path}: tensor {name!r}: {e - b} bytes do not hold {tag} {list(shape)}")
        out.append(TensorInfo(name, path, shape, tag, start + int(b), int(e - b)))
    out.sort(key=lambda t: t.offset)  # read each file front to back
    return out


def _read_index(path: str) -> Dict[str, str]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a valid checkpoint index ({type(e).__name__}: {e})") from None
    return weight_map


def find_checkpoint(model_dir: str) -> Checkpoint:
    """Locate and validate the weights of ``model_dir`` (reads headers and indexes, no tensor data).

    A transformers-layout checkpoint comes back renamed to PaddleNLP's names and
    shapes (``hf_model_type`` set; the transposes happen in :func:`iter_tensors`).
    """
    ckpt = _find_files(model_dir)
    if ckpt.fmt == "safetensors":
        _to_paddle_layout(ckpt)
    return ckpt


def _to_paddle_layout(ckpt: Checkpoint) -> None:
    """Rename a transformers-layout checkpoint's tensors in place (no data read); PaddleNLP layout: untouched."""
    from . import hf_layout

    try:
        config = hf_layout.read_config_json(ckpt.directory)
        model_type = hf_layout.detect_layout(ckpt.tensors, config, where=ckpt.directory)
    except hf_layout.HFLayoutError as e:
        raise HFLayoutCheckpointError(str(e)) from None
    if model_type is None:
        return
    converted: Dict[str, TensorInfo] = {}
    for key, info in ckpt.tensors.items():
        name, transpose = hf_layout.paddle_name(key, model_type)
        transpose = transpose and len(info.shape) == 2
        if name in converted:
            raise CheckpointError(
                f"{info.file}: tensors {converted[name].source_name!r} and {key!r} both map to "
                f"{name!r}; the checkpoint mixes transformers and PaddleNLP names"
            )
        converted[name] = TensorInfo(
            name,
            info.file,
            hf_layout.converted_shape(info.shape, transpose),
            info.dtype,
            info.offset,
            info.nbytes,
            source_name=key,
            transpose=transpose,
        )
    ckpt.tensors, ckpt.hf_model_type = converted, model_type


def _find_files(model_dir: str) -> Checkpoint:
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"model directory {model_dir!r} does not exist")
    for fmt, name, is_index in LAYOUTS:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        if not is_index:
            ckpt = Checkpoint(model_dir, fmt, [path])
            if fmt == "safetensors":
                ckpt.tensors = {t.name: t for t in read_safetensors_header(path)}
            return ckpt
        weight_map = _read_index(path)
        files: List[str] = []
        for fname in weight_map.values():
            fpath = os.path.join(model_dir, fname)
            if fpath not in files:
                files.append(fpath)
        files.sort()
        missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if missing:
            raise CheckpointError(
                f"{path} names {len(missing)} shard file(s) that do not exist in {model_dir}: {missing} "
                "(incomplete download or copy?)"
            )
        if not files:
            raise CheckpointError(f"{path}: the index lists no tensors")
        ckpt = Checkpoint(model_dir, fmt, files, index_file=path)
        if fmt == "pdparams":
            ckpt.tensors = {k: TensorInfo(k, os.path.join(model_dir, f)) for k, f in weight_map.items()}
            return ckpt
        for fpath in files:
            for t in read_safetensors_header(fpath):
                if t.name in ckpt.tensors:
                    raise CheckpointError(
                        f"tensor {t.name!r} appears in two shards: {os.path.basename(ckpt.tensors[t.name].file)} "
                        f"and {os.path.basename(fpath)}"
                    )
                ckpt.tensors[t.name] = t
        for k, fname in weight_map.items():
            t = ckpt.tensors.get(k)
            if t is None or t.file != os.path.join(model_dir, fname):
                where = "no shard" if t is None else os.path.basename(t.file)
                raise CheckpointError(f"{path} puts tensor {k!r} in {fname}, but it is in {where}")
        extra = sorted(set(ckpt.tensors) - set(weight_map))
        if extra:
            raise CheckpointError(f"{path} does not list {len(extra)} tensor(s) its shards hold, e.g. {extra[:5]}")
        return ckpt
    found = [
        f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json") if os.path.isfile(os.path.join(model_dir, f))
    ]
    hint = (
        (
            f" (found {found}: PyTorch weights need PaddleNLP's conversion; load them once with from_pretrained "
            "and save_pretrained the result)"
        )
        if found
        else ""
    )
    raise CheckpointError(f"no model weights in {model_dir}: expected one of {[name for _, name, _ in LAYOUTS]}{hint}")


def _pread_into(fd: int, arr: np.ndarray, offset: int, info: TensorInfo) -> None:
    view = memoryview(arr.reshape(-1)).cast("B")
    got = 0
    while got < info.nbytes:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise CheckpointError(f"{info.file}: short read for tensor {info.name!r} (truncated file?)")
        got += n


def load_pdparams(path: str) -> Dict[str, np.ndarray]:
    """A whole ``.pdparams`` file as ``{name: numpy}`` (bf16 as uint16).

    numpy, not paddle tensors: ``paddle.load``'s tensors share storage, so one
    of them kept as a parameter pinned its whole shard (measured: +28 MiB per
    37 MiB shard stayed resident); each numpy array holds its own bytes.
    """
    import pickle

    import paddle

    try:
        state = paddle.load(path, return_numpy=True)
    except (OSError, ValueError, EOFError, RuntimeError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{path}: cannot read the pdparams file ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a state dict, got {type(state).__name__}")
    for k, v in state.items():
        if not isinstance(v, np.ndarray):
            raise CheckpointError(f"{path}: entry {k!r} is a {type(v).__name__}, not a tensor")
    return state


def iter_tensors(ckpt: Checkpoint, skip: Optional[set] = None) -> Iterator[Tuple[str, np.ndarray, str]]:
    """Yield ``(name, array, file)`` for every tensor of ``ckpt`` (file by file), except names in ``skip``.

    ``array``: numpy (bf16 as uint16 bits); from safetensors a fresh, writable array.
    The caller should drop each array before asking for the next one: at most one
    tensor (safetensors) or what is left of one pdparams file is held here.
    """
    skip = skip or set()
    for path in ckpt.files:
        if ckpt.fmt == "safetensors":
            infos = [t for t in ckpt.tensors.values() if t.file == path and t.name not in skip]
            infos.sort(key=lambda t: t.offset)
            fd = os.open(path, os.O_RDONLY)
            try:
                for info in infos:
                    # as stored: [out, in] for a transformers Linear weight, else the tensor's shape
                    arr = np.empty(info.shape[::-1] if info.transpose else info.shape, dtype=NP_OF_TAG[info.dtype])
                    _pread_into(fd, arr, info.offset, info)
                    if info.transpose:  # [out, in] -> Paddle's [in, out]; the stored copy is dropped at once
                        arr = np.ascontiguousarray(arr.T)
                    yield info.name, arr, path
                    del arr
            finally:
                os.close(fd)
            continue
        state = load_pdparams(path)
        if ckpt.index_file is not None:
            listed = {k for k, t in ckpt.tensors.items() if t.file == path}
            absent = sorted(listed - set(state))
            if absent:
                raise CheckpointError(
                    f"{os.path.basename(ckpt.index_file)} puts {len(absent)} tensor(s) in {os.path.basename(path)} "
                    f"that it does not hold, e.g. {absent[:5]}"
                )
            extra = sorted(set(state) - listed)
            if extra:
                raise CheckpointError(
                    f"{os.path.basename(path)} holds {len(extra)} tensor(s) its index "
                    f"{os.path.basename(ckpt.index_file)} does not list there, e.g. {extra[:5]}"
                )
        for name in list(state):
            arr = state.pop(name)  # released as soon as the caller drops it
            if name in skip:
                continue
            yield name, arr, path
            del arr
        del state
