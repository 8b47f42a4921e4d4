"""PaddleNLP's "llm meta" training keys (``LlmMetaConfig``) -> the model config.

Owns: which of those keys reach the model config here and which only get a
notice (a console line of the run, printed by ``training.model_build``).  The keys and their kind (``model_config``, ``gpu_fusion``,
``gpt_only``) are declared once, in ``config.schema.ExtraTrainingArgument``
(field metadata ``llm_meta``); keys we cannot honour are refused there.
"""

from __future__ import annotations

from typing import Any, Dict, List


def on_gpu() -> bool:
    """A CUDA build with at least one visible GPU."""
    import paddle

    return paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def apply_llm_meta(cfg, model_config, on_gpu: bool) -> Dict[str, Any]:
    """Copy PaddleNLP's "llm meta" training keys into the model config, as its run_finetune does.

    Recompute keys always apply; GPU-only fusions (same results, other kernels) apply on GPU only;
    the keys not applied get a notice from :func:`llm_meta_notices`.  Returns {key: value applied}.
    """
    applied = {}
    for name, spec in _meta_fields(cfg):
        if spec.llm_meta == "model_config" or (spec.llm_meta == "gpu_fusion" and on_gpu):
            setattr(model_config, name, cfg.training[name])
            applied[name] = cfg.training[name]
    return applied


def llm_meta_notices(cfg, on_gpu: bool) -> List[str]:
    """One console line per llm-meta key set in the config that this run does not apply.

    ``{"use_fused_rms_norm": true}`` on CPU -> ``["notice: use_fused_rms_norm=True is a GPU-only
    fused kernel (same results, other speed); this run is on CPU, where the unfused ops run"]``;
    keys left at their default get no line.
    """
    out = []
    for name, spec in _meta_fields(cfg):
        value = cfg.training[name]
        if spec.llm_meta == "model_config" or (spec.llm_meta == "gpu_fusion" and on_gpu) or value == spec.default:
            continue
        why = (
            "a GPU-only fused kernel (same results, other speed); this run is on CPU, where the unfused ops run"
            if spec.llm_meta == "gpu_fusion"
            else "read by PaddleNLP's GPT models only; Llama and Qwen2 do not use it"
        )
        out.append(f"notice: {name}={value} is {why}")
    return out


def _meta_fields(cfg):
    from ..config.fields import all_fields

    return [
        (name, spec)
        for name, spec in all_fields().items()
        if spec.llm_meta is not None and not spec.unsupported and name in cfg.training
    ]
