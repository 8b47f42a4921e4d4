"""Load what prediction needs: device, tokenizer (+ chat template), base model, adapter or prefix.

``--lora_path`` takes every adapter this repository trains or reads, through the
loaders training and the merge use:

* ``adapter_config.json`` (LoRA, rsLoRA, LoRA+, PiSSA, VeRA, LoKr, QLoRA) and PaddleNLP's
  ``lora_config.json``: ``adapters.load_adapter`` on the freshly loaded base, then merged in
  memory (one matmul per Linear at generation, as PaddleNLP's predictor does with
  ``LoRAModel.merge()``); an adapter trained on a quantized base (QLoRA) loads the base
  quantized the same way and stays unmerged;
* ``prefix_config.json`` (prefix tuning, PaddleNLP's format): ``prefix.io.load_prefix_model``.

A directory that does not fit the base (another architecture or size) is a
:class:`~.inputs.PredictInputError` naming the tensor and both shapes.  Also here:
``--device`` / ``--dtype`` checks (``matmul_supported``: Paddle's CPU build has no
bf16/fp16 matmul) and ``library_warnings_off`` (Paddle's notices about itself).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .inputs import PredictInputError
from .options import PredictOptions, adapter_kind

_log = logging.getLogger("paddlenlp_ext.predict")
_log.setLevel(logging.WARNING)  # load_model_streaming's per-file INFO lines are noise on a console


@contextlib.contextmanager
def library_warnings_off():
    """Within the block, hide the notices Paddle prints about itself at import and at the first forward
    (no ccache, setuptools/distutils, its own deprecated APIs such as incubate swiglu used by PaddleNLP's
    Llama): they are not about the user's input and would land in the middle of a chat."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No ccache found")
        warnings.filterwarnings("ignore", message="Setuptools is replacing distutils")
        warnings.filterwarnings("ignore", message=r"(?s).*API \".*\" is deprecated since")
        yield


@dataclass
class Session:
    """A model ready to generate and how to talk to it."""

    model: Any  # the causal LM (a prefix.model.PrefixModel around it for prefix directories)
    tokenizer: Any
    use_template: bool  # prompts rendered by the chat template (else training's default layout)
    eos_ids: List[int]  # any of them ends an answer
    pad_id: int
    device: str
    description: str  # one line: base, dtype, device, adapter
    jinja: Optional[str] = None  # the jinja chat template's source (prompt_template): it renders the prompts


def pick_device(requested: Optional[str]) -> str:
    import paddle

    has_gpu = paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if requested == "gpu" and not has_gpu:
        raise PredictInputError(
            "--device gpu: this Paddle build has no usable GPU (paddle.device.is_compiled_with_"
            "cuda() or the device count is 0); use --device cpu"
        )
    device = requested or ("gpu" if has_gpu else "cpu")
    paddle.set_device(device)
    return device


def load_tokenizer(o: PredictOptions):
    """(tokenizer, use_template): the model's tokenizer, with --chat_template loaded as training loads it."""
    from ..data.tokenize import resolve_chat_template
    from ..models.registration import register_qwen3

    register_qwen3()  # our model families (Qwen3) known to PaddleNLP's Auto classes
    from ..models.tokenizer import load_tokenizer as load_any_tokenizer

    try:
        tokenizer = load_any_tokenizer(o.model_name_or_path)  # tokenizer.json-only directories included
    except (OSError, ValueError, KeyError) as e:
        raise PredictInputError(
            f"--model_name_or_path {o.model_name_or_path}: cannot load its tokenizer "
            f"({type(e).__name__}: {e}); the directory needs the tokenizer files training "
            "saved"
        ) from e
    from jinja2 import TemplateError

    try:
        use_template = resolve_chat_template(tokenizer, o.chat_template)
    except (OSError, ValueError, TemplateError) as e:  # unreadable file, bad JSON, jinja syntax error
        raise PredictInputError(f"--chat_template {o.chat_template}: {type(e).__name__}: {e}") from e
    return tokenizer, use_template


def prompt_template(o: PredictOptions) -> Optional[str]:
    """The jinja chat template the prompts are rendered with, found as training finds it
    (``data.chat_template.find_template``: ``--chat_template FILE.jinja``, else the model directory's
    ``tokenizer_config.json`` / ``chat_template.jinja``); None without one or for PaddleNLP's
    ``chat_template.json`` (rendered by PaddleNLP)."""
    from ..data.chat_template import find_template
    from ..data.reader import DataError

    try:
        return find_template(o.model_name_or_path, o.chat_template)
    except DataError as e:  # a bad tokenizer_config.json or template list: the file is named
        raise PredictInputError(f"chat template: {e}") from e


def matmul_supported(dtype: str) -> bool:
    """Whether the current device multiplies ``dtype`` matrices (Paddle's CPU build has no bf16/fp16 matmul)."""
    import paddle

    x = paddle.ones([2, 2], dtype=dtype)  # [2, 2]
    try:
        paddle.matmul(x, x)
    except RuntimeError:  # "(NotFound) The kernel ... of kernel `matmul` is not registered"
        return False
    return True


def _quantization(lora_path: Optional[str]) -> Optional[Dict[str, Any]]:
    """The quantization the adapter was trained on (QLoRA), so the base is quantized the same way."""
    if not lora_path or adapter_kind(lora_path) != "adapter":
        return None
    from ..adapters.config import AdapterConfig

    try:
        return AdapterConfig.load(lora_path).quantization
    except (OSError, ValueError) as e:  # AdapterConfigError / PaddleNLPAdapterError name the file and key
        raise PredictInputError(f"--lora_path {lora_path}: {e}") from e


def load_base_model(o: PredictOptions, quantization: Optional[Dict[str, Any]]):
    from ..models.registration import register_qwen3
    from ..models.checkpoint import CheckpointError
    from ..models.loading import load_model_streaming
    from ..models.model_config import load_model_config

    register_qwen3()
    from ..models.registration import register_decoder

    register_decoder()  # our decoder's rows (models/family_table.py, Family.decoder)
    try:
        config = load_model_config(o.model_name_or_path, dtype=o.dtype)
        # eager attention, as PaddleNLP's predictor without --use_flash_attention (same math, any device)
        config.use_flash_attention = False
        model, _ = load_model_streaming(
            o.model_name_or_path, config, o.dtype, quantization=quantization, logger=_log, max_seq_len=o.max_length
        )
    except (CheckpointError, ValueError) as e:  # names the tensor / file and what to do
        raise PredictInputError(f"--model_name_or_path {o.model_name_or_path}: {e}") from e
    return model


def attach_adapter(model, o: PredictOptions) -> tuple:
    """(model, description) with --lora_path applied."""
    path, base = o.lora_path, o.model_name_or_path
    if adapter_kind(path) == "prefix":
        from ..prefix.config import PrefixConfigError
        from ..prefix.io import load_prefix_model

        try:
            pm = load_prefix_model(model, path, o.dtype)
        except (PrefixConfigError, OSError) as e:
            raise PredictInputError(f"--lora_path {path} does not fit the base model {base}: {e}") from e
        return pm, f"prefix tuning {path} ({pm.prefix_config.num_prefix_tokens} prefix tokens)"
    from ..adapters import AdapterError, load_adapter, merge_adapters

    try:
        cfg = load_adapter(model, path)
    except (AdapterError, ValueError, OSError, NotImplementedError) as e:
        # AdapterError: a tensor whose shape differs from the base's (named, both shapes); ValueError: the
        # config (AdapterConfigError, PaddleNLP's refused features) or no target layer in this model
        raise PredictInputError(f"--lora_path {path} does not fit the base model {base}: {e}") from e
    kind = cfg.layer_type + ("+rslora" if cfg.rslora else "")
    if cfg.quantization:
        return model, f"{kind} adapter {path} (r={cfg.r}) on a {cfg.quantization['weight_quantize_algo']} base"
    merge_adapters(model)
    return model, f"{kind} adapter {path} (r={cfg.r}, merged in memory)"


def eos_token_ids(tokenizer, model) -> List[int]:
    """The tokenizer's EOS plus any the model's generation_config.json names (e.g. chat end-of-turn tokens)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    for t in [extra] if isinstance(extra, int) else list(extra or []):
        if isinstance(t, int) and t not in ids:
            ids.append(t)
    if not ids:
        raise PredictInputError(
            f"{_tokenizer_name(tokenizer)}: the tokenizer has no eos_token and "
            "generation_config.json names none, so an answer could never end; set eos_token in "
            "tokenizer_config.json"
        )
    return ids


def _tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def load_session(o: PredictOptions, tokenizer, use_template: bool) -> Session:
    """Device, base model (streamed, in --dtype), --lora_path; the model in eval mode."""
    from paddlenlp.utils.log import logger as pnlp_logger

    device = pick_device(o.device)
    if o.dtype != "float32" and not matmul_supported(o.dtype):
        raise PredictInputError(
            f"--dtype {o.dtype}: this Paddle build has no {o.dtype} matmul kernel on {device}; "
            "use --dtype float32" + ("" if device == "gpu" else " (half precision needs a GPU)")
        )
    if o.seed is not None:
        import paddle

        paddle.seed(o.seed)
    old_level = pnlp_logger.logger.level
    pnlp_logger.set_level("WARNING")  # from_pretrained's "Loading configuration file ..." lines
    try:
        model = load_base_model(o, _quantization(o.lora_path))
        what = "no adapter"
        if o.lora_path:
            model, what = attach_adapter(model, o)
    finally:
        pnlp_logger.logger.setLevel(old_level)
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    name = os.path.basename(os.path.normpath(o.model_name_or_path))
    return Session(
        model=model,
        tokenizer=tokenizer,
        use_template=use_template,
        eos_ids=eos_token_ids(tokenizer, model),
        pad_id=int(pad if pad is not None else 0),
        device=device,
        description=f"{name} ({o.dtype}, {device}) + {what}",
        jinja=prompt_template(o),
    )
