"""The ERNIE-4.5-shaped model of ``bench/e2e.py --model ernie``: built once by transformers, random weights.

    .venv/bin/python -m bench.ernie_shape [DIR]     # build it alone (default build/bench_e2e/ernie-0.36b)

transformers' own ``Ernie4_5ForCausalLM`` (the layout of baidu/ERNIE-4.5-0.3B: hidden 1024, intermediate
3072, 18 layers, 16 heads / 2 key-value heads, head_dim 128, vocab 103424, RoPE theta 500000, no biases,
tied input / output embeddings: 360,748,032 parameters), ``torch.manual_seed(0)`` random weights, fp32,
saved with ``save_pretrained`` (safetensors) by the transformers of the interpreter that builds it (the
shared venv's 4.55.4), with the Llama-2 SentencePiece tokenizer of the shared data as ``tokenizer.model``
(the real ERNIE tokenizer is not in the shared data; the 32000 pieces index the first rows of the 103424-row
embedding, whose size keeps the LM head's cost the real model's).  Both toolkits of the benchmark read this
one directory: ours through ``llm/run_finetune.py`` (transformers layout, converted while loading), TRL +
PEFT through ``AutoModelForCausalLM``.
"""

from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402

#: Ernie4_5Config keys of the shape (bench/flops.py reads hidden/intermediate/layers/heads/kv heads/head_dim)
ERNIE_SHAPE = h.llama_shape(1024, 3072, 18, 16, 2, head_dim=128, max_position_embeddings=4096)
ERNIE_VOCAB = 103424
MARKER = "bench_build.json"
#: the tokenizer files next to the weights: transformers' slow LlamaTokenizer over the SentencePiece model
TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "legacy": True,
}

#: run in a child process (torch): ``BUILD OUT SPM SHAPE_JSON VOCAB TOKENIZER_CONFIG_JSON``
BUILD = r"""
import json, os, shutil, sys
import torch
import transformers
from transformers import Ernie4_5Config, Ernie4_5ForCausalLM
out, spm, shape, vocab, tok_cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cfg = Ernie4_5Config(vocab_size=vocab, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     use_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32", **shape)
torch.manual_seed(0)
model = Ernie4_5ForCausalLM(cfg)
assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "embeddings not tied"
model.save_pretrained(out, safe_serialization=True)
shutil.copyfile(spm, os.path.join(out, "tokenizer.model"))
with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    f.write(tok_cfg)
params = sum(p.numel() for p in model.parameters())  # the tied matrix once
info = {"params": params, "vocab": vocab, "transformers": transformers.__version__, "tied": True}
with open(os.path.join(out, "bench_build.json"), "w") as f:
    json.dump(info, f)
print(f"built {out}: Ernie4_5ForCausalLM, {params:,} parameters (tied embeddings), transformers {transformers.__version__}")
"""


def ensure_ernie(model_dir: str, py: str = sys.executable) -> dict:
    """Build the ERNIE-4.5-shaped checkpoint into ``model_dir`` once, with ``py`` (an interpreter with torch and
    transformers >= 4.54); returns its ``bench_build.json``: ``{"params", "vocab", "transformers", "tied"}``."""
    marker = os.path.join(model_dir, MARKER)
    if not os.path.isfile(marker):
        h.require_shared(h.TOKENIZER_MODEL, what="bench/e2e.py --model ernie")
        os.makedirs(model_dir, exist_ok=True)
        r = h.run(
            [
                py,
                "-c",
                BUILD,
                model_dir,
                h.TOKENIZER_MODEL,
                json.dumps(ERNIE_SHAPE),
                str(ERNIE_VOCAB),
                json.dumps(TOKENIZER_CONFIG, indent=2),
            ],
            name="ERNIE-shaped model build",
            env=h.clean_env(("PYTHONPATH",)),
            mark=None,
        )
        print(r.output.strip().splitlines()[-1], flush=True)
    with open(marker) as f:
        return json.load(f)


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else os.path.join(h.ROOT, "build", "bench_e2e", "ernie-0.36b")
    print(ensure_ernie(target))
