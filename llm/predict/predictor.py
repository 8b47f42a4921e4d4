"""Generate answers with a fine-tuned model: a prompt file in batches, or an interactive chat.

    python llm/predict/predictor.py --model_name_or_path BASE [--lora_path ADAPTER] \
        --data_file PROMPTS.json [--output_file OUT.json] [--batch_size 4] [--src_length N] [--max_length N] \
        [--decode_strategy greedy_search|sampling] [--top_k K] [--top_p P] [--temperature T] \
        [--repetition_penalty R] [--dtype float32|bfloat16|float16] [--device cpu|gpu] [--seed S]
    python llm/predict/predictor.py --model_name_or_path BASE [--lora_path ADAPTER] --chat [--chat_template FILE]

PaddleNLP's predictor flags and meanings (max_length = prompt + answer).  --lora_path takes
adapters saved by run_finetune.py (LoRA, rsLoRA, PiSSA, VeRA, LoKr, QLoRA), PaddleNLP's LoRA
adapters and prefix-tuning directories.  See docs/predict.md.

Exit codes: 0 ok; 2 bad input (flags, prompt file, adapter that does not fit); 1 internal failure.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.predict.inputs import PredictInputError, read_prompts  # noqa: E402
from paddlenlp_ext.predict.options import PredictOptions, add_generation_flags, check_options  # noqa: E402
from paddlenlp_ext.cli.common import str2bool  # noqa: E402

EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    d = PredictOptions(model_name_or_path="")
    p = argparse.ArgumentParser(
        description="Predict with a (fine-tuned) model: --data_file or --chat. See docs/predict.md."
    )
    p.add_argument("--model_name_or_path", required=True, help="local base model directory (the one trained on)")
    p.add_argument(
        "--lora_path",
        "--prefix_path",
        dest="lora_path",
        default=None,
        help="adapter directory: adapter_config.json, PaddleNLP's lora_config.json, or prefix_config.json",
    )
    p.add_argument("--data_file", default=None, help='JSON lines {"src": ..., "tgt": [earlier answers]}')
    p.add_argument(
        "--output_file",
        default=None,
        help="JSON lines of predictions (default output.json); with "
        "--chat, the conversation's turns (a prompt file that replays it)",
    )
    p.add_argument("--batch_size", type=int, default=d.batch_size)
    p.add_argument(
        "--src_length", type=int, default=None, help="longest prompt in tokens (default 1024, at most max_length/2)"
    )
    add_generation_flags(p)  # --max_length, decoding, --dtype, --device, --chat_template (shared with server.py)
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--chat", type=str2bool, nargs="?", const=True, default=False, help="interactive session")
    return p


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def main(argv=None) -> int:
    parser = build_parser()
    opts, problems, notes = check_options(PredictOptions(**vars(parser.parse_args(argv))))
    if problems:
        print(parser.format_usage(), end="", file=sys.stderr)
        return fail("\n  ".join(["bad arguments (see --help and docs/predict.md):"] + problems))
    for note in notes:
        print(f"[predict] note: {note}", file=sys.stderr)
    try:
        records = read_prompts(opts.data_file) if opts.data_file else None  # before any model loads
        from paddlenlp_ext.predict.session import library_warnings_off

        with library_warnings_off():  # paddle loads from here on
            from paddlenlp_ext.predict.run import build_prompts, chat, predict_file
            from paddlenlp_ext.predict.session import load_session, load_tokenizer

            tokenizer, use_template = load_tokenizer(opts)
            prompts = build_prompts(records, tokenizer, opts, use_template) if records else None
            session = load_session(opts, tokenizer, use_template)
            if opts.chat:
                chat(session, opts)
            else:
                print(f"[predict] {session.description}", file=sys.stderr)
                predict_file(session, opts, records, prompts)
    except PredictInputError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        print("\n[predict] interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
