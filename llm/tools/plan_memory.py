"""Will this run fit?  Per-device memory of a fine-tuning config, and the smallest layout that fits.

    python llm/tools/plan_memory.py CONFIG.json [--key value ...] [--device_memory 24GB] [--json]
        [--target gpu|cpu] [--world_size N] [--max_devices N]

Needs no GPU and no weights: the model's config.json (or a built-in shape such as
meta-llama/Llama-2-7b) is enough.  Exit 2 on a config error (naming the key).  See docs/parallel.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from paddlenlp_ext.cli.plan_memory import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
