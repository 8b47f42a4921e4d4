"""Config-time refusals from the model-family table (``models/family_table.py``), without importing paddle.

The model's ``model_type`` is read from ``model_name_or_path/config.json``; a family the
table refuses, a model_type not in the table (unless ``PADDLENLP_EXT_UNLISTED_MODEL=1``),
and every feature the config asks for that the table marks unsupported on the family
become problems of the all-at-once config report (exit 2), before any model loads.
"""

import os
from typing import List, Optional

from ..models.families import read_model_type
from ..models.family_table import UNLISTED_ENV, family_problem, feature_problem, hf_layout_problem, row


#: load_config's mode -> the table feature the run asks for (PPO trains on DPO's log-prob path)
ALIGNMENT_FEATURE = {"dpo": "dpo", "kto": "kto", "reward": "reward", "grpo": "grpo", "ppo": "dpo"}


def run_mode(cfg) -> str:
    """The CLI mode of a RunConfig: "sft", or the alignment mode whose key group ``cfg.dpo`` holds.

    Worked example: a config loaded with ``mode="kto"`` (``cfg.dpo`` a ``KTOArgument``) -> ``"kto"``.
    """
    from .schema import ALIGNMENT_ARGUMENTS

    if cfg.dpo is None:
        return "sft"
    return next((m for m, cls in ALIGNMENT_ARGUMENTS.items() if type(cfg.dpo) is cls), "dpo")


def unlisted_allowed() -> bool:
    """The user's explicit opt-in to train a model_type that is not in the table."""
    return os.environ.get(UNLISTED_ENV, "") == "1"


def requested_features(cfg, mode: str) -> List[str]:
    """The table features (``family_table.FEATURES``) a RunConfig asks for.

    Worked example: lora=true, zero_padding=true, flash_mask=false, tensor_parallel_degree=2 in
    fine-tuning mode -> ``["lora", "packing", "tp"]``.
    """
    m, d, t = cfg.model, cfg.data, cfg.training
    out = []
    adapter = m.lora or m.vera or m.lokr or bool(m.lora_path)
    if adapter:
        out.append("lora")
    elif not m.prefix_tuning and t.get("do_train", False):
        out.append("full")
    if m.weight_quantize_algo:
        out.append("qlora")
    if d.zero_padding:
        out.append("packing")
    if m.use_flash_attention:
        out.append("flash_attention")
    if m.flash_mask:
        out.append("flash_mask")
    if mode in ALIGNMENT_FEATURE:
        out.append(ALIGNMENT_FEATURE[mode])
    if int(t.get("tensor_parallel_degree", 1) or 1) > 1:
        out.append("tp")
    if int(t.get("pipeline_parallel_degree", 1) or 1) > 1:
        out.append("pp")
    return out


def family_problems(cfg, where: str, mode: str = "sft", model_type: Optional[str] = None) -> List[str]:
    """Problems of running ``cfg`` on its model's family (empty when the table allows everything asked)."""
    path = cfg.model.model_name_or_path
    if model_type is None:
        if not path or not os.path.isfile(os.path.join(path, "config.json")):
            return []  # reported elsewhere (not a model directory)
        model_type = read_model_type(path)
        if model_type is None:
            return [f"{where}: {os.path.join(path, 'config.json')} has no model_type; add it (e.g. \"llama\") so the "
                    "family's targets, masks and labels are known"]
    whole = family_problem(model_type, allow_unlisted=unlisted_allowed())
    if whole is not None:
        return [f"{where}: model_name_or_path {path!r}: {whole}"]
    problems = [f"{where}: model_name_or_path {path!r}: {p}" for p in config_read_problems(path)]
    if getattr(cfg.model, "continue_training", True):
        layout = checkpoint_layout_problem(path, model_type)
        if layout:
            problems.append(f"{where}: model_name_or_path {path!r}: {layout}")
    for feature in requested_features(cfg, mode):
        why = feature_problem(model_type, feature)
        if why is not None:
            problems.append(f"{where}: {why}")
    problems += [f"{where}: {p}" for p in moe_problems(cfg.model, model_type, path)]
    return problems


def moe_problems(model_args, model_type: str, model_dir: Optional[str]) -> List[str]:
    """The MoE keys (``router_aux_loss_coef`` / alias ``moe_aux_loss_coef``) on a model that cannot honour them.

    Worked example: ``router_aux_loss_coef: 0.01`` on a llama -> ["router_aux_loss_coef: model_type 'llama'
    has no mixture-of-experts router; remove router_aux_loss_coef"]; on the PaddleNLP-layout qwen3_moe
    (models/qwen3, no load-balancing loss) -> a refusal naming the key; on mixtral -> [].
    """
    from ..models.decoder.moe_spec import AUX_LOSS_ALIAS, AUX_LOSS_KEY, MoEConfigError, moe_key_problems
    from ..models.decoder.moe_spec import router_aux_loss_coef

    keys = {k: getattr(model_args, k, None) for k in (AUX_LOSS_KEY, AUX_LOSS_ALIAS)}
    out = moe_key_problems(keys, model_type)
    if out or not any(v is not None for v in keys.values()):
        return out
    try:
        coef = router_aux_loss_coef(keys, {})
    except MoEConfigError as e:
        return [str(e)]
    family = row(model_type)
    on_decoder = family is not None and family.decoder and family.arch is not None and family.arch.mlp == "moe"
    if coef > 0 and not on_decoder:
        key = AUX_LOSS_KEY if keys[AUX_LOSS_KEY] is not None else AUX_LOSS_ALIAS
        return [f"{key}={coef}: {model_type} trains on its PaddleNLP-layout model here (models/qwen3), which has no "
                "load-balancing loss; remove the key (or set it to 0)"]
    return []


def config_read_problems(model_dir: str) -> List[str]:
    """What in ``model_dir/config.json`` cannot be read exactly, in either transformers spelling (4.x
    ``rope_theta``/``rope_scaling``, 5.x ``rope_parameters``/``layer_types``), or that the family's model
    would compute otherwise (a RoPE type it does not implement): ``models/hf_config_read.py``.

    Worked example: a qwen2 config.json with ``"rope_parameters": {"rope_type": "yarn", "factor": 4.0}``
    -> ``["config.json rope_parameters.rope_type='yarn': PaddleNLP's qwen2 does not read rope scaling ..."]``.
    """
    from ..models.hf_config_read import read_problems
    from ..models.hf_layout import HFLayoutError, read_config_json

    try:
        raw = read_config_json(model_dir)
    except HFLayoutError as e:  # not JSON: names the file
        return [str(e)]
    return read_problems(raw)


def checkpoint_layout_problem(model_dir: str, model_type: str) -> Optional[str]:
    """A transformers-layout checkpoint of a family whose HF layout is not read (``Family.hf_layout``), or None.

    PaddleNLP names every body tensor ``<base_model_prefix>.`` (``Family.body_prefix``: the model_type but for
    codegen); a checkpoint with tensor names (safetensors headers / index) and none of them so named is another
    layout (``model.layers.N...``, ``transformer.h.N...``).  Families the Hugging Face loader reads are left to it.

    Worked example: a gemma directory whose safetensors holds ``model.layers.0.self_attn.q_proj.weight`` ...
    -> "gemma: Hugging Face (transformers-layout) checkpoints are read for llama, mistral, qwen2, qwen3 only; ..."
    """
    family = row(model_type)
    if family is None or family.hf_layout:
        return None
    from ..models.checkpoint import CheckpointError, HFLayoutCheckpointError, find_checkpoint

    try:
        ckpt = find_checkpoint(model_dir)
        if ckpt.hf_model_type is not None:  # read (e.g. for the decoder's parity tests), but not trained this way
            return hf_layout_problem(model_type)
        names = list(ckpt.tensors)
    except HFLayoutCheckpointError:  # transformers names on a family the loader does not convert
        return hf_layout_problem(model_type)
    except CheckpointError:
        return None  # no weights / a broken index: the loader names the file
    if not names or any(n.startswith(f"{family.body_prefix}.") for n in names):
        return None
    return hf_layout_problem(model_type)
