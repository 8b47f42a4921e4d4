"""What our Qwen3 does not implement, read from a config without importing paddle.

``unsupported_settings`` takes a config.json dict or a config object (with the
run's edits, e.g. ``fuse_attention_qkv``) and returns one message per refused
setting, each naming the key to change.  The model refuses them when built
(``Qwen3Attention``); ``training.model_build`` refuses them before any weight
is read (exit 2), and config validation may call it on config.json.

>>> unsupported_settings({"model_type": "qwen3", "use_sliding_window": False})
[]
>>> unsupported_settings({"use_sliding_window": True, "fuse_attention_qkv": True})  # doctest: +NORMALIZE_WHITESPACE
['use_sliding_window=true (sliding-window attention layers are not implemented; set use_sliding_window false)',
 'fuse_attention_qkv=true (q_norm/k_norm need q, k, v apart; set fuse_attention_qkv false)']
"""

from typing import Any, List


def unsupported_settings(config: Any) -> List[str]:
    """Messages for the Qwen3 settings this implementation refuses (empty: all supported)."""

    def get(key):
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    problems = []
    if get("use_sliding_window"):
        problems.append(
            "use_sliding_window=true (sliding-window attention layers are not implemented; "
            "set use_sliding_window false)"
        )
    if get("rope_scaling"):
        problems.append(f"rope_scaling={get('rope_scaling')!r} (only plain RoPE is implemented; remove rope_scaling)")
    if get("fuse_attention_qkv"):
        problems.append("fuse_attention_qkv=true (q_norm/k_norm need q, k, v apart; set fuse_attention_qkv false)")
    if get("refined_recompute"):
        problems.append("refined_recompute (not implemented for Qwen3's attention; remove refined_recompute)")
    if get("model_type") == "qwen3_moe":
        if get("output_router_logits"):
            problems.append(
                "output_router_logits=true (the router's load-balancing loss is not implemented; "
                "set output_router_logits false)"
            )
        if int(get("tensor_parallel_degree") or 1) > 1:
            problems.append(
                f"tensor_parallel_degree={get('tensor_parallel_degree')} (the experts are not split "
                "across ranks; set tensor_parallel_degree 1)"
            )
    return problems
