"""The one merge command behind both entry points: ``llm/merge_lora_params.py`` and PaddleNLP's location
``llm/tools/merge_lora_params.py``.  Same flags, same merge, same exit codes; only two defaults differ, so
that each location behaves as its users expect:

=========================  ==========================  ===================================================
                           llm/merge_lora_params.py    llm/tools/merge_lora_params.py (PaddleNLP's place)
=========================  ==========================  ===================================================
``--safe_serialization``   true (model.safetensors)    false (model_state.pdparams, PaddleNLP's default)
``--max_shard_size``       1GB                         PaddleNLP's: 10GB safetensors, one pdparams file
=========================  ==========================  ===================================================

Exit codes (``paddlenlp_ext.merge.cli``): 0 merged (and verified unless ``--no-verify``); 2 bad input or command line
(a message, no traceback, nothing written); 1 the output could not be written (disk full, permission);
3 merged but the verification failed or could not run (the output carries a ``MERGE_VERIFY_FAILED`` file).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional, Sequence

from ..merge.cli import EXIT_ERROR, EXIT_VERIFY_FAILED, report_merge
from ..merge.common import MergeError
from .common import str2bool

PADDLENLP_SHARDS = {True: "10GB", False: "100GB"}  # save_pretrained's safetensors shards; one pdparams file


def build_parser(paddlenlp_defaults: bool) -> argparse.ArgumentParser:
    """The flags of both merge scripts (``paddlenlp_defaults``: the defaults of PaddleNLP's location)."""
    p = argparse.ArgumentParser(
        description="Merge a saved adapter into its base model (streaming, verified).", allow_abbrev=False
    )
    p.add_argument(
        "--model_name_or_path",
        default=None,
        help="local directory of the ORIGINAL base model "
        "(default: base_model_name_or_path of the adapter config, as older PaddleNLP did)",
    )
    p.add_argument(
        "--lora_path",
        required=True,
        help="adapter directory (adapter_config.json + "
        "adapter_model.safetensors, or PaddleNLP's lora_config.json + lora_model_state.pdparams)",
    )
    p.add_argument(
        "--merge_model_path",
        "--output_path",
        "--merge_lora_model_path",
        dest="merge_model_path",
        required=True,
        help="output directory for the merged model (must be empty or absent unless "
        "--overwrite); --output_path and --merge_lora_model_path are PaddleNLP's spellings",
    )
    p.add_argument(
        "--device",
        default=None,
        choices=["cpu", "gpu", "npu"],
        help="device of the verification forward passes (default, and gpu: the GPU if Paddle sees one, "
        "else the CPU); the merge itself streams on the CPU; npu verifies on the CPU",
    )
    p.add_argument(
        "--safe_serialization",
        type=str2bool,
        nargs="?",
        const=True,
        default=not paddlenlp_defaults,
        help="true: model.safetensors; false: model_state*.pdparams (default "
        f"{'false, as PaddleNLP' if paddlenlp_defaults else 'true'})",
    )
    p.add_argument(
        "--max_shard_size",
        default=None,
        help="largest output shard, e.g. 1GB, 500MB (default "
        f"{'10GB safetensors / one pdparams file, as PaddleNLP' if paddlenlp_defaults else '1GB'})",
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare merged vs base + adapter logits on random probes (default on)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max relative logit error for --verify (default: 1e-4 fp32, 2e-2 fp16, 5e-2 bf16)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument(
        "--output_format",
        default="paddle",
        choices=["paddle", "hf"],
        help="paddle (default): PaddleNLP's layout; hf: transformers layout (model.layers.N..., "
        "[out, in] Linear weights, transformers config.json; safetensors only), see docs/export.md",
    )
    p.add_argument(
        "--low_gpu_mem",
        default=None,
        help="PaddleNLP's flag, accepted with a notice: the merge "
        "streams one tensor at a time and never loads the model onto a device",
    )
    return p


def parse_arguments(argv: Optional[Sequence[str]] = None, paddlenlp_defaults: bool = False) -> argparse.Namespace:
    """Parsed flags; an unknown flag is named (exit 2) before argparse would report a missing required one."""
    p = build_parser(paddlenlp_defaults)
    argv = list(sys.argv[1:] if argv is None else argv)
    known = {s for action in p._actions for s in action.option_strings}
    unknown = [a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0] not in known]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)} (unknown flags; see --help)")
    args = p.parse_args(argv)
    if args.max_shard_size is None:
        args.max_shard_size = PADDLENLP_SHARDS[args.safe_serialization] if paddlenlp_defaults else "1GB"
    return args


def _notes(args) -> List[str]:
    """What the PaddleNLP-only flags do here (printed, never silently ignored)."""
    notes = []
    if args.low_gpu_mem is not None:
        notes.append(
            "--low_gpu_mem has no effect: the merge streams one tensor at a time on the CPU and never "
            "loads the model onto a device"
        )
    if args.device in ("gpu", "npu"):
        notes.append(
            f"--device {args.device}: the merge itself runs on the CPU; the verification forward passes "
            f"use {'the GPU if Paddle sees one, else the CPU' if args.device == 'gpu' else 'the CPU'}"
        )
    return notes


def main(argv: Optional[Sequence[str]] = None, paddlenlp_defaults: bool = False) -> int:
    """Run the merge command; returns the exit code (module docstring)."""
    from ..merge import merge_adapter_checkpoint

    args = parse_arguments(argv, paddlenlp_defaults)
    t0 = time.time()
    for note in _notes(args):
        print(f"[merge] note: {note}")
    device = {"npu": "cpu", "gpu": None}.get(args.device, args.device)  # None: the GPU if there is one
    try:
        base = args.model_name_or_path or _base_of_adapter(args.lora_path)
        if args.output_format == "hf":
            return _merge_to_hf(args, base, device)
        result = merge_adapter_checkpoint(
            base,
            args.lora_path,
            args.merge_model_path,
            safe_serialization=args.safe_serialization,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            verify=args.verify,
            tolerance=args.tolerance,
            device=device,
        )
    except (MergeError, ValueError) as e:  # bad input: a message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:  # the output could not be written (disk full, permission): not the input's fault
        print(f"error: writing the merged model failed: {e}", file=sys.stderr)
        return 1
    return report_merge(result, time.time() - t0)


def _base_of_adapter(lora_path: str) -> str:
    """The adapter config's ``base_model_name_or_path`` when ``--model_name_or_path`` is not given."""
    from ..adapters.config import AdapterConfig

    base = AdapterConfig.load(lora_path).base_model_name_or_path
    if not base:
        raise MergeError("--model_name_or_path is required: the adapter config names no base_model_name_or_path")
    print(f"[merge] note: --model_name_or_path not given; using the adapter's base_model_name_or_path {base}")
    return base


def _merge_to_hf(args, base: str, device: Optional[str]) -> int:
    """``--output_format hf``: merge and write transformers' layout (docs/export.md)."""
    from ..export import ExportError, ExportVerifyFailed, export_merged_hf

    if os.path.isfile(os.path.join(args.lora_path, "reward_config.json")):
        raise MergeError(
            f"{args.lora_path} is a reward model (llm/run_reward.py): its score head has no "
            "transformers causal-LM layout; merge it with --output_format paddle (the head is kept)"
        )
    if not args.safe_serialization:
        raise MergeError(
            "--output_format hf writes safetensors (transformers' format); drop --safe_serialization false"
        )
    try:
        res = export_merged_hf(
            base,
            args.lora_path,
            args.merge_model_path,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            verify=args.verify,
            tolerance=args.tolerance,
            device=device,
        )
    except ExportVerifyFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    except ExportError as e:
        raise MergeError(str(e)) from e
    status = (res.merge.verify or {}).get("status", "not run")
    print(
        f"[merge] merged {len(res.merge.modules_merged)} modules and exported them in transformers layout to "
        f"{res.output_dir} ({len(res.weight_files)} file(s)); verify: {status}"
    )
    return res.merge.exit_code
