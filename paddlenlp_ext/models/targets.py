"""Which Linear layers of a model family are "the decoder linears".

The single definition used by adapters (default ``lora_target_modules``) and by
quantization (default layers to quantize).  Patterns are ``re.fullmatch``-ed
against ``named_sublayers()`` names; callers keep only Linear-like layers, so a
pattern may also match containers (``llama.layers.0.mlp``).

    >>> import re
    >>> [n for n in ("llama.layers.0.self_attn.q_proj", "llama.embed_tokens", "lm_head")
    ...  if any(re.fullmatch(p, n) for p in decoder_linear_targets("llama"))]
    ['llama.layers.0.self_attn.q_proj']
"""

from typing import Dict, List, Optional, Tuple

from .family_table import FAMILIES, LAYERS_BLOCKS

# Every Linear inside the numbered decoder blocks: q/k/v/o (or fused qkv) and the
# MLP projections.  Embeddings and lm_head are outside the blocks and never match.
_DECODER_BLOCKS = LAYERS_BLOCKS

#: model_type (config.json) -> target patterns, from the family table (models/family_table.py).
#: Families not listed use the decoder-block pattern ``layers.N``.
DECODER_LINEAR_TARGETS: Dict[str, Tuple[str, ...]] = {k: f.targets for k, f in FAMILIES.items()}

#: Sublayer names containing these are never adapted or quantized, even when a
#: user pattern matches them (tied embeddings / output head stay full precision).
NEVER_TARGET_PARTS = ("lm_head", "embed")


def decoder_linear_targets(model_type: Optional[str] = None) -> List[str]:
    """Default target patterns for ``model_type`` (None: the generic decoder-block pattern)."""
    return list(DECODER_LINEAR_TARGETS.get(model_type or "", _DECODER_BLOCKS))
