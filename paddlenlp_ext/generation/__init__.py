"""Model-agnostic batched decoding shared by the trainers: the rollout engine (``rollouts.py``).

It knows nothing of serving, training or data: it takes a PaddleNLP causal LM and token ids and returns
token ids.  GRPO's ``rollout_engine: engine`` samples through it (docs/alignment.md).
"""

from .rollouts import SampleGroup, sample_batch

__all__ = ["SampleGroup", "sample_batch"]
