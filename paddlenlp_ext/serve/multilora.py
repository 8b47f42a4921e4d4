"""Many LoRA adapters on one base, applied per row of a batch (as S-LoRA / Punica do).

The base is loaded once.  Every target linear layer of any per-row adapter is wrapped in a
``RowLoRALinear`` that holds each adapter's ``A [in, r]``, ``B [r, out]`` and scaling under a slot
number.  Before a forward the scheduler sets ``RowAdapters.rows``: the slot of each batch row
(-1 = the base) -- the static scheduler once per batch, the continuous one (``serve.continuous``) before
each prefill and decode step, for exactly the rows of that forward.  The layer computes the base matmul once for the whole batch, then for each
adapter present gathers its rows, adds ``(x_rows @ A) * s @ B`` and scatters them back.  So rows for
different adapters and for the base share one batch and one copy of the base weights; memory is
base + the adapters' small matrices.

Only plain LoRA (also rsLoRA, LoRA+) is applied per row.  Adapters that change the base weights or
need them in another form -- PiSSA (``W - s*A0@B0``), QLoRA (a quantized base), VeRA, LoKr,
PaddleNLP's LoRA format, prefix tuning -- keep the merged-copy path of ``serve.models``
(``predict.lora_rows.per_row_refusal`` says why).
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..predict.lora_rows import set_sublayer


def _row_linear_class():
    import paddle
    from paddle import nn

    class RowLoRALinear(nn.Layer):
        """``base(x)`` for the batch + each row's own low-rank update (module doc)."""

        def __init__(self, base_layer, table: "RowAdapters"):
            super().__init__()
            self.base_layer, self.table = base_layer, table
            self.slots: Dict[int, Tuple[paddle.Tensor, paddle.Tensor, float]] = {}  # slot -> (A, B, scaling)

        def _delta(self, x, slot):
            a, b, s = self.slots[slot]
            h = x if x.dtype == a.dtype else x.astype(a.dtype)
            return paddle.matmul(paddle.matmul(h, a) * s, b)  # [n, T, r] -> [n, T, out]

        def forward(self, x, *args, **kwargs):  # x: [B, T, in]
            out = self.base_layer(x, *args, **kwargs)  # [B, T, out], the base matmul once for the batch
            rows = self.table.rows
            if rows is None:  # every row is the base
                return out
            present = [s for s in dict.fromkeys(rows.tolist()) if s in self.slots]
            if not present:
                return out
            if len(present) == 1 and bool((rows == present[0]).all()):  # one adapter for every row
                return out + self._delta(x, present[0]).astype(out.dtype)
            for s in present:
                idx = paddle.to_tensor(np.nonzero(rows == s)[0].astype("int64"))  # [n]
                upd = paddle.gather(out, idx, axis=0) + self._delta(paddle.gather(x, idx, axis=0), s).astype(out.dtype)
                out = paddle.scatter(out, idx, upd, overwrite=True)
            return out

    return RowLoRALinear


class RowAdapters:
    """The per-row adapters of one base model: slots, the wrapped layers, and the rows of the batch running."""

    def __init__(self, model):
        self.model = model
        self.rows: Optional[np.ndarray] = None  # [B] slot per batch row, -1 = base; None = base for all
        self.layers: Dict[str, object] = {}  # layer name -> RowLoRALinear
        self.slots: Dict[str, int] = {}  # adapter name -> slot
        self.lock = threading.Lock()  # held by a forward pass and by load / unload
        self._next = 0

    def _unwrap(self) -> None:
        for name, layer in self.layers.items():
            set_sublayer(self.model, name, layer.base_layer)

    def _wrap(self) -> None:
        for name, layer in self.layers.items():
            set_sublayer(self.model, name, layer)

    def add(self, name: str, path: str, base_name: str):
        """Load the LoRA adapter at ``path`` as ``name``; its config.  PredictInputError when it does not fit."""
        from ..predict.lora_rows import read_lora_rows

        cls = _row_linear_class()
        with self.lock:
            self._unwrap()  # the plain base: the adapter loader finds its target layers by name
            try:
                cfg, rows = read_lora_rows(self.model, path, base_name)
            finally:
                self._wrap()
            slot, self._next = self._next, self._next + 1
            for lname, base_layer, a, b, scaling in rows:
                row = self.layers[lname] if lname in self.layers else cls(base_layer, self)
                row.slots[slot] = (a, b, scaling)  # A [in, r], B [r, out]
                self.layers[lname] = row
                set_sublayer(self.model, lname, row)
            self.slots[name] = slot
        return cfg

    def remove(self, name: str) -> None:
        with self.lock:
            slot = self.slots.pop(name)
            for layer in self.layers.values():
                layer.slots.pop(slot, None)

    def set_rows(self, slots: List[int]) -> None:
        self.rows = None if all(s < 0 for s in slots) else np.asarray(slots, dtype="int64")
