"""training/heap.py's policy, measured in fresh processes: freed tensor-sized blocks are reused within a
step (few page faults) and go back to the OS between steps (release_free_memory)."""

import subprocess
import sys

from conftest import ROOT

STEPS = """
import sys; sys.path.insert(0, {root!r})
import numpy as np, psutil
from paddlenlp_ext.training import heap
assert heap.limit_heap_retention()
rss = lambda: psutil.Process().memory_info().rss
keep = [np.ones(1000, np.float32) for _ in range(2000)]  # small live objects between the big blocks
base = rss()
for step in range(6):  # like training steps: many tensors of varied size, all freed at the end
    blocks = []
    for i in range(40):
        blocks.append(np.ones(280_000 + (i + step) % 5 * 50_000, np.float32))  # 1.1-1.9 MB: under 2 MiB
        keep.append(np.ones(1000, np.float32))  # a small survivor after each block pins the heap
    del blocks
    if {trim}:
        assert heap.release_free_memory()
print((rss() - base) / 2**20)
"""

REUSE = """
import sys, resource; sys.path.insert(0, {root!r})
import numpy as np
from paddlenlp_ext.training import heap
if {policy!r} == "ours":
    assert heap.limit_heap_retention()
else:  # the first policy: every block of 1 MiB or more its own mmap
    lib = heap._libc(); assert lib.mallopt(heap.M_MMAP_THRESHOLD, 1 << 20)
keep = []
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(200):  # a step's forward and backward: same-sized temporaries, freed as the next ones come
    a = np.ones(375_000, np.float32)  # 1.5 MB: over the first policy's 1 MiB, under ours 2 MiB
    keep.append(np.ones(100, np.float32))
    del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def child(code: str) -> float:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return float(r.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_returned_between_steps():
    kept = child(STEPS.format(root=ROOT, trim=False))
    released = child(STEPS.format(root=ROOT, trim=True))
    # blocks under the 2 MiB threshold stay in the heap (fragmented by the small survivors) until
    # release_free_memory hands the free pages back, as HeapTrim does after every micro-step
    assert released < 8, (kept, released)
    assert kept > 3 * max(released, 1), (kept, released)


def test_freed_blocks_are_reused_within_a_step():
    ours = child(REUSE.format(root=ROOT, policy="ours"))
    mmap_each = child(REUSE.format(root=ROOT, policy="mmap1m"))
    # 200 x 1.5 MB as fresh mmaps: ~200 x 367 zero-filled 4 KiB pages; reused from the heap: the first block's
    assert mmap_each > 50_000, mmap_each
    assert ours < 0.05 * mmap_each, (ours, mmap_each)


def test_heap_trim_runs_after_every_micro_step_and_step(monkeypatch):
    from paddlenlp_ext.training import heap
    from paddlenlp_ext.training.callbacks import HeapTrim

    calls = []
    monkeypatch.setattr(heap, "release_free_memory", lambda: calls.append(1) or True)
    HeapTrim().on_substep_end(None, None, None)
    HeapTrim().on_step_end(None, None, None)
    assert len(calls) == 2


def test_every_training_run_attaches_the_heap_trim():
    from paddlenlp_ext.training.callbacks import HeapTrim, StepTimer, attach_step_callbacks

    class Trainer:
        def __init__(self):
            self.callbacks = []

        def add_callback(self, callback):
            self.callbacks.append(callback)

    trainer = Trainer()
    timer = attach_step_callbacks(trainer)
    assert isinstance(timer, StepTimer) and timer in trainer.callbacks
    assert any(isinstance(c, HeapTrim) for c in trainer.callbacks)
    with open(f"{ROOT}/paddlenlp_ext/training/recipe.py") as f:  # the one run recipe of every mode
        assert "attach_step_callbacks(trainer)" in f.read()
