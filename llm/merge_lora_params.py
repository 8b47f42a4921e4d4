"""Merge a saved adapter (LoRA / rsLoRA / LoRA+ / PiSSA / VeRA / QLoRA) into its base model.

    python llm/merge_lora_params.py --model_name_or_path BASE_DIR --lora_path ADAPTER_DIR \
        --merge_model_path OUT_DIR [--device cpu|gpu] [--safe_serialization true|false] \
        [--max_shard_size 1GB] [--verify|--no-verify] [--tolerance T] [--overwrite] [--output_format paddle|hf]

Streams the base checkpoint one tensor at a time (memory ~ a few of the largest
adapted tensors, never a shard or the whole model), writes a complete PaddleNLP
model directory and, by default, checks that the merged model reproduces
base + adapter.  ``--output_format hf`` writes the merged model in Hugging Face
transformers layout instead (docs/export.md).  See docs/merge.md.  ``--lora_path`` may also be a PaddleNLP
adapter (lora_config.json); llm/tools/merge_lora_params.py takes PaddleNLP's flags.

Exit codes: 0 ok; 1 bad input / output location (nothing written);
2 bad command line; 3 merged but verification failed or could not run (the
output carries a MERGE_VERIFY_FAILED file).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.merge import EXIT_ERROR, MergeError, merge_adapter_checkpoint, report_merge  # noqa: E402
from paddlenlp_ext.cli.common import str2bool  # noqa: E402


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description="Merge a saved adapter into its base model (streaming, verified).")
    p.add_argument("--model_name_or_path", required=True, help="local directory of the ORIGINAL base model")
    p.add_argument("--lora_path", required=True, help="adapter directory (adapter_config.json + adapter_model.safetensors, "
                   "or PaddleNLP's lora_config.json + lora_model_state.pdparams)")
    p.add_argument("--merge_model_path", "--output_path", "--merge_lora_model_path", dest="merge_model_path",
                   required=True, help="output directory for the merged model (must be empty or absent)")
    p.add_argument("--device", default=None, choices=["cpu", "gpu"],
                   help="device for the verification forward passes (default: gpu if available, else cpu)")
    p.add_argument("--safe_serialization", type=str2bool, nargs="?", const=True, default=True,
                   help="write safetensors (default true); false writes model_state*.pdparams")
    p.add_argument("--max_shard_size", default="1GB", help="largest output shard, e.g. 1GB, 500MB (default 1GB)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="compare merged vs base + adapter logits on random probes (default on)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max relative logit error for --verify (default: 1e-4 fp32, 2e-2 fp16, 5e-2 bf16)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--output_format", default="paddle", choices=["paddle", "hf"],
                   help="paddle (default): PaddleNLP's layout; hf: transformers layout (model.layers.N..., "
                   "[out, in] Linear weights, transformers config.json; safetensors only), see docs/export.md")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_arguments(argv)
    t0 = time.time()
    if args.output_format == "hf":
        return _merge_to_hf(args)
    try:
        result = merge_adapter_checkpoint(
            args.model_name_or_path, args.lora_path, args.merge_model_path,
            safe_serialization=args.safe_serialization, max_shard_size=args.max_shard_size,
            overwrite=args.overwrite, verify=args.verify, tolerance=args.tolerance, device=args.device,
        )
    except MergeError as e:  # bad input: a message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:  # the output could not be written (disk full, permission): not the input's fault
        print(f"error: writing the merged model failed: {e}", file=sys.stderr)
        return 1
    return report_merge(result, time.time() - t0)


def _merge_to_hf(args):
    from paddlenlp_ext.export import ExportError, ExportVerifyFailed, export_merged_hf
    from paddlenlp_ext.merge import EXIT_VERIFY_FAILED

    if os.path.isfile(os.path.join(args.lora_path, "reward_config.json")):
        print(f"error: {args.lora_path} is a reward model (llm/run_reward.py): its score head has no transformers "
              "causal-LM layout; merge it with --output_format paddle (the head is kept)", file=sys.stderr)
        return EXIT_ERROR
    if not args.safe_serialization:
        print("error: --output_format hf writes safetensors (transformers' format); drop "
              "--safe_serialization false", file=sys.stderr)
        return EXIT_ERROR
    try:
        res = export_merged_hf(args.model_name_or_path, args.lora_path, args.merge_model_path,
                               max_shard_size=args.max_shard_size, overwrite=args.overwrite, verify=args.verify,
                               tolerance=args.tolerance, device=args.device)
    except ExportVerifyFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    except (MergeError, ExportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:
        print(f"error: writing the exported model failed: {e}", file=sys.stderr)
        return 1
    status = (res.merge.verify or {}).get("status", "not run")
    print(f"[merge] merged {len(res.merge.modules_merged)} modules and exported them in transformers layout to "
          f"{res.output_dir} ({len(res.weight_files)} file(s)); verify: {status}")
    return res.merge.exit_code


if __name__ == "__main__":
    sys.exit(main())
