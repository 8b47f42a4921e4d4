"""Regenerate docs/config.md from the config field specs.

python llm/tools/config_docs.py [--check]
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from paddlenlp_ext.config.docs import render  # noqa: E402

PATH = os.path.join(ROOT, "docs", "config.md")

if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        current = open(PATH, encoding="utf-8").read() if os.path.exists(PATH) else ""
        sys.exit(0 if current == text else "docs/config.md is stale: run python llm/tools/config_docs.py")
    with open(PATH, "w", encoding="utf-8") as f:
        f.write(text)
    print(PATH)
