"""PaddleNLP's "llm meta" training keys (``LlmMetaConfig``) -> the model config.

Owns: which of those keys reach the model config here and which only get a
notice.  The keys and their kind (``model_config``, ``gpu_fusion``,
``gpt_only``) are declared once, in ``config.schema.ExtraTrainingArgument``
(field metadata ``llm_meta``); keys we cannot honour are refused there.
"""

from __future__ import annotations

import sys
from typing import Any, Dict


def on_gpu() -> bool:
    """A CUDA build with at least one visible GPU."""
    import paddle

    return paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def apply_llm_meta(cfg, model_config, on_gpu: bool) -> Dict[str, Any]:
    """Copy PaddleNLP's "llm meta" training keys into the model config, as its run_finetune does.

    Recompute keys always apply; GPU-only fusions (same results, other kernels) apply on GPU and
    get a one-line notice on CPU; GPT-only keys get a notice.  Returns {key: value applied}.
    """
    from paddlenlp.utils.log import logger

    from ..config.fields import all_fields

    applied = {}
    for name, spec in all_fields().items():
        if spec.llm_meta is None or spec.unsupported or name not in cfg.training:
            continue
        value = cfg.training[name]
        if spec.llm_meta == "model_config" or (spec.llm_meta == "gpu_fusion" and on_gpu):
            setattr(model_config, name, value)
            applied[name] = value
        elif value != spec.default:
            why = ("a GPU-only fused kernel (same results, other speed); this run is on CPU, where the unfused "
                   "ops run" if spec.llm_meta == "gpu_fusion" else
                   "read by PaddleNLP's GPT models only; Llama and Qwen2 do not use it")
            logger.info(f"notice: {name}={value} is {why}")
            print(f"[paddlenlp_ext] notice: {name}={value} is {why}", file=sys.stderr)
    return applied
