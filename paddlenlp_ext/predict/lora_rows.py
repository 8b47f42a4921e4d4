"""LoRA adapters read off a shared base for per-row serving (``serve.multilora``): the predictor's adapter
loader applied to the base, its matrices taken, the base restored untouched.

``per_row_refusal`` says which adapters cannot be applied per row (they keep the merged copy of
``predict.session.attach_adapter``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from .inputs import PredictInputError
from .options import adapter_kind


def per_row_refusal(path: str) -> Optional[str]:
    """None when the adapter at ``path`` is plain LoRA (also rsLoRA, LoRA+); else why it is not."""
    from ..adapters.config import AdapterConfig

    if adapter_kind(path) != "adapter":
        return "not an adapter_config.json adapter (PaddleNLP's LoRA format or prefix tuning)"
    try:
        cfg = AdapterConfig.load(path)
    except (ValueError, OSError) as e:
        return str(e)
    if cfg.method != "lora":
        return f"a {cfg.method} adapter"
    if cfg.pissa:
        return "a PiSSA adapter (it changes the base weights)"
    if cfg.quantization:
        return "an adapter trained on a quantized base (QLoRA)"
    return None


def set_sublayer(model, name: str, layer) -> None:
    """Put ``layer`` at the dotted ``name`` of ``model`` (``"llama.layers.0.self_attn.q_proj"``)."""
    parent = model
    *path, last = name.split(".")
    for p in path:
        parent = getattr(parent, p)
    setattr(parent, last, layer)


def read_lora_rows(model, path: str, base_name: str) -> Tuple[object, List[Tuple[str, object, object, object, float]]]:
    """(config, [(layer name, base layer, A [in, r], B [r, out], scaling)]) of the LoRA adapter at ``path`` on
    the plain ``model``, which is left as it was; PredictInputError when the adapter does not fit it."""
    from ..adapters import AdapterError, load_adapter
    from ..adapters.base import iter_adapter_layers

    try:
        cfg = load_adapter(model, path)
    except (AdapterError, ValueError, OSError, NotImplementedError) as e:
        for name, layer in iter_adapter_layers(model):
            set_sublayer(model, name, layer.base_layer)
        raise PredictInputError(f"--lora_path {path} does not fit the base model {base_name}: {e}") from e
    out = []
    for name, layer in iter_adapter_layers(model):
        set_sublayer(model, name, layer.base_layer)
        out.append((name, layer.base_layer, layer.lora_A.detach(), layer.lora_B.detach(), float(layer.scaling)))
    return cfg, out
