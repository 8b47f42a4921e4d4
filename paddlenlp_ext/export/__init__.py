"""Export to the Hugging Face ecosystem: transformers-layout models and PEFT adapters.

Owns the conversion of our outputs into files the other side's own code loads:

    hf_config  config.json / generation_config.json for transformers, from PaddleNLP's config
               (no paddle); settings transformers would compute differently are refused
    hf_model   export_hf_model (a PaddleNLP model directory -> transformers layout, streamed one
               tensor at a time) and export_merged_hf (merge an adapter, then export)
    peft_adapter  export_peft_adapter: an adapter saved by run_finetune.py -> PEFT's
               adapter_config.json + adapter_model.safetensors (LoRA, rsLoRA, LoRA+, PiSSA, VeRA, LoKr)

The tensor-name table lives in ``models/hf_layout.py`` (``paddle_name`` / ``hf_name``), so the
loader and the export read one table both ways.  Problems with the input raise
:class:`ExportError` (the CLIs exit 2).  See docs/export.md.
"""

from .hf_config import ExportError, ExportVerifyFailed, hf_config_from_paddle, hf_generation_config
from .hf_model import ExportResult, export_hf_model, export_merged_hf
from .peft_adapter import export_peft_adapter

__all__ = [
    "ExportError",
    "ExportVerifyFailed",
    "ExportResult",
    "export_hf_model",
    "export_merged_hf",
    "export_peft_adapter",
    "hf_config_from_paddle",
    "hf_generation_config",
]
