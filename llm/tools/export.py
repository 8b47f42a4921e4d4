"""Export a model or an adapter for the Hugging Face ecosystem (transformers, PEFT, vLLM, SGLang, llama.cpp).

    # a model directory (a full fine-tune's output, or any base) in transformers layout
    python llm/tools/export.py --format hf --model_name_or_path MODEL_DIR --output_path OUT_DIR
    # base + adapter merged (the verified streaming merge), in transformers layout
    python llm/tools/export.py --format hf --model_name_or_path BASE_DIR --lora_path ADAPTER_DIR --output_path OUT
    # the adapter alone in PEFT's format (LoRA, rsLoRA, LoRA+, PiSSA, VeRA, LoKr)
    python llm/tools/export.py --format peft --lora_path ADAPTER_DIR --output_path OUT_DIR \
        [--model_name_or_path BASE_DIR_OR_HF_NAME]

Options: ``--max_shard_size 5GB`` (hf), ``--no-verify`` / ``--tolerance`` / ``--device`` (the merge's
verification), ``--overwrite``.  Exit codes: 0 ok; 2 bad input or a setting the target format cannot
express (nothing written); 1 a write failed; 3 the merge's verification failed (nothing exported).
See docs/export.md.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.merge import EXIT_ERROR, EXIT_VERIFY_FAILED, MergeError  # noqa: E402


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument(
        "--format",
        required=True,
        choices=["hf", "peft"],
        help="hf: a model in transformers layout; peft: the adapter alone in PEFT's format",
    )
    p.add_argument(
        "--model_name_or_path",
        default=None,
        help="hf: the model (or, with --lora_path, the ORIGINAL base) directory; peft: recorded as "
        "base_model_name_or_path in adapter_config.json (optional)",
    )
    p.add_argument("--lora_path", default=None, help="adapter directory saved by run_finetune.py (or PaddleNLP)")
    p.add_argument("--output_path", required=True, help="output directory (must be empty or absent unless --overwrite)")
    p.add_argument("--model_type", default=None, help="peft: the base's model_type when the adapter does not record it")
    p.add_argument("--max_shard_size", default="5GB", help="hf: largest weight file (default 5GB, as transformers)")
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hf with --lora_path: check merged vs base + adapter logits first (default on)",
    )
    p.add_argument("--tolerance", type=float, default=None, help="max relative logit error for --verify")
    p.add_argument("--device", default=None, choices=["cpu", "gpu"], help="device of the verification")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    return p.parse_args(argv)


def run(args) -> int:
    from paddlenlp_ext.export import export_hf_model, export_merged_hf, export_peft_adapter

    if args.format == "peft":
        if not args.lora_path:
            raise MergeError("--format peft exports an adapter: give --lora_path")
        export_peft_adapter(
            args.lora_path,
            args.output_path,
            model_type=args.model_type,
            overwrite=args.overwrite,
            base_model_name_or_path=args.model_name_or_path,
        )
        return 0
    if not args.model_name_or_path:
        raise MergeError("--format hf needs --model_name_or_path (the model, or the original base with --lora_path)")
    if args.lora_path:
        export_merged_hf(
            args.model_name_or_path,
            args.lora_path,
            args.output_path,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            verify=args.verify,
            tolerance=args.tolerance,
            device=args.device,
        )
    else:
        export_hf_model(
            args.model_name_or_path, args.output_path, max_shard_size=args.max_shard_size, overwrite=args.overwrite
        )
    return 0


def main(argv=None) -> int:
    from paddlenlp_ext.export import ExportError, ExportVerifyFailed

    args = parse_arguments(argv)
    try:
        return run(args)
    except ExportVerifyFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    except (ExportError, MergeError) as e:  # bad input or a setting the format cannot express: nothing written
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:  # the output could not be written (disk full, permission): not the input's fault
        print(f"error: writing the export failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
