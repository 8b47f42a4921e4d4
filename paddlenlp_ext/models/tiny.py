"""Build a tiny Llama-architecture (or Qwen2 / Qwen3) model directory for the demo and the tests.

Random init (seeded) + a SentencePiece tokenizer trained on the bundled data,
saved exactly like a real PaddleNLP model directory (config.json,
model.safetensors, tokenizer files), so every code path that loads a real
model is exercised without any download.
"""

import glob
import io
import json
import os
import tempfile
from typing import Dict, Optional

TINY_DEFAULTS = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # Larger than Llama's 0.02: a random model's frozen lm_head and norms must
    # be able to express confident predictions, or LoRA (which trains only the
    # decoder's linear layers) cannot lower the loss much on a random base.
    initializer_range=0.2,
)

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
#: Qwen3's own keys: head_dim deliberately != hidden_size / num_attention_heads (64 / 4 = 16)
QWEN3_DEFAULTS = dict(head_dim=32, attention_bias=False)
#: Qwen3-MoE: 4 experts, top 2; layer 1 of 2 stays dense (mlp_only_layers), so both MLP kinds are present
QWEN3_MOE_DEFAULTS = dict(
    QWEN3_DEFAULTS,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    norm_topk_prob=True,
    mlp_only_layers=[1],
)


def _corpus(data_dir: str):
    for path in sorted(glob.glob(os.path.join(data_dir, "*.json"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    for key in ("src", "tgt"):
                        vals = row[key] if isinstance(row[key], list) else [row[key]]
                        yield from vals


def train_sentencepiece(data_dir: str, vocab_size: int) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(_corpus(data_dir))),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        byte_fallback=True,  # any text is encodable, as with the real Llama tokenizer
        num_threads=1,  # deterministic
        minloglevel=2,
    )
    return buf.getvalue()


def build_tiny_model(
    out_dir: str,
    data_dir: Optional[str],
    vocab_size: int = 512,
    seed: int = 0,
    spm_model: Optional[str] = None,
    family: str = "llama",
    **overrides,
) -> str:
    """Write a random-init tiny LlamaForCausalLM (``family="qwen2"``: Qwen2ForCausalLM, same
    sizes and SentencePiece tokenizer; ``family="qwen3"``: our Qwen3ForCausalLM, same sizes but
    ``head_dim=32`` != hidden / heads, so code that assumes ``hidden // heads`` fails on it;
    ``family="qwen3_moe"``: the same with 4 experts, top 2, layer 1 dense)
    + tokenizer to ``out_dir``; returns out_dir.

    The tokenizer is trained on ``data_dir``'s *.json lines, or taken from an
    existing SentencePiece ``spm_model`` (e.g. the real Llama 2 tokenizer, for
    benchmarks whose sequence lengths must be realistic)."""
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer, Qwen2Config, Qwen2ForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        spm_path = os.path.join(tmp, "tokenizer.model")
        with open(spm_path, "wb") as f:
            if spm_model:
                with open(spm_model, "rb") as src:
                    f.write(src.read())
            else:
                f.write(train_sentencepiece(data_dir, vocab_size))
        tokenizer = LlamaTokenizer(
            vocab_file=spm_path, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
        )
        tokenizer.save_pretrained(out_dir)  # copies the sentencepiece model while tmp exists
    kw: Dict = dict(TINY_DEFAULTS)
    kw.update(overrides)
    if family not in TINY_FAMILIES:
        raise ValueError(f"tiny model family must be one of {sorted(TINY_FAMILIES)}, got {family!r}")
    if family == "qwen3":
        from .qwen3 import Qwen3Config, Qwen3ForCausalLM

        kw = {**QWEN3_DEFAULTS, **kw}
        config_cls, model_cls = Qwen3Config, Qwen3ForCausalLM
    elif family == "qwen3_moe":
        from .qwen3 import Qwen3MoeConfig, Qwen3MoeForCausalLM

        kw = {**QWEN3_MOE_DEFAULTS, **kw}
        config_cls, model_cls = Qwen3MoeConfig, Qwen3MoeForCausalLM
    else:
        config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
            family
        ]
    config = config_cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kw,
    )
    paddle.seed(seed)
    model = model_cls(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def ensure_tiny_model(out_dir: str, data_dir: str, **kw) -> Optional[str]:
    """Build the tiny model unless ``out_dir`` already holds one."""
    if os.path.isfile(os.path.join(out_dir, "config.json")) and glob.glob(os.path.join(out_dir, "*.safetensors")):
        return out_dir
    return build_tiny_model(out_dir, data_dir, **kw)
