"""Evaluate a model or base + adapter with lm-evaluation-harness through our OpenAI-compatible server.

    python llm/tools/eval.py --model_name_or_path BASE [--lora_path ADAPTER] --tasks TASKS \
        --output_dir OUT [--include_path MY_TASKS] [--model local-completions|local-chat-completions] \
        [--batch_size 8] [--max_length 2048] [--num_fewshot N] [--limit N] [--log_samples]

Starts llm/predict/server.py on a free loopback port, runs lm-eval against it, writes lm-eval's
results JSON to OUT/results.json and stops the server.  See docs/eval.md.
Exit codes: lm-eval's (0 ok); 2 bad arguments; 1 the server did not start.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads before paddle loads; import noise off

from paddlenlp_ext.serve.evaluate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
