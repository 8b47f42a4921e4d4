"""Tiny random models of PaddleNLP's decoder families, built with PaddleNLP's own Config / *ForCausalLM.

hidden 64, 2 layers, vocab 512; the tokenizer is the tiny Llama's SentencePiece one (its files are copied:
``tokenizer_config.json`` names ``LlamaTokenizer``, which every family's run loads through AutoTokenizer).
Used by tests/test_families.py and tests/test_families_e2e.py.
"""

import glob
import os
import shutil

#: model_type -> (Config class, ForCausalLM class, sizes)
TINY_FAMILIES = {
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    ),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
    ),
    "chatglm_v2": (
        "ChatGLMv2Config",
        "ChatGLMv2ForCausalLM",
        dict(
            hidden_size=64,
            ffn_hidden_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query_group_num=2,
            multi_query_attention=True,
            kv_channels=16,
            max_sequence_length=1024,
            padded_vocab_size=512,
        ),
    ),
    "qwen": (
        "QWenConfig",
        "QWenForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=352,
            num_hidden_layers=2,
            num_attention_heads=4,
            kv_channels=16,
            max_position_embeddings=1024,
            seq_length=1024,
        ),
    ),
    # refused (its blocks get no gradient on Paddle 3.3); built to show it (tests/test_families.py)
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=64, n_layer=2, n_head=4)),
    "gpt": (
        "GPTConfig",
        "GPTForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=1024,
        ),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=1024,
        ),
    ),
    "codegen": (
        "CodeGenConfig",
        "CodeGenForCausalLM",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=1024, n_ctx=1024, rotary_dim=8),
    ),
}


def build_family_model(model_type: str, out_dir: str, tokenizer_dir: str, seed: int = 0) -> str:
    """Write a random tiny ``model_type`` model (safetensors) + the tiny Llama tokenizer to ``out_dir``."""
    import paddle
    import paddlenlp.transformers as T

    config_cls, model_cls, sizes = TINY_FAMILIES[model_type]
    if os.path.isfile(os.path.join(out_dir, "config.json")) and glob.glob(os.path.join(out_dir, "*.safetensors")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    # the tiny Llama's special ids; initializer_range as models/tiny.py (a frozen random head must be expressive)
    config = getattr(T, config_cls)(
        vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, **{"initializer_range": 0.2, **sizes}
    )
    paddle.seed(seed)
    model = getattr(T, model_cls)(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        if "token" in name or name.endswith(".model"):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    return out_dir
