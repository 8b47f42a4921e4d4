"""PaddleNLP's merge script location and flags, on paddlenlp_ext's streaming, verified merge.

    python llm/tools/merge_lora_params.py --model_name_or_path BASE_DIR --lora_path ADAPTER_DIR \
        --output_path OUT_DIR [--safe_serialization False] [--device gpu|npu|cpu] [--low_gpu_mem True]

Takes PaddleNLP's flags (``--output_path``, or the older ``--merge_lora_model_path``, or
``--merge_model_path`` as llm/merge_lora_params.py spells it; without
``--model_name_or_path`` the adapter's ``base_model_name_or_path`` is used, as older PaddleNLP did)
and either adapter format: this project's, or PaddleNLP's lora_config.json + lora_model_state.pdparams.
As in PaddleNLP, ``--safe_serialization`` defaults to False (``model_state.pdparams``).
``--device`` and ``--low_gpu_mem`` are accepted with a notice: the merge streams on the CPU.
Extras: ``--overwrite``, ``--no-verify``.  Unknown flags are an error.  Same merge, exit codes
and output as llm/merge_lora_params.py (docs/merge.md).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.adapters.config import AdapterConfig  # noqa: E402
from paddlenlp_ext.merge import EXIT_ERROR, MergeError, merge_adapter_checkpoint, report_merge  # noqa: E402
from paddlenlp_ext.cli.common import str2bool  # noqa: E402  (PaddleNLP's strtobool values)


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model_name_or_path", default=None, help="local directory of the ORIGINAL base model "
                   "(default: base_model_name_or_path of the adapter config)")
    p.add_argument("--lora_path", required=True, help="adapter directory (ours or PaddleNLP's lora_config.json)")
    p.add_argument("--output_path", "--merge_lora_model_path", "--merge_model_path", dest="output_path", required=True,
                   help="output directory (must be empty or absent unless --overwrite)")
    p.add_argument("--safe_serialization", type=str2bool, default=False,
                   help="true: model.safetensors; false (PaddleNLP's default): model_state.pdparams")
    p.add_argument("--device", default=None, choices=["gpu", "npu", "cpu"], help="device of the verification only")
    p.add_argument("--low_gpu_mem", default=None, help="accepted for compatibility; has no effect")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="compare merged vs base + adapter logits on random probes (default on)")
    # Unknown flags first: argparse would otherwise report a missing required flag and never the typo.
    known = {s for action in p._actions for s in action.option_strings}
    flags = [a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)
             if a.startswith("--") and a.split("=")[0] not in known]
    if flags:
        p.error(f"unrecognized arguments: {' '.join(flags)} (unknown flags; see --help)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_arguments(argv)
    base = args.model_name_or_path
    try:
        if base is None:
            base = AdapterConfig.load(args.lora_path).base_model_name_or_path
            if not base:
                raise MergeError("--model_name_or_path is required: the adapter config names no base_model_name_or_path")
            print(f"[merge] note: --model_name_or_path not given; using the adapter's base_model_name_or_path {base}")
        if args.low_gpu_mem is not None:
            print("[merge] note: --low_gpu_mem has no effect: the merge streams one tensor at a time on the CPU and "
                  "never loads the model onto a device")
        if args.device in ("gpu", "npu"):
            print(f"[merge] note: --device {args.device}: the merge itself runs on the CPU; the verification forward "
                  f"passes use {'the GPU if Paddle sees one, else the CPU' if args.device == 'gpu' else 'the CPU'}")
        # PaddleNLP's layouts: one pdparams file ("100GB" shards), safetensors in save_pretrained's 10GB shards
        result = merge_adapter_checkpoint(
            base, args.lora_path, args.output_path, safe_serialization=args.safe_serialization,
            max_shard_size="10GB" if args.safe_serialization else "100GB", overwrite=args.overwrite,
            verify=args.verify, device="cpu" if args.device in ("cpu", "npu") else None,
        )
    except (MergeError, ValueError) as e:  # bad input: a message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:  # the output could not be written (disk full, permission): not the input's fault
        print(f"error: writing the merged model failed: {e}", file=sys.stderr)
        return 1
    return report_merge(result)


if __name__ == "__main__":
    sys.exit(main())
