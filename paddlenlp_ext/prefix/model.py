"""The prefix encoder and the wrapper that runs a frozen Llama / Qwen2 behind it.

For every layer l the attention of a real token t over the keys is

    softmax([q_t K_l^prefix ; q_t K_l^real(<= t)] / sqrt(D)) [V_l^prefix ; V_l^real(<= t)]

where K_l^prefix, V_l^prefix [P, H_kv, D] are trained and K^real, V^real come
from the frozen model.  The prefix reaches the model as ``past_key_values``
(PaddleNLP Llama/Qwen2 layout: one ``(key, value)`` per layer, each
[batch, P, H_kv, D]); the model concatenates it in front of its own keys.

Positions: the real tokens keep positions 0..L-1.  PaddleNLP's Llama/Qwen2
build ``position_ids = arange(seq_len)`` whatever the cache length, and the
prefix keys are used as given (no rotary embedding), exactly as with
PaddleNLP's ``PrefixModelForCausalLM``; generation continues at L, L+1, ...

Masks (what every real token may see: all P prefix slots + its causal/packed
context):
  * eager attention (``use_flash_attention=false``): as PaddleNLP, a given
    2-D/3-D/4-D mask gets P leading "visible" columns; no mask stays None and
    the model builds ``ones([batch, P + L])`` with a causal part offset by P.
  * ``use_flash_attention=true``: the model's dense-mask flash path calls
    ``scaled_dot_product_attention(is_causal=True)``, whose CPU fallback aligns
    the causal mask top-left for L queries over P + L keys (token t would see
    only prefix slots 0..t).  So the wrapper always hands the model FlashMask
    start rows over the P + L key columns (prefix columns: never masked;
    causal part bottom-right aligned, as FlashAttention-2 on GPU), which
    routes attention to flashmask_attention (ours on CPU via
    ``integrations.flashmask.cpu_flashmask()``, Paddle's on GPU).  Packed rows
    with start rows (``flash_mask``) keep their per-example bounds; a
    [batch, L] padding mask becomes start rows (0 = column hidden); a dense
    [.., L, L] mask is refused (config.parse refuses that combination first).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import paddle
import paddle.nn as nn

from .config import ModelFacts, PrefixConfig, PrefixConfigError, model_mismatches


@contextlib.contextmanager
def _default_dtype(dtype: Optional[str]):
    old = paddle.get_default_dtype()
    if dtype:
        paddle.set_default_dtype(dtype)
    try:
        yield
    finally:
        paddle.set_default_dtype(old)


class PrefixEncoder(nn.Layer):
    """Prefix slot -> every layer's key/value for it: ``forward() -> [P, 2*L*H_kv*D]``.

    Parameters (PaddleNLP state key in brackets, see ``io.STATE_KEYS``):
      embedding.weight [P, 2*L*H_kv*D] ("0.weight")                      without projection
      embedding.weight [P, H_kv*D] ("0.weight"), proj_in Linear(H_kv*D, M) ("1.*"),
      proj_out Linear(M, 2*L*H_kv*D) ("3.*"), tanh between                with projection
    """

    def __init__(self, cfg: PrefixConfig):
        super().__init__()
        self.projection = bool(cfg.prefix_projection)
        if self.projection:
            m = cfg.prefix_projection_hidden_size
            self.embedding = nn.Embedding(cfg.num_prefix_tokens, cfg.kv_dim)
            self.proj_in = nn.Linear(cfg.kv_dim, m)
            self.proj_out = nn.Linear(m, cfg.output_dim)
        else:
            self.embedding = nn.Embedding(cfg.num_prefix_tokens, cfg.output_dim)

    def forward(self):
        x = self.embedding.weight  # [P, E]: the rows of embedding(arange(P))
        if self.projection:
            x = self.proj_out(paddle.tanh(self.proj_in(x)))  # [P, H_kv*D] -> [P, M] -> [P, 2*L*H_kv*D]
        return x


class PrefixModel(nn.Layer):
    """``PrefixModel(model, prefix_config)``: ``model`` (LlamaForCausalLM / Qwen2ForCausalLM)
    is frozen; ``prefix_encoder`` is the only trainable part.  Call it like the model."""

    def __init__(self, model: nn.Layer, prefix_config: PrefixConfig):
        super().__init__()
        facts = ModelFacts.of(model.config)
        problems = model_mismatches(prefix_config.validate(), facts)
        if problems:
            raise PrefixConfigError("; ".join(problems))
        self.model = model
        self.config = model.config
        self.prefix_config = prefix_config
        with _default_dtype(prefix_config.dtype):
            self.prefix_encoder = PrefixEncoder(prefix_config)
        self.prefix_dropout = nn.Dropout(p=prefix_config.prefix_dropout)
        for p in self.model.parameters():
            p.stop_gradient = True
        for p in self.prefix_encoder.parameters():
            p.stop_gradient = False

    # -- the prefix as past_key_values ------------------------------------
    def past_key_values(self, batch_size: int) -> Tuple[Tuple[paddle.Tensor, paddle.Tensor], ...]:
        """Per layer (key, value), each [batch, P, H_kv, D] (dropout per example, as PaddleNLP)."""
        c = self.prefix_config
        P, L = c.num_prefix_tokens, c.num_hidden_layers
        flat = self.prefix_encoder()  # [P, 2*L*H_kv*D]
        flat = self.prefix_dropout(flat.unsqueeze(0).expand([batch_size, P, c.output_dim]))  # [B, P, 2*L*H_kv*D]
        kv = flat.reshape([batch_size, P, 2 * L, c.num_kv_heads, c.head_dim])  # [B, P, 2L, H_kv, D]
        kv = kv.transpose([2, 0, 1, 3, 4])  # [2L, B, P, H_kv, D]: keys are 0..L-1, values L..2L-1
        return tuple((kv[i], kv[L + i]) for i in range(L))

    def prefix_cache(self) -> paddle.Tensor:
        """PaddleNLP's pre_caches.npy layout, without dropout: [L, 2, H_kv, P, D]."""
        c = self.prefix_config
        with paddle.no_grad():
            flat = self.prefix_encoder()  # [P, 2*L*H_kv*D]
            kv = flat.reshape([c.num_prefix_tokens, 2, c.num_hidden_layers, c.num_kv_heads, c.head_dim])
            return kv.transpose([2, 1, 3, 0, 4])  # [L, 2, H_kv, P, D]

    # -- masks ------------------------------------------------------------
    @property
    def _flash(self) -> bool:
        return bool(getattr(self.config, "use_flash_attention", False))

    def extend_masks(self, attention_mask, startend, batch_size: int, q_len: int, kv_len: int):
        """Masks over ``kv_len`` keys (prefix + cache + new tokens) for ``q_len`` new tokens;
        returns (attention_mask, attn_mask_startend_row_indices).  See the module doc."""
        P = self.prefix_config.num_prefix_tokens
        if startend is not None:
            if not self._flash:
                raise ValueError("attn_mask_startend_row_indices needs use_flash_attention=true")
            axis = 1 if startend.ndim == 2 else 2  # [B, L] or [B, 1, L] or [B, 1, L, bounds]
            shape = list(startend.shape)
            shape[axis] = P
            # prefix columns: every bound = q_len, i.e. no row of them is masked
            front = paddle.full(shape, q_len, dtype=startend.dtype)
            return None, paddle.concat([front, startend], axis=axis)
        if self._flash:
            if attention_mask is None:
                return None, paddle.full([batch_size, 1, kv_len], q_len, dtype="int32")  # [B, 1, kv]
            if attention_mask.ndim != 2:
                raise ValueError(
                    "prefix tuning with use_flash_attention=true takes FlashMask start rows or a [batch, seq] padding "
                    f"mask; got a dense mask of shape {attention_mask.shape} (zero_padding without flash_mask): set "
                    "flash_mask=true or use_flash_attention=false"
                )
            keep = self._pad_2d(attention_mask, kv_len).astype("bool")  # [B, kv]
            rows = paddle.where(
                keep, paddle.full_like(keep, q_len, dtype="int32"), paddle.zeros_like(keep, dtype="int32")
            )  # 0: masked for every row
            return None, rows.unsqueeze(1)  # [B, 1, kv]
        if attention_mask is None:
            return None, None  # the model builds ones([B, P + L]) and offsets its causal mask by P
        if attention_mask.ndim == 2:
            return self._pad_2d(attention_mask, kv_len), None
        if attention_mask.ndim not in (3, 4):
            raise ValueError(f"unexpected attention_mask shape {attention_mask.shape}")
        shape = list(attention_mask.shape)
        shape[-1] = P  # [B, L, P] or [B, 1|heads, L, P]
        ones = paddle.ones(shape, dtype=attention_mask.dtype)
        return paddle.concat([ones, attention_mask], axis=-1), None

    def _pad_2d(self, mask, kv_len: int):
        """[B, n] -> [B, kv_len] with visible columns in front (the prefix slots)."""
        front = kv_len - mask.shape[1]
        if front != self.prefix_config.num_prefix_tokens:
            raise ValueError(
                f"attention_mask covers {mask.shape[1]} keys; expected {kv_len} - "
                f"{self.prefix_config.num_prefix_tokens} prefix slots"
            )
        return paddle.concat([paddle.ones([mask.shape[0], front], dtype=mask.dtype), mask], axis=1)

    # -- forward / generate -------------------------------------------------
    def forward(
        self, input_ids=None, attention_mask=None, attn_mask_startend_row_indices=None, past_key_values=None, **kwargs
    ):
        if past_key_values is not None:
            raise ValueError("PrefixModel supplies past_key_values itself (the prefix); use generate() to decode")
        if input_ids is None:
            raise ValueError("PrefixModel needs input_ids")
        B, L = input_ids.shape
        P = self.prefix_config.num_prefix_tokens
        attention_mask, startend = self.extend_masks(attention_mask, attn_mask_startend_row_indices, B, L, P + L)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if startend is not None:
            kwargs["attn_mask_startend_row_indices"] = startend
        return self.model(input_ids=input_ids, past_key_values=self.past_key_values(B), **kwargs)

    def generate(self, input_ids=None, **kwargs):
        """``model.generate`` with the prefix in front (first step) and the masks extended every step."""
        if input_ids is None:
            raise ValueError("PrefixModel.generate needs input_ids")
        model = self.model
        original = model.prepare_inputs_for_generation

        def prepare(*args, **kw):
            inputs = original(*args, **kw)
            ids = inputs["input_ids"]  # [B, q]: the prompt, then one token per step
            if inputs.get("past_key_values") is None:
                inputs["past_key_values"] = self.past_key_values(ids.shape[0])
            kv_len = inputs["past_key_values"][0][0].shape[1] + ids.shape[1]
            mask, startend = self.extend_masks(inputs.get("attention_mask"), None, ids.shape[0], ids.shape[1], kv_len)
            inputs["attention_mask"] = mask
            if startend is not None:
                inputs["attn_mask_startend_row_indices"] = startend
            return inputs

        own = vars(model).get("prepare_inputs_for_generation")  # an instance override already there, if any
        model.prepare_inputs_for_generation = prepare  # instance attribute: model.generate looks it up on self
        try:
            return model.generate(input_ids, **kwargs)
        finally:
            if own is not None:
                model.prepare_inputs_for_generation = own
            else:
                del model.prepare_inputs_for_generation  # the class method again

    # -- delegation -------------------------------------------------------------
    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def save_pretrained(self, save_directory: str, **kwargs):
        """PaddleNLP's prefix directory (prefix_config.json, prefix_model_state.pdparams, pre_caches.npy)."""
        from .io import save_prefix

        return save_prefix(self, save_directory)
