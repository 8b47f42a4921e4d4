"""The mode table (config/modes.py), the one run recipe (training/recipe.py) and the alignment base
(dpo/alignment.py) hold together: every CLI names the recipe its row records, every recipe's hooks train
that mode, no config module branches on a mode's name, and no trainer bypasses its parent's __init__."""

import ast
import os
import re

import pytest

from paddlenlp_ext.config.modes import MODES, mode_of
from paddlenlp_ext.config.parse import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "paddlenlp_ext")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(MODES))
def test_each_script_names_the_recipe_of_its_mode(name):
    row = MODES[name]
    text = _read(os.path.join(ROOT, row.script))
    assert re.search(rf'run_config_script\(argv, USAGE, mode="{name}", runner="{re.escape(row.recipe)}"\)', text)
    recipe = _read(os.path.join(ROOT, *row.recipe.split(".")) + ".py")
    # the recipe runs the one skeleton with hooks of this very mode
    assert "run_recipe(cfg, " in recipe and f'mode = "{name}"' in recipe, row.recipe
    assert os.path.isfile(os.path.join(ROOT, row.doc))


def test_config_names_modes_only_in_the_table():
    """``grep '"grpo"\\|"kto"\\|"reward"' paddlenlp_ext/config`` finds the table (and GRPO's loss named grpo)."""
    hits = []
    for f in sorted(os.listdir(os.path.join(PKG, "config"))):
        if not f.endswith(".py") or f == "modes.py":
            continue
        for n, line in enumerate(_read(os.path.join(PKG, "config", f)).splitlines(), 1):
            if re.search(r'"(grpo|kto|reward|ppo)"', line) and "GRPO_LOSS_TYPES" not in line:
                hits.append(f"config/{f}:{n}: {line.strip()}")
    assert hits == []


def test_no_trainer_skips_its_parents_init():
    bypass = []
    for sub in ("dpo", "kto", "reward", "grpo", "ppo"):
        for f in os.listdir(os.path.join(PKG, sub)):
            if f.endswith(".py"):
                tree = ast.parse(_read(os.path.join(PKG, sub, f)))
                for node in ast.walk(tree):
                    if isinstance(node, ast.Attribute) and node.attr == "__init__":
                        base = node.value
                        if isinstance(base, ast.Name) and base.id.endswith("Trainer"):
                            bypass.append(f"{sub}/{f}:{node.lineno}: {base.id}.__init__")
    assert bypass == []


@pytest.mark.parametrize("name", sorted(m for m in MODES if MODES[m].arguments is not None))
def test_each_key_group_knows_its_mode(name):
    group = MODES[name].arguments()
    assert mode_of(group) == name and mode_of(None) == "sft"


def test_an_unknown_mode_is_refused_naming_the_table():
    with pytest.raises(ValueError, match=r"unknown mode 'orpo'.*config/modes.py"):
        load_config(None, [], mode="orpo")


def test_a_kto_config_names_the_alignment_docs_for_a_finetuning_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--output_dir", str(tmp_path), "--max_length", "64"], mode="kto")
    assert "'max_length' is a fine-tuning (llm/run_finetune.py) key; in a KTO config use max_seq_len instead" in str(
        e.value.problems
    )
    assert "(docs/alignment.md)" in str(e.value.problems)
