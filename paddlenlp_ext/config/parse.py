"""JSON config + ``--key value`` overrides -> validated, typed arguments.

Every problem is collected and reported together (``ConfigError``) before
any model or data is loaded; the CLI turns it into exit code 2.  Nothing
here imports paddle.
"""

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ..adapters.config import ADAPTER_METHOD_KEYS
from ..data.reader import DataError, read_utf8_text
from .data_checks import data_format_problems, dataset_path_problems
from ..models.dropout import DROPOUT_KEYS, dropout_problem, read_model_type
from .problems import Problem, blame_command_line, tagged
from .environment import (
    DPO_HINT,
    DPO_KEYS,
    environment_problems,
    pipeline_parallel_problems,
    tensor_parallel_adapter_problems,
)
from .device import apply_cpu_device
from .fields import NONE_IS_A_VALUE, FieldSpec, all_fields
from .adapter_checks import adapter_problems
from .json_errors import describe_json_error
from .output_dir import earlier_run_problems, resume_overrides_overwrite
from .paths import missing_path_text, model_dir_text, resolve_from_root
from .resume import coerce_resume, output_dir_problems, resume_problems, resume_settings
from .modes import MODES, mode_of
from .schema import DataArgument, DPOArgument, GenerateArgument, ModelArgument


class ConfigError(Exception):
    """All the problems found in one config, reported together."""

    def __init__(self, problems: List[str], before_load: bool = True):
        self.problems = list(problems)
        self.before_load = before_load  # False: found while building (e.g. a layer shape a format cannot take)
        super().__init__("\n".join(self.problems))

    def report(self) -> str:
        n = len(self.problems)
        when = " (nothing was loaded)" if self.before_load else ""
        lines = [f"config error: {n} problem{'s' if n != 1 else ''} found{when}:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


@dataclass
class RunConfig:
    model: ModelArgument
    data: DataArgument
    generate: GenerateArgument
    training: Dict[str, Any]  # keyword arguments of paddlenlp_ext.training.TrainingArguments
    source: Optional[str] = None
    # key -> human-readable note of a value we derived (logged, written out)
    derived: Dict[str, str] = field(default_factory=dict)
    # keys the user set (file or command line)
    explicit: set = field(default_factory=set)
    # the alignment key group of the mode (config/modes.py: DPO, KTO, reward, GRPO, PPO); None for fine-tuning
    alignment: Optional[DPOArgument] = None

    def to_dict(self) -> Dict[str, Any]:
        return {
            "source": self.source,
            "model": dataclasses.asdict(self.model),
            "data": dataclasses.asdict(self.data),
            "generate": dataclasses.asdict(self.generate),
            "training": dict(self.training),
            "derived": dict(self.derived),
            "explicit": sorted(self.explicit),
            **({"alignment": dataclasses.asdict(self.alignment)} if self.alignment is not None else {}),
            # copied into every checkpoint: a resume under other settings is refused (config.resume)
            "resume_settings": resume_settings(self, training_defaults(self.alignment is not None)),
        }

    @property
    def adapter_method(self) -> Optional[str]:
        """'lora', 'vera', 'lokr' (the first key of ADAPTER_METHOD_KEYS that is on) or None (full fine-tuning)."""
        for key in ADAPTER_METHOD_KEYS:
            if getattr(self.model, key):
                return key
        return None


def training_defaults(alignment: bool = False) -> Dict[str, Any]:
    # the training keys are the same in every alignment mode (their own groups only add keys)
    return {k: s.default for k, s in all_fields("dpo" if alignment else "sft").items() if s.group == "training"}


def _no_duplicates(path):
    def hook(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
        return dict(pairs)

    return hook


def read_json_config(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError([f"{path}: config file not found"])
    try:  # UTF-8, a BOM accepted; another encoding names the byte and the iconv command
        text = read_utf8_text(path)
    except DataError as e:
        raise ConfigError(e.problems) from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates(path))
    except json.JSONDecodeError as e:  # names the line of a trailing comma or a comment, not the next brace
        raise ConfigError([describe_json_error(path, text, e)]) from None
    except ValueError as e:
        raise ConfigError([f"{path}: {e}"])
    if not isinstance(obj, dict):
        raise ConfigError([f"{path}: the config must be a JSON object of key: value pairs"])
    return obj


def parse_overrides(argv: Sequence[str]) -> List[tuple]:
    """``["--lora", "true", "--lora_rank=4", "--do_eval"]`` ->
    ``[("lora", "true"), ("lora_rank", "4"), ("do_eval", None)]`` (None: flag
    given without a value, meaning true for a boolean key)."""
    out, i = [], 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or len(tok) == 2:
            raise ConfigError([f"command line: expected --key value, got {tok!r}"])
        key = tok[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            value = None
            i += 1
        out.append((key, value))
    return out


def _coerce(spec: FieldSpec, value: Any, from_cli: bool):
    """Return (value, error) with value converted to the key's type."""
    kind = spec.kind
    if value is None:
        if from_cli and kind == "bool":
            return True, None
        if spec.optional:
            return None, None
        return None, f"must not be null (expected {kind})"
    if from_cli and isinstance(value, str):
        low = value.strip().lower()
        if (low == "null" or (low == "none" and spec.name not in NONE_IS_A_VALUE)) and spec.optional:
            return None, None
        if kind == "bool":
            if low in ("true", "1", "yes"):
                return True, None
            if low in ("false", "0", "no"):
                return False, None
            return None, f"expected true or false, got {value!r}"
        if kind == "int":
            try:
                return int(value), None
            except ValueError:
                return None, f"expected an integer, got {value!r}"
        if kind == "float":
            try:
                return float(value), None
            except ValueError:
                return None, f"expected a number, got {value!r}"
        if kind == "list":
            v = value.strip()
            if v.startswith("["):
                try:
                    value = json.loads(v)
                except json.JSONDecodeError:
                    return None, f"expected a JSON list or comma-separated values, got {value!r}"
            else:
                return [s.strip() for s in v.split(",") if s.strip()], None
        if kind == "dict":
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return None, f"expected a JSON object, got {value!r}"
        if kind in ("str", "any"):
            return value, None
    if kind == "bool":
        return (value, None) if isinstance(value, bool) else (None, f"expected true or false, got {value!r}")
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value), None
            return None, f"expected an integer, got {value!r}"
        return value, None
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None, f"expected a number, got {value!r}"
        return float(value), None
    if kind == "str":
        return (value, None) if isinstance(value, str) else (None, f"expected a string, got {value!r}")
    if kind == "list":
        if isinstance(value, str):
            return [s.strip() for s in value.split(",") if s.strip()], None
        return (list(value), None) if isinstance(value, list) else (None, f"expected a list, got {value!r}")
    if kind == "dict":
        return (value, None) if isinstance(value, dict) else (None, f"expected an object, got {value!r}")
    return value, None


def _check_range(spec: FieldSpec, value) -> Optional[str]:
    if value is None:
        return None
    if spec.choices is not None and value not in spec.choices:
        return f"must be one of {', '.join(map(str, spec.choices))}; got {value!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if spec.min is not None and value < spec.min:
            return f"must be >= {spec.min}; got {value}"
        if spec.gt is not None and value <= spec.gt:
            return f"must be > {spec.gt}; got {value}"
    return None


def load_config(path: Optional[str], overrides: Sequence[str] = (), mode: str = "sft") -> RunConfig:
    """Parse and validate. Raises ConfigError listing every problem.

    ``mode`` is a row of ``config.modes.MODES``: an alignment mode (``dpo``, ``kto``, ``reward``, ``grpo``,
    ``ppo``) adds its key group (``cfg.alignment``), its PaddleNLP rewrites and cross checks, and refuses the
    fine-tuning-only data keys, naming the key to use instead."""
    from .dpo import sft_key_problem

    if mode not in MODES:
        raise ValueError(f"load_config: unknown mode {mode!r}; one of {', '.join(MODES)} (config/modes.py)")
    row = MODES[mode]
    specs = all_fields(mode)
    problems: List[str] = []
    where = path or "command line"
    raw: Dict[str, tuple] = {}  # key -> (value, from_cli, origin)
    if path is not None:
        for k, v in read_json_config(path).items():
            raw[k] = (v, False, path)
    try:
        pairs = parse_overrides(overrides)
    except ConfigError as e:
        problems += e.problems
        pairs = []
    for k, v in pairs:
        raw[k] = (v, True, f"--{k}")

    values: Dict[str, Any] = {}
    for key, (value, from_cli, origin) in raw.items():
        spec = specs.get(key)
        sft_only = sft_key_problem(key, origin, row.title, row.doc) if row.refuses_sft_keys else None
        if sft_only:
            problems.append(sft_only)
            continue
        if spec is None and row.refuses_dpo_keys and key in DPO_KEYS:
            problems.append(
                f"{origin}: {key!r} is a DPO (llm/run_dpo.py) key; {mode.upper()} does not use it: remove "
                f"it (the {mode.upper()} keys are in docs/alignment.md)"
            )
            continue
        if spec is None and key in DPO_KEYS:
            problems.append(
                f"{origin}: {key!r} is a DPO (preference training) key; llm/run_finetune.py does "
                f"supervised fine-tuning only. {DPO_HINT}"
            )
            continue
        if spec is None:
            near = difflib.get_close_matches(key, list(specs), n=3, cutoff=0.6)
            hint = (
                f"; did you mean {' or '.join(repr(n) for n in near)}?"
                if near
                else "; see docs/config.md for the valid keys"
            )
            problems.append(f"{origin}: unknown key {key!r}{hint}")
            continue
        if key == "resume_from_checkpoint":  # a path, or true: the newest complete checkpoint (config.resume)
            value, err = coerce_resume(value, from_cli)
        else:
            value, err = _coerce(spec, value, from_cli)
        if err is None:
            err = _check_range(spec, value)
        if err is not None:
            problems.append(f"{origin}: {key}: {err}")
            continue
        if spec.unsupported and value != spec.default:
            problems.append(
                f"{origin}: {key}={value!r} is {spec.unsupported} in paddlenlp_ext; "
                f"remove the key or set it to {spec.default!r}"
            )
            continue
        values[key] = value

    for name, spec in specs.items():
        if spec.required and values.get(name) is None:
            problems.append(f"{where}: required key {name!r} is missing")

    # the shipped configs' input paths also resolve from llm/ (config.paths)
    from_root = resolve_from_root({k: v for k, v in values.items() if not raw[k][1]}, path)
    values.update(from_root)

    groups = {}
    for gname, cls in (("model", ModelArgument), ("data", DataArgument), ("generate", GenerateArgument)):
        kw = {k: v for k, v in values.items() if specs[k].group == gname}
        groups[gname] = cls(**kw)
    training = {k: v for k, v in values.items() if specs[k].group == "training"}
    own = row.arguments  # cfg.alignment
    alignment = own(**{k: v for k, v in values.items() if specs[k].group == "alignment"}) if own else None
    cfg = RunConfig(
        groups["model"],
        groups["data"],
        groups["generate"],
        training,
        source=path,
        explicit=set(values),
        alignment=alignment,
    )
    for key, full in from_root.items():
        cfg.derived[key] = (
            f"{full} ({raw[key][0]!r} is not in the current directory {os.getcwd()}; "
            "found from the repository root, where the shipped configs' paths start)"
        )
    _apply_aliases(cfg)
    if "device" in raw and raw["device"][1]:  # --device cpu: this GPU config made CPU-ready (config.device)
        apply_cpu_device(cfg)
    problems += blame_command_line(_cross_checks(cfg, where), [k for k, r in raw.items() if r[1]], path)
    if problems:
        raise ConfigError(problems)
    _derive(cfg)
    # after _derive: the checkpoint's settings are compared with the derived ones (e.g. lora_alpha)
    problems = tagged(resume_problems(cfg, where, training_defaults(mode != "sft")), "resume")
    if problems:
        raise ConfigError(problems)
    return cfg


def _cross_checks(cfg: RunConfig, where: str) -> List[str]:
    m, d, t = cfg.model, cfg.data, cfg.training
    p = []
    methods = [k for k in ADAPTER_METHOD_KEYS if getattr(m, k)]
    p += adapter_problems(m, t, methods, where)  # config/adapter_checks.py
    if m.flash_mask and not m.use_flash_attention:
        p.append(f"{where}: flash_mask=true needs use_flash_attention=true")
    if d.greedy_zero_padding and not d.zero_padding:
        p.append(f"{where}: greedy_zero_padding=true needs zero_padding=true")
    if d.src_length > d.max_length:
        # equal is fine (as in PaddleNLP): the last target always keeps at least one token
        p.append(f"{where}: src_length ({d.src_length}) must not exceed max_length ({d.max_length})")
    if d.intokens is not None and d.intokens != d.zero_padding and "zero_padding" in cfg.explicit:
        p.append(
            f"{where}: intokens (PaddleNLP's old name of zero_padding) is {d.intokens} but zero_padding is "
            f"{d.zero_padding}; keep only zero_padding"
        )
    p += environment_problems(cfg, where)
    layers = t.get("no_recompute_layers")
    if layers is not None:
        try:
            t["no_recompute_layers"] = [int(x) for x in layers]
        except (TypeError, ValueError):
            p.append(f"{where}: no_recompute_layers must be a list of layer indices (integers); got {layers!r}")
    if m.model_name_or_path:
        model_type = read_model_type(m.model_name_or_path)
        for key in DROPOUT_KEYS:
            problem = dropout_problem(model_type, key, getattr(m, key), flash=m.use_flash_attention)
            if problem:
                p.append(f"{where}: {key}={getattr(m, key)}: {problem}")
    if m.model_name_or_path and model_dir_text("model_name_or_path", m.model_name_or_path):
        p.append(Problem(f"{where}: {model_dir_text('model_name_or_path', m.model_name_or_path)}", "model_dir"))
    if m.tokenizer_name_or_path and not os.path.isdir(m.tokenizer_name_or_path):
        p.append(
            Problem(
                f"{where}: {missing_path_text('tokenizer_name_or_path', m.tokenizer_name_or_path)}"
                if not os.path.exists(m.tokenizer_name_or_path)
                else f"{where}: tokenizer_name_or_path "
                f"{m.tokenizer_name_or_path!r} is not a directory ({os.path.abspath(m.tokenizer_name_or_path)})",
                "tokenizer_dir",
            )
        )
    if d.chat_template and not os.path.isfile(d.chat_template):
        p.append(
            Problem(
                f"{where}: chat_template file {d.chat_template!r} not found (looked for "
                f"{os.path.abspath(d.chat_template)})",
                "chat_template",
            )
        )
    g = cfg.generate
    if (g.top_k, g.top_p) != (1, 1.0) and not d.eval_with_do_generation:
        p.append(f"{where}: top_k/top_p only apply with eval_with_do_generation=true; set it or remove them")
    if d.save_generation_output and not d.eval_with_do_generation:
        p.append(f"{where}: save_generation_output=true needs eval_with_do_generation=true")
    if d.eval_with_do_generation and not t.get("do_eval", False):
        p.append(f"{where}: eval_with_do_generation=true needs do_eval=true")
    if t.get("fp16") and t.get("bf16"):
        p.append(f"{where}: fp16 and bf16 are both true; choose one")
    do_train, do_eval = t.get("do_train", False), t.get("do_eval", False)
    if cfg.alignment is not None:  # the mode's own checks and data keys instead of dataset_name_or_path
        p += MODES[mode_of(cfg.alignment)].checks(cfg, where)
    elif (do_train or do_eval) and not d.dataset_name_or_path:
        p.append(f"{where}: dataset_name_or_path is required with do_train or do_eval")
    elif d.dataset_name_or_path:
        p += dataset_path_problems(d, do_train, do_eval, where)  # config/data_checks.py
    if do_train and t.get("max_steps", -1) <= 0 and t.get("num_train_epochs", 3.0) <= 0:
        p.append(f"{where}: do_train needs max_steps > 0 or num_train_epochs > 0")
    if d.zero_padding and (d.pad_to_multiple_of or d.pad_to_max_length):
        p.append(
            f"{where}: pad_to_multiple_of/pad_to_max_length apply to batch padding; with zero_padding every "
            "row is already max_length long (choose max_length instead)"
        )
    p += data_format_problems(d, where)  # config/data_checks.py
    if d.lazy and do_train and t.get("max_steps", -1) <= 0:
        p.append(f"{where}: lazy=true streams the data without knowing its length; set max_steps > 0")
    if not do_train and not do_eval:
        p.append(f"{where}: nothing to do: set do_train and/or do_eval to true")
    p += pipeline_parallel_problems(t, m, d, methods, where, dpo=cfg.alignment is not None)
    for key in ("sep_parallel_degree", "context_parallel_degree"):
        if t.get(key, 1) > 1:
            p.append(f"{where}: {key} > 1 is not supported yet in paddlenlp_ext")
    p += tensor_parallel_adapter_problems(t, m, methods, where)
    p += output_dir_problems(t.get("output_dir"), where)
    p += earlier_run_problems(t, where)  # before resume_from_checkpoint=true is resolved to a path
    # prefix tuning: combinations, prefix_path and the model family (paddlenlp_ext/prefix/config.py)
    from ..prefix.config import config_problems as prefix_problems

    p += prefix_problems(m, d, t, where)
    # the model family x what the config asks for (models/family_table.py; docs/models.md)
    from .family_checks import family_problems

    p += family_problems(cfg, where, mode=mode_of(cfg.alignment))
    return p


def _apply_aliases(cfg: RunConfig) -> None:
    """Keys that stand for other keys (before the cross checks, which see the result)."""
    m = cfg.model
    if m.lokr_path and not m.lora_path:
        # a LoKr adapter is an ordinary adapter directory (method "lokr"), loaded like any lora_path
        m.lora_path = m.lokr_path
        cfg.derived["lora_path"] = f"{m.lokr_path} (from its alias lokr_path)"
    if cfg.alignment is not None:  # PaddleNLP's rewrites of the mode's settings (config/modes.py)
        MODES[mode_of(cfg.alignment)].aliases(cfg)
    resume_overrides_overwrite(cfg)
    d, t = cfg.data, cfg.training
    if d.intokens is not None and "zero_padding" not in cfg.explicit:
        d.zero_padding = d.intokens
        cfg.derived["zero_padding"] = f"{d.intokens} (from intokens, PaddleNLP's old name of zero_padding)"
    if t.get("benchmark") or t.get("autotuner_benchmark"):
        # PaddleNLP's SFTConfig.__post_init__ does the same, silently; we say what changed
        which = "autotuner_benchmark" if t.get("autotuner_benchmark") else "benchmark"
        forced = {
            "do_train": True,
            "do_eval": False,
            "load_best_model_at_end": False,
            "save_strategy": "no",
            "evaluation_strategy": "no",
            "overwrite_output_dir": True,
        }
        if which == "autotuner_benchmark":
            forced["max_steps"] = 5
        for key, value in forced.items():
            if t.get(key) != value:
                cfg.derived[key] = f"{value} ({which}=true; was {t.get(key)!r})"
                t[key] = value


def _derive(cfg: RunConfig) -> None:
    m = cfg.model
    if m.target_modules is not None and m.lora_target_modules is None:
        m.lora_target_modules = m.target_modules
        cfg.derived["lora_target_modules"] = f"{m.target_modules} (from its alias target_modules)"
    if m.lora and m.lora_alpha == -1:
        m.lora_alpha = 2 * m.lora_rank
        cfg.derived["lora_alpha"] = f"{m.lora_alpha} (2 x lora_rank {m.lora_rank}, since lora_alpha was not set)"
