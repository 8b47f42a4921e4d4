"""The run modes: one row per CLI (``llm/run_finetune.py``, ``run_dpo.py``, ``run_kto.py``, ``run_reward.py``,
``run_grpo.py``, ``run_ppo.py``), without importing paddle.

A row says everything the rest of the code would otherwise branch on the mode string for:

* ``arguments``: the dataclass of the mode's own key group (``RunConfig.alignment``; None for fine-tuning);
* ``aliases`` / ``checks``: PaddleNLP's rewrites of the group's settings (derived settings) and its cross
  checks (problems of the all-at-once config report);
* ``recipe``: the dotted module whose ``run(cfg)`` trains (resolved lazily by ``cli/``, which may import
  paddle; this package never does);
* ``doc``: the docs page of the mode's keys; ``feature``: the family-table feature the run asks for;
* ``refuses_sft_keys`` / ``refuses_dpo_keys``: whether a fine-tuning data key (``dataset_name_or_path``,
  ``max_length``, ...) or a DPO loss key gets a message naming the key to use instead.

A new alignment trainer is a recipe (``paddlenlp_ext/<mode>/run.py``: its data, trainer and summary hooks
for ``training.recipe``) plus one row here (docs/contributing.md).

>>> MODES["kto"].arguments.__name__, MODES["kto"].recipe, MODES["kto"].feature
('KTOArgument', 'paddlenlp_ext.kto.run', 'kto')
>>> mode_of(None)
'sft'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

from .alignment_schema import DPOArgument, GRPOArgument, KTOArgument, PPOArgument, RewardArgument
from .dpo import apply_dpo_aliases, apply_preference_aliases, dpo_problems, unread_dataset_dir
from .grpo import apply_grpo_aliases, grpo_problems, ppo_problems
from .kto import apply_kto_aliases, kto_problems
from .reward import reward_problems


def _none(cfg, *args) -> list:
    return []


@dataclass(frozen=True)
class Mode:
    name: str  # load_config(..., mode=name); also the ``mode`` of its arguments class
    title: str  # how messages name the mode ("DPO", "reward")
    script: str
    recipe: str  # dotted module with run(cfg) -> summary
    doc: str
    arguments: Optional[type] = None
    aliases: Callable[..., None] = _none
    checks: Callable[..., List[str]] = _none
    feature: Optional[str] = None  # models/family_table.py FEATURES
    refuses_sft_keys: bool = False  # config/dpo.py SFT_ONLY_KEYS answered with the key to use instead
    refuses_dpo_keys: bool = False  # a DPO-only loss key (beta of DPO, label_smoothing, ...) named as such


def _kto_checks(cfg, where: str) -> List[str]:
    return kto_problems(cfg, where) + unread_dataset_dir(cfg, where, "KTO")


def _grpo_checks(cfg, where: str) -> List[str]:
    return grpo_problems(cfg, where) + unread_dataset_dir(cfg, where, "GRPO")


def _ppo_checks(cfg, where: str) -> List[str]:
    return ppo_problems(cfg, where) + unread_dataset_dir(cfg, where, "GRPO")


def _reward_aliases(cfg) -> None:
    apply_preference_aliases(cfg, "Reward")  # zero padding on, as PaddleNLP's


_ROWS = (
    Mode("sft", "fine-tuning", "llm/run_finetune.py", "paddlenlp_ext.training.finetune", "docs/config.md"),
    Mode(
        "dpo",
        "DPO",
        "llm/run_dpo.py",
        "paddlenlp_ext.dpo.run",
        "docs/dpo.md",
        DPOArgument,
        apply_dpo_aliases,
        dpo_problems,
        feature="dpo",
        refuses_sft_keys=True,
    ),
    Mode(
        "kto",
        "KTO",
        "llm/run_kto.py",
        "paddlenlp_ext.kto.run",
        "docs/alignment.md",
        KTOArgument,
        apply_kto_aliases,
        _kto_checks,
        feature="kto",
        refuses_sft_keys=True,
        refuses_dpo_keys=True,
    ),
    Mode(
        "reward",
        "reward",
        "llm/run_reward.py",
        "paddlenlp_ext.reward.run",
        "docs/alignment.md",
        RewardArgument,
        _reward_aliases,
        reward_problems,
        feature="reward",
        refuses_sft_keys=True,
        refuses_dpo_keys=True,
    ),
    Mode(
        "grpo",
        "GRPO",
        "llm/run_grpo.py",
        "paddlenlp_ext.grpo.run",
        "docs/alignment.md",
        GRPOArgument,
        apply_grpo_aliases,
        _grpo_checks,
        feature="grpo",
        refuses_dpo_keys=True,
    ),
    Mode(
        "ppo",
        "PPO",
        "llm/run_ppo.py",
        "paddlenlp_ext.ppo.run",
        "docs/alignment.md",
        PPOArgument,
        apply_grpo_aliases,
        _ppo_checks,
        feature="dpo",  # PPO trains on DPO's log-prob path
        refuses_dpo_keys=True,
    ),
)

#: mode name -> its row
MODES = {m.name: m for m in _ROWS}

for _m in _ROWS:  # each key group knows its mode: cfg.alignment.mode (what messages, summaries and resume read)
    if _m.arguments is not None:
        _m.arguments.mode = _m.name


def mode_of(alignment) -> str:
    """The mode whose key group ``alignment`` (``RunConfig.alignment``) is; "sft" for None."""
    return "sft" if alignment is None else alignment.mode
