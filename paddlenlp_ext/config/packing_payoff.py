"""Where packing (``zero_padding``) cannot make a fine-tune faster: the configuration line says so.

Packing puts several examples into one row of ``max_length``.  It saves the padding an unpacked batch
carries and the fixed cost of each extra micro-step, and it pays attention over the row.  On a CPU, at
``per_device_train_batch_size`` 1, an unpacked batch is one example with no padding at all, and a
step of a model as wide as the 0.25B Llama costs per token (the matmuls), so there is nothing left to
save: measured in ``docs/benchmarks.md`` ("Packing on CPU": 0.85-1.0x supervised tokens/s at hidden
1024 with per-document attention, 0.88-1.06x through the CLI; 2.15x on a 64-wide toy model, whose steps
are all fixed cost; at batch 4, where half an unpacked batch is padding, 1.72x through the CLI).
With the dense mask (``flash_mask`` off) every layer also attends over the whole row (max_length^2
scores instead of the documents' sum of squares), which costs more than the padding it removes.

:func:`packing_payoff` returns the notice (or None); the run prints it on its configuration line and
changes nothing: the user's choice stands (packing also changes which examples share a step).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["packing_payoff", "WIDE_HIDDEN"]

#: hidden size from which a CPU step at batch 1 is measured to cost per token (docs/benchmarks.md)
WIDE_HIDDEN = 1024


def packing_payoff(
    zero_padding: bool, flash_mask: bool, batch_size: int, hidden_size: Optional[int], on_cpu: bool
) -> Optional[str]:
    """The configuration line's packing notice, or None where packing can pay off (or is off).

    >>> packing_payoff(True, True, 1, 1024, on_cpu=True)
    'packing: expect no speed-up on this CPU (batch 1 holds no padding to remove, and at hidden size 1024 a step costs per token); kept as configured'
    >>> packing_payoff(True, False, 4, 1024, on_cpu=True)
    'packing: expect no speed-up on this CPU (flash_mask=false attends over the whole packed row: use_flash_attention + flash_mask attend per document); kept as configured'
    >>> packing_payoff(True, True, 4, 1024, on_cpu=True) is None    # batch 4: packing removes its padding
    True
    >>> packing_payoff(True, False, 1, 1024, on_cpu=False) is None  # GPU: not measured here, no claim
    True
    """
    if not zero_padding or not on_cpu:
        return None
    reasons = []
    if batch_size <= 1 and hidden_size is not None and hidden_size >= WIDE_HIDDEN:
        reasons.append(f"batch 1 holds no padding to remove, and at hidden size {hidden_size} a step costs per token")
    if not flash_mask:
        reasons.append(
            "flash_mask=false attends over the whole packed row: use_flash_attention + flash_mask attend per document"
        )
    if not reasons:
        return None
    return f"packing: expect no speed-up on this CPU ({'; '.join(reasons)}); kept as configured"
