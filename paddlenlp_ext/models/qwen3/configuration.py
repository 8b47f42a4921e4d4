"""``Qwen3Config``: Qwen2's config plus Qwen3's keys (``head_dim``, ``attention_bias``).

Qwen3 checkpoints' config.json (transformers layout or ours) carry ``head_dim``
explicitly, and it may differ from ``hidden_size // num_attention_heads``
(Qwen3-0.6B: hidden 1024, 16 heads, head_dim 128), so ``q_proj`` is
``[hidden, heads * head_dim]`` and ``o_proj`` ``[heads * head_dim, hidden]``.
"""

from paddlenlp.transformers import Qwen2Config

__all__ = ["Qwen3Config"]


class Qwen3Config(Qwen2Config):
    """Qwen2Config with ``model_type="qwen3"``, an explicit ``head_dim`` (default
    ``hidden_size // num_attention_heads``) and ``attention_bias`` (default False:
    Qwen3's q/k/v/o projections have no bias; True adds one to all four, as transformers)."""

    model_type = "qwen3"

    def __init__(self, head_dim=None, attention_bias=False, rope_scaling=None, **kwargs):
        super().__init__(**kwargs)
        self.head_dim = int(head_dim) if head_dim is not None else self.hidden_size // self.num_attention_heads
        self.attention_bias = bool(attention_bias)
        # transformers' rope_scaling dict (YaRN, ...); kept so that the model can refuse it by name
        self.rope_scaling = rope_scaling
