"""The causal LM as body + lm_head, for callers that need logits at a few positions only.

PaddleNLP's ``*ForCausalLM.forward`` applies ``lm_head`` to every position:
``[B, S, H] @ [H, V]``.  Preference training scores only the answer tokens, so
on families listed here it runs the body, gathers the ``T`` scored hidden rows
and applies ``lm_head`` to those alone (``[T, H] @ [H, V]``): the prompt and
padding positions then cost neither lm_head FLOPs nor a ``[B, S, V]`` logits
tensor (4 GiB in fp32 for 8 x 4096 tokens and a 32k vocabulary; 5x that for
Qwen2's 152k).

Only families whose forward is exactly ``logits = lm_head(body(...)[0])`` when
no labels are given are listed (checked by reading PaddleNLP 3.0.0b4's
``LlamaForCausalLM`` and ``Qwen2ForCausalLM``, whose forward our ``Qwen3ForCausalLM``
inherits; ``tests/test_dpo_packing.py`` and ``tests/test_qwen3.py`` compare the two paths).  Sequence parallel and tensor-parallel logits change
what ``lm_head`` returns, so they take the full forward.
"""

from typing import Any, Optional, Tuple

from .family_table import FAMILIES

#: model_type -> attribute of the ``*ForCausalLM`` holding the decoder body (PaddleNLP's base_model_prefix):
#: the PaddleNLP / qwen3 classes read above, and the dense rows of our decoder (``DecoderForCausalLM.forward`` is
#: ``lm_head(body(...)[0])``, its lm_head carrying the row's bias and final soft-cap).  The decoder's MoE rows are
#: left out: their forward also adds the router's aux loss, which a body-only forward would drop.
BODY_ATTRIBUTE = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    **{k: f.body_prefix for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp != "moe"},
}
#: the decoder's MoE rows: their body returns the router logits (``router_logits``) from which a caller that asks
#: for them (``split_lm_head(model, router_aux=True)``) computes the aux loss itself (training/moe_aux.py; the
#: fine-tuning loss, training/loss.py, through ``DecoderForCausalLM.record_moe_forward``)
MOE_BODY_ATTRIBUTE = {
    k: f.body_prefix for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp == "moe"
}


def split_lm_head(model: Any, router_aux: bool = False) -> Optional[Tuple[Any, Any]]:
    """``(body, lm_head)`` if ``model``'s logits are ``lm_head(body(...)[0])``, else None.

    ``router_aux``: the caller takes the router's aux loss from the body's output itself
    (``training.moe_aux.record_body_forward``), so the decoder's MoE rows split too."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    attr = BODY_ATTRIBUTE.get(model_type) or (MOE_BODY_ATTRIBUTE.get(model_type) if router_aux else None)
    if attr is None:
        return None
    if not router_aux and callable(getattr(model, "moe_blocks", None)) and model.moe_blocks():
        # the decoder's MoE row under a model_type listed above (a transformers-layout qwen3_moe, which trains on
        # the decoder; PaddleNLP's layout on models/qwen3): its forward adds the aux loss a body-only one drops
        # (with router_aux the caller takes it from the body's router logits, as on the other MoE rows)
        return None
    if getattr(config, "sequence_parallel", False) or int(getattr(config, "tensor_parallel_degree", 1) or 1) > 1:
        return None
    body, head = getattr(model, attr, None), getattr(model, "lm_head", None)
    if body is None or head is None:
        return None
    return body, head


#: lm_head classes whose forward is ``matmul(hidden, weight, transpose_y)`` without tensor or sequence parallel
PLAIN_HEADS = ("LlamaLMHead", "Qwen2LMHead")


def plain_head_weight(head: Any) -> Optional[Tuple[Any, bool]]:
    """``(weight, transpose_y)`` if ``head(x)`` is ``x @ weight`` (``x @ weight^T`` when tied to the embeddings),
    so that the loss can apply the weight itself in chunks (``kernels.linear_cross_entropy``); else None
    (an adapter on lm_head, tensor-parallel output, another family's head, the decoder's head with a bias
    (ERNIE-4.5-MoE) or a final soft-cap (Gemma 2))."""
    if type(head).__name__ == "DecoderLMHead":  # the decoder's rows, dense and MoE (models/decoder/modeling.py)
        if head.tp is not None or head.bias is not None or head.softcap is not None:
            return None
        return head.weight, bool(head.transpose_y)
    if type(head).__name__ not in PLAIN_HEADS:
        return None
    config = getattr(head, "config", None)
    if (
        config is None
        or getattr(config, "sequence_parallel", False)
        or int(getattr(config, "tensor_parallel_degree", 1) or 1) > 1
    ):
        return None
    weight = getattr(head, "weight", None)
    return None if weight is None else (weight, bool(getattr(head, "transpose_y", False)))
