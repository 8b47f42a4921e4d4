"""The C heap policy of a training run (glibc ``mallopt`` / ``malloc_trim``): reuse within a step,
give back between steps.

Two measurements decide it (docs/benchmarks.md, "Training step speed"):

* glibc's dynamic mmap threshold keeps freed tensor blocks in the heap, where they fragment: on the
  0.8B shapes the RSS grew +420 MB after step 1 and +705 MB by step 3 while the live memory grew
  +18 MB.  So freed memory must go back to the OS between steps.
* Giving every block of 1 MiB or more its own mmap (this module's first policy) does that, but every
  tensor then arrives as fresh zero pages: ~10 M minor page faults over 12 micro-steps of 150-900
  tokens, 26 s of system time in a 65 s run.

So blocks under :data:`MMAP_THRESHOLD` come from the heap and are reused within a micro-step
(backward's gradients land in forward's freed pages), larger ones are mmapped and unmapped at free,
and :func:`release_free_memory` (``malloc_trim(0)``, run after every micro-step and optimizer step by
``callbacks.HeapTrim``) hands the free heap pages back between micro-steps.  2 MiB, measured through
the CLI against the first policy (bench/e2e.py, 10 LoRA steps at 0.25B, interleaved; 5 at 0.84B):
1.15x and 1.04x the supervised tokens/s at 0.98-0.99x the peak RSS, the same losses.  A 16 MiB threshold was
as fast but kept 1.3 GiB more at the peak on the 0.84B model (the heap's slack grows with the blocks
it holds); 4 MiB kept 0.2 GiB more.
"""

import ctypes
import ctypes.util
from typing import Optional

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's malloc.h
M_MMAP_THRESHOLD = -3

#: bytes: allocations of at least this size are mmapped (returned to the OS at free); smaller ones use the heap
MMAP_THRESHOLD = 2 << 20
#: bytes: free heap top above this is returned to the OS at free
TRIM_THRESHOLD = 16 << 20


def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:  # no loadable C library under that name (not a glibc system)
        return None
    return lib if hasattr(lib, "mallopt") else None


def limit_heap_retention() -> bool:
    """Fix glibc's mmap/trim thresholds for this process; False where there is no glibc."""
    lib = _libc()
    if lib is None:
        return False
    return bool(lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(lib.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_free_memory() -> bool:
    """Give the heap's free pages back to the OS (``malloc_trim(0)``: also the free chunks inside the
    heap, not only its top); False where there is no glibc.  A few ms on a heap of some GB."""
    lib = _libc()
    if lib is None or not hasattr(lib, "malloc_trim"):
        return False
    lib.malloc_trim(0)
    return True
