"""Check that packing leaves loss and gradients unchanged on your model and data.

    python llm/tools/check_packing.py CONFIG.json [--key value ...] [--check_examples 16] [--tolerance 1e-5]

Preference data (a DPO config: train_dataset_path, beta, ... -> llm/run_dpo.py keys) is recognised:
then every pair's chosen and rejected log-probs, each answer run alone (prompt + answer), are
compared with the same pairs packed as training packs them (prompt + chosen + rejected, many pairs
per row); exit 1 when one differs by more than the tolerance (default 1e-4, relative to
max(1, |log-prob|)), printing the largest difference and its pair.

Takes the first --check_examples training examples, computes the token-mean
loss and all parameter gradients once with each example run alone and once
packed into rows of max_length (with the config's flash_mask setting), and
prints one JSON object.  Exit code 1 when a difference exceeds the tolerance
(loss: absolute; gradients: relative to the largest gradient entry).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.cli.common import config_or_exit, pop_tool_args, run_or_exit_code  # noqa: E402

USAGE = __doc__.strip().splitlines()[2].strip()


def is_preference_config(argv) -> bool:
    """A config (file or --key overrides) that names a DPO key is a preference-data config."""
    from paddlenlp_ext.cli.common import split_argv
    from paddlenlp_ext.config.environment import DPO_KEYS
    from paddlenlp_ext.config.parse import ConfigError, read_json_config

    path, overrides = split_argv(argv)
    keys = {a[2:].split("=", 1)[0] for a in overrides if a.startswith("--")}
    try:
        keys |= set(read_json_config(path)) if path else set()
    except ConfigError:  # a missing / invalid file: config_or_exit reports it (exit 2)
        pass
    return bool(keys & DPO_KEYS)


def check_preferences(cfg, tool):
    from paddlenlp_ext.dpo.data import read_preference_files, resolve_split_files, tokenize_preference_examples
    from paddlenlp_ext.dpo.packing_check import check_pair_packing
    from paddlenlp_ext.data.tokenize import resolve_chat_template
    from paddlenlp_ext.training.run import build_training_args, library_patches, load_model, load_tokenizer

    args = build_training_args(cfg)
    tokenizer = load_tokenizer(cfg)
    o = cfg.alignment
    examples = read_preference_files(resolve_split_files(o.train_dataset_path, "train"))[
        : tool.get("check_examples", 16)
    ]
    pairs, _ = tokenize_preference_examples(
        examples, tokenizer, o.max_seq_len, o.max_prompt_len, resolve_chat_template(tokenizer, cfg.data.chat_template)
    )
    with library_patches(cfg):
        model, _ = load_model(cfg, args)
        result = check_pair_packing(
            model,
            pairs,
            o.max_seq_len,
            tokenizer.pad_token_id,
            flash_mask=cfg.model.flash_mask,
            greedy=cfg.data.greedy_zero_padding,
        )
    tol = tool.get("tolerance", 1e-4 if str(model.config.dtype) == "float32" else 1e-2)
    result.update(flash_mask=cfg.model.flash_mask, dtype=str(model.config.dtype), tolerance=tol)
    result["ok"] = result["max_rel_diff"] <= tol
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


def main(argv):
    """Exit codes: 0 packing is exact, 1 a difference exceeds the tolerance, 2 bad config or data."""
    tool, argv = pop_tool_args(argv, {"check_examples": int, "tolerance": float})
    if is_preference_config(argv):
        return run_or_exit_code(check_preferences, config_or_exit(argv, USAGE, mode="dpo"), tool)
    return run_or_exit_code(check_sft, config_or_exit(argv, USAGE), tool)


def check_sft(cfg, tool):
    from paddlenlp_ext.data.build import tokenize_split
    from paddlenlp_ext.data.tokenize import resolve_chat_template
    from paddlenlp_ext.training.packing_check import check_packing
    from paddlenlp_ext.training.run import build_training_args, library_patches, load_model, load_tokenizer

    args = build_training_args(cfg)
    tokenizer = load_tokenizer(cfg)
    use_template = resolve_chat_template(tokenizer, cfg.data.chat_template)
    features, _ = tokenize_split(cfg, tokenizer, "train", use_template)
    with library_patches(cfg):
        model, _ = load_model(cfg, args)
        result = check_packing(
            model,
            features[: tool.get("check_examples", 16)],
            cfg.data.max_length,
            tokenizer.pad_token_id,
            flash_mask=cfg.model.flash_mask,
            greedy=cfg.data.greedy_zero_padding,
        )
    tol = tool.get("tolerance", 1e-5 if str(model.config.dtype) == "float32" else 1e-2)
    result.update(flash_mask=cfg.model.flash_mask, dtype=str(model.config.dtype), tolerance=tol)
    result["ok"] = result["loss_abs_diff"] <= tol and result["grad_max_rel_diff"] <= tol
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
