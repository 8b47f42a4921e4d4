"""Check that packing leaves loss and gradients unchanged on your model and data.

    python llm/tools/check_packing.py CONFIG.json [--key value ...] [--check_examples 16] [--tolerance 1e-5]

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

from paddlenlp_ext.cli.common import config_or_exit, pop_tool_args  # noqa: E402

USAGE = __doc__.strip().splitlines()[2].strip()


def main(argv):
    tool, argv = pop_tool_args(argv, {"check_examples": int, "tolerance": float})
    cfg = config_or_exit(argv, USAGE)
    from paddlenlp_ext.data.pipeline import tokenize_split
    from paddlenlp_ext.data.tokenize import resolve_chat_template
    from paddlenlp_ext.training.packing_check import check_packing
    from paddlenlp_ext.training.run import build_training_args, library_patches, load_model, load_tokenizer

    args = build_training_args(cfg)
    tokenizer = load_tokenizer(cfg)
    use_template = resolve_chat_template(tokenizer, cfg.data.chat_template)
    features, _ = tokenize_split(cfg, tokenizer, "train", use_template)
    with library_patches(cfg):
        model, _ = load_model(cfg, args)
        result = check_packing(model, features[: tool.get("check_examples", 16)], cfg.data.max_length,
                               tokenizer.pad_token_id, flash_mask=cfg.model.flash_mask,
                               greedy=cfg.data.greedy_zero_padding)
    tol = tool.get("tolerance", 1e-5 if str(model.config.dtype) == "float32" else 1e-2)
    result.update(flash_mask=cfg.model.flash_mask, dtype=str(model.config.dtype), tolerance=tol)
    result["ok"] = result["loss_abs_diff"] <= tol and result["grad_max_rel_diff"] <= tol
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
