"""Config-time refusals from the model-family table (``models/family_table.py``), without importing paddle.

The model's ``model_type`` is read from ``model_name_or_path/config.json``; a family the
table refuses, a model_type not in the table (unless ``PADDLENLP_EXT_UNLISTED_MODEL=1``),
and every feature the config asks for that the table marks unsupported on the family
become problems of the all-at-once config report (exit 2), before any model loads.
"""

import os
from typing import List, Optional

from ..adapters.config import ADAPTER_METHOD_KEYS
from ..models.dropout import read_model_type
from .modes import MODES
from ..models.family_table import UNLISTED_ENV, family_problem, feature_problem, hf_layout_problem, layout_row, row


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
    adapter = any(getattr(m, key) for key in ADAPTER_METHOD_KEYS) or bool(m.lora_path)  # adapters.methods' keys
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
    feature = MODES[mode].feature  # the alignment mode's own (config/modes.py)
    if feature:
        out.append(feature)
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
            return [
                f'{where}: {os.path.join(path, "config.json")} has no model_type; add it (e.g. "llama") so the '
                "family's targets, masks and labels are known"
            ]
    whole = family_problem(model_type, allow_unlisted=unlisted_allowed())
    if whole is not None:
        return [f"{where}: model_name_or_path {path!r}: {whole}"]
    problems = [f"{where}: model_name_or_path {path!r}: {p}" for p in config_read_problems(path)]
    hf = False
    if getattr(cfg.model, "continue_training", True):
        layout = checkpoint_layout_problem(path, model_type)
        if layout:
            problems.append(f"{where}: model_name_or_path {path!r}: {layout}")
        hf = is_hf_layout(path)
    # qwen3_moe: transformers' layout (or a config models/qwen3 refuses) trains on the decoder's MoE row
    family = layout_row(model_type, hf, _config_json(path))
    on_hf_row = family is not row(model_type)
    for feature in requested_features(cfg, mode):
        why = feature_problem(model_type, feature, hf_layout=on_hf_row)
        if why is not None:
            problems.append(f"{where}: {why}")
    problems += [f"{where}: {p}" for p in moe_problems(cfg.model, model_type, path, family)]
    problems += [f"{where}: {p}" for p in decoder_recompute_problems(cfg.training, model_type, family)]
    problems += [f"{where}: {p}" for p in decoder_fusion_problems(cfg.model, model_type, family)]
    problems += [f"{where}: {p}" for p in moe_training_problems(cfg, model_type, path, family)]
    problems += [f"{where}: {p}" for p in moe_pipeline_problems(cfg, path, family)]
    problems += [f"{where}: model_name_or_path {path!r}: {p}" for p in decoder_tp_problems(cfg, model_type, path)]
    from .expert_parallel import expert_parallel_problems  # expert_parallel_degree (docs/moe.md)
    from .problems import Problem

    for p in expert_parallel_problems(cfg, model_type, path):  # keeps the kind of a tagged one (problems.py)
        problems.append(Problem(f"{where}: {p}", p.kind) if isinstance(p, Problem) else f"{where}: {p}")
    return problems


def _config_json(model_dir: str) -> dict:
    from ..models.hf_layout import HFLayoutError, read_config_json

    try:
        return read_config_json(model_dir)
    except HFLayoutError:  # reported by config_read_problems, naming the file
        return {}


def is_hf_layout(model_dir: str) -> bool:
    """Whether ``model_dir``'s weights are in transformers' layout (read from the safetensors headers; False when
    there are no readable weights, which the loader reports naming the file)."""
    from ..models.checkpoint import CheckpointError, find_checkpoint

    try:
        return find_checkpoint(model_dir).hf_model_type is not None
    except CheckpointError:
        return False


def decoder_fusion_problems(m, model_type: str, family=None) -> List[str]:
    """PaddleNLP's ``fuse_attention_qkv`` / ``fuse_attention_ffn`` on a row of our decoder, which takes its
    projections as the checkpoint stores them (fused for phi3 / glm4, separate otherwise) and has no such switch.
    E.g. fuse_attention_qkv=true on mistral -> ``["fuse_attention_qkv=true: ... remove fuse_attention_qkv"]``."""
    family = family or row(model_type)
    if family is None or not family.decoder:
        return []
    return [
        f"{key}=true: {model_type} trains on our decoder, which keeps the projections as the checkpoint "
        f"stores them (there is nothing to fuse at load time); remove {key}"
        for key in ("fuse_attention_qkv", "fuse_attention_ffn")
        if getattr(m, key, None)
    ]


def decoder_recompute_problems(t, model_type: str, family=None) -> List[str]:
    """Recompute settings our decoder does not honour (it recomputes whole layers, non-reentrant, skipping
    ``no_recompute_layers``).  E.g. recompute=true, recompute_granularity="core_attn" on gemma2 ->
    ``["recompute_granularity 'core_attn' is not implemented on gemma2 (our decoder) ...; set ... full"]``."""
    family = family or row(model_type)
    if family is None or not family.decoder or not t.get("recompute", False):
        return []
    out = []
    granularity = t.get("recompute_granularity", "full")
    if granularity != "full":
        out.append(
            f"recompute_granularity {granularity!r} is not implemented on {model_type} (our decoder "
            'recomputes whole layers); set recompute_granularity to "full"'
        )
    if t.get("recompute_use_reentrant", False):
        out.append(
            f"recompute_use_reentrant=true is not supported on {model_type} (our decoder uses Paddle's "
            "non-reentrant recompute, under which adapters get their gradients); set "
            "recompute_use_reentrant=false"
        )
    return out


def moe_training_problems(cfg, model_type: str, model_dir: Optional[str], family=None) -> List[str]:
    """``moe_router_bias_update_rate`` and ``freeze_router`` on a run that cannot honour them (docs/moe.md).

    Worked example: ``freeze_router: true`` with ``lora_target_modules: [".*mlp\\.gate"]`` on ernie4_5_moe ->
    ["freeze_router: lora_target_modules ... adapt the router ..."]; ``moe_router_bias_update_rate: 0.001``
    with LoRA -> a refusal (the adapter does not save the bias); on a full fine-tuning of ernie4_5_moe -> [].
    """
    from ..models.decoder.moe_spec import BIAS_RATE_KEY, moe_key_problems

    m = cfg.model
    rate, freeze = getattr(m, BIAS_RATE_KEY, None), bool(getattr(m, "freeze_router", False))
    if not rate and not freeze:
        return []
    out = moe_key_problems({BIAS_RATE_KEY: rate, "freeze_router": freeze}, model_type)
    if out:
        return out
    family = family or row(model_type)
    if not (family is not None and family.decoder and family.arch is not None and family.arch.mlp == "moe"):
        keys = [k for k, v in ((BIAS_RATE_KEY, rate), ("freeze_router", freeze)) if v]
        return [
            f"{k}: {model_type} in PaddleNLP's layout trains on models/qwen3, which has no MoE block of the "
            f"decoder to act on; remove {k}, or export the checkpoint with llm/tools/export.py --format hf (a "
            f"transformers-layout {model_type} trains on the decoder)"
            for k in keys
        ]
    routers = _router_names(model_dir, model_type)
    if rate and routers is not None and not routers[1]:
        out.append(
            f"{BIAS_RATE_KEY}: this {model_type} checkpoint's router has no e_score_correction_bias to "
            f"update; remove {BIAS_RATE_KEY} or use router_aux_loss_coef to balance the experts"
        )
    if rate and (cfg.adapter_method or m.lora_path or m.prefix_tuning):
        out.append(
            f"{BIAS_RATE_KEY}: the bias update changes the base model's e_score_correction_bias, which an "
            f"adapter does not save; train with lora false (full fine-tuning) or remove {BIAS_RATE_KEY}"
        )
    targets = m.lora_target_modules or m.target_modules
    if freeze and targets and routers is not None:
        import re

        hit = [n for n in routers[0] if any(re.fullmatch(t, n) for t in targets)]
        if hit:
            out.append(
                f"freeze_router: lora_target_modules {targets} adapt the router ({hit[0]}), which "
                "freeze_router keeps fixed; remove the router from lora_target_modules or set freeze_router "
                "false"
            )
    return out


def moe_pipeline_problems(cfg, model_dir: Optional[str], family) -> List[str]:
    """Pipeline stages of a decoder MoE row compute the training loss without the load-balancing loss: the stages
    pass no router logits, and transformers' loss over every layer multiplies means over all layers (not a sum of
    per-stage terms).  So ``pipeline_parallel_degree`` > 1 is refused while the aux loss is on (the run's
    ``router_aux_loss_coef`` / ``moe_aux_loss_coef``, else the checkpoint's when its ``output_router_logits`` is
    true) and with ``moe_router_bias_update_rate`` (its expert counts come from the whole model's forward).

    Worked example: ``pipeline_parallel_degree: 2`` and ``router_aux_loss_coef: 0.01`` on mixtral ->
    ["pipeline_parallel_degree=2 with the load-balancing loss on (router_aux_loss_coef=0.01): ... set
    router_aux_loss_coef=0 or pipeline_parallel_degree=1"]; with ``router_aux_loss_coef: 0`` -> [].
    """
    from ..models.decoder.moe_spec import AUX_LOSS_ALIAS, AUX_LOSS_KEY, BIAS_RATE_KEY, MoEConfigError
    from ..models.decoder.moe_spec import router_aux_loss_coef

    pp = int(cfg.training.get("pipeline_parallel_degree", 1) or 1)
    if pp <= 1 or family is None or not family.decoder or family.arch is None or family.arch.mlp != "moe":
        return []
    keys = {k: getattr(cfg.model, k, None) for k in (AUX_LOSS_KEY, AUX_LOSS_ALIAS)}
    ckpt = _config_json(model_dir) if model_dir else {}
    try:
        coef = router_aux_loss_coef(keys, ckpt)
    except MoEConfigError:
        return []  # reported by moe_problems, naming the key
    out = []
    if coef > 0:
        given = next((f"{k}={v}" for k, v in keys.items() if v is not None), None)
        why = given or (
            f"the checkpoint's config.json sets output_router_logits true with {AUX_LOSS_KEY} {ckpt.get(AUX_LOSS_KEY)}"
        )
        out.append(
            f"pipeline_parallel_degree={pp} with the load-balancing loss on ({why}): the MoE pipeline stages "
            "pass no router logits between stages, and the loss over every layer is not a sum of per-stage "
            f"terms; set {AUX_LOSS_KEY}=0 (train without the aux loss) or pipeline_parallel_degree=1"
        )
    if getattr(cfg.model, BIAS_RATE_KEY, None):
        out.append(
            f"{BIAS_RATE_KEY} with pipeline_parallel_degree={pp}: the bias update reads the expert counts of "
            f"the whole model's forward, which no pipeline stage has; remove {BIAS_RATE_KEY} or set "
            "pipeline_parallel_degree=1"
        )
    return out


def _router_names(model_dir: Optional[str], model_type: str):
    """(the full sublayer names of the checkpoint's routers, whether they carry an e_score_correction_bias), or
    None when ``model_dir``'s config.json cannot tell (reported elsewhere)."""
    from ..models.decoder.moe_spec import MoEConfigError, is_moe_layer, moe_spec
    from ..models.hf_layout import HFLayoutError, read_config_json

    try:
        raw = read_config_json(model_dir)
        spec = moe_spec(raw, model_type)
        layers = [i for i in range(int(raw.get("num_hidden_layers", 0))) if is_moe_layer(raw, i, model_type)]
    except (HFLayoutError, MoEConfigError, OSError, TypeError, ValueError):
        return None
    family = row(model_type)
    prefix = family.body_prefix if family is not None else model_type
    mlp = family.arch.mlp_name if family is not None and family.arch is not None else "mlp"
    names = [f"{prefix}.layers.{i}.{mlp}.{spec.router_name}" for i in layers]
    return names, spec.correction_bias is not None


def decoder_tp_problems(cfg, model_type: str, model_dir: str) -> List[str]:
    """What keeps our decoder's model from being cut over ``tensor_parallel_degree`` ranks.

    Worked example: a gemma2 config.json with ``num_key_value_heads: 1`` and ``tensor_parallel_degree: 2`` ->
    ``["config.json num_key_value_heads=1 is not a multiple of tensor_parallel_degree=2 (each rank takes 1/2 of
    them); choose a tensor_parallel_degree that divides it"]``.
    """
    tp = int(cfg.training.get("tensor_parallel_degree", 1) or 1)
    family = row(model_type)
    family = layout_row(model_type, is_hf_layout(model_dir), _config_json(model_dir)) if tp > 1 else family
    if tp <= 1 or family is None or not family.decoder or family.arch is None:
        return []
    from ..models.decoder.rows import ArchError, resolve, tensor_parallel_problems
    from ..models.hf_layout import HFLayoutError, read_config_json

    try:
        knobs = resolve(family.arch, read_config_json(model_dir))
    except (HFLayoutError, ArchError, KeyError, TypeError, ValueError):
        return []  # config.json problems are reported by config_read_problems / the loader, naming the key
    out = [f"config.json {p}" for p in tensor_parallel_problems(knobs, tp)]
    fused = [n for n, on in (("qkv_proj", family.arch.fused_qkv), ("gate_up_proj", family.arch.fused_gate_up)) if on]
    if fused and cfg.model.vera:
        out.append(
            f"vera=true with tensor_parallel_degree={tp} on {model_type}: VeRA's shared projections are "
            f"sliced contiguously, not per segment of the fused {' / '.join(fused)}; use lora=true or "
            "tensor_parallel_degree=1"
        )
    return out


def moe_problems(model_args, model_type: str, model_dir: Optional[str], family=None) -> List[str]:
    """The MoE keys (``router_aux_loss_coef`` / alias ``moe_aux_loss_coef``) on a model that cannot honour them.

    Worked example: ``router_aux_loss_coef: 0.01`` on a llama -> ["router_aux_loss_coef: model_type 'llama'
    has no mixture-of-experts router; remove router_aux_loss_coef"]; on the PaddleNLP-layout qwen3_moe
    (models/qwen3, no load-balancing loss) -> a refusal naming the key; on mixtral -> [].
    """
    from ..models.decoder.moe_spec import AUX_LOSS_ALIAS, AUX_LOSS_KEY, MoEConfigError, moe_key_problems
    from ..models.decoder.moe_spec import fused_expert_target_problems, router_aux_loss_coef

    keys = {k: getattr(model_args, k, None) for k in (AUX_LOSS_KEY, AUX_LOSS_ALIAS)}
    targets = getattr(model_args, "lora_target_modules", None) or getattr(model_args, "target_modules", None)
    out = fused_expert_target_problems(targets, model_type) + moe_key_problems(keys, model_type)
    if out or not any(v is not None for v in keys.values()):
        return out
    try:
        coef = router_aux_loss_coef(keys, {})
    except MoEConfigError as e:
        return [str(e)]
    family = family or row(model_type)
    on_decoder = family is not None and family.decoder and family.arch is not None and family.arch.mlp == "moe"
    if coef > 0 and not on_decoder:
        key = AUX_LOSS_KEY if keys[AUX_LOSS_KEY] is not None else AUX_LOSS_ALIAS
        return [
            f"{key}={coef}: {model_type} in PaddleNLP's layout trains on models/qwen3, which has no "
            "load-balancing loss; remove the key (or set it to 0), or train a transformers-layout checkpoint "
            "(llm/tools/export.py --format hf writes one; it trains on the decoder's MoE row, with the aux loss)"
        ]
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
