"""OpenAI-compatible HTTP server + chat page over a (fine-tuned) model and its adapters.

    python llm/predict/server.py --model_name_or_path BASE [--lora_path NAME=ADAPTER ...] \
        [--host 127.0.0.1] [--port 8000] [--max_batch_size 16] [--max_queue 64] [--max_length N] ...

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (stream true/false),
GET / (the chat page).  --lora_path takes every adapter the predictor takes.  See docs/serve.md.

Exit codes: 0 stopped (SIGTERM/SIGINT, requests in flight finished); 2 bad input; 1 internal failure.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(__file__)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.serve.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
