import os

from setuptools import find_packages, setup

# CPU build by default. For GPUs: PADDLE_PACKAGE=paddlepaddle-gpu (see README).
PADDLE = os.environ.get("PADDLE_PACKAGE", "paddlepaddle")

setup(
    name="paddlenlp_ext",
    version="0.1.0",
    description="JSON-config driven LLM fine-tuning on PaddlePaddle (LoRA family, QLoRA, packing, FlashMask, merge)",
    packages=find_packages(include=["paddlenlp_ext", "paddlenlp_ext.*"]),
    python_requires=">=3.10,<3.13",
    install_requires=[
        f"{PADDLE}>=3.0,<3.4",
        "paddlenlp==3.0.0b4",
        "safetensors",
        "numpy<2",
        "sentencepiece",
        "psutil",
        "jinja2",  # chat templates (tokenizer_config.json)
        "fastapi",  # llm/predict/server.py
        "uvicorn",
        "prometheus-client",  # the server's /metrics
        "llguidance",  # constrained decoding (response_format json_schema, required tool calls)
    ],
    package_data={"paddlenlp_ext.serve": ["static/*"]},  # the chat page (not a Python package)
    extras_require={
        # The interoperability judges (tests): transformers/peft on PyTorch's CPU build, the openai client, selenium (Debian chromium).
        # torch is pinned exactly: a looser range pulls a CUDA build of several GB.
        # trl: the judge of the GRPO losses; lm-eval: drives the server as users do; jsonschema: validates structured output.
        "test": [
            "pytest",
            "torch==2.13.0",
            "transformers==4.55.4",
            "peft",
            "openai",
            "selenium",
            "trl==0.22.2",
            "lm-eval[api]==0.4.13",
            "jsonschema",
            "ruff",
        ],
    },
)
