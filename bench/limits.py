"""How far a training run is from this machine's limit: the end-to-end benchmark's FLOP/s side.

* :func:`measure_peak` runs ``bench/peak.py`` through the harness (its own process, with our CPU set-up)
  and returns its figures: the CPU model and ISA, the fp32 matmul peak, the copy bandwidth;
* :func:`data_stats` reads the training rows with the model's SentencePiece tokenizer: the mean
  causal context of a token (for the attention term of ``bench/flops.py``) and the share of the
  processed tokens that are supervised;
* :func:`flops_per_supervised_token` puts them together: the FLOPs a toolkit must spend per supervised
  token it trains on.  Every toolkit of a case trains the same model on the same rows, so this is one
  figure per case, and a toolkit's FLOP/s is its supervised tokens/s times it.

Nothing here imports paddle.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from bench import harness as h
from bench.flops import causal_context, flops_per_token


def measure_peak(out_json: str, shape: dict, vocab: int, *more: str) -> dict:
    """Run ``bench.peak`` for this model shape (``more``: its other arguments); its JSON (see bench/peak.py)."""
    env = h.clean_env(PYTHONPATH=h.ROOT)
    r = h.run(
        h.module("bench.peak", "--shape", json.dumps(shape), "--vocab", vocab, "--json", out_json, *more),
        name="matmul peak",
        env=env,
        mark=None,
    )
    print("\n".join(line for line in r.output.splitlines() if line.startswith(("CPU:", "cpu:", "peak:"))), flush=True)
    return load_peak(out_json)


def load_peak(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def example_lengths(src_tokens: int, tgt_tokens: int, max_length: int) -> tuple:
    """(processed, supervised) tokens of one {src, tgt} example: BOS + source + target + EOS, the answer
    and its EOS supervised, the source cut first when the whole is over ``max_length``:

    >>> example_lengths(10, 20, 1024), example_lengths(1000, 100, 1024)
    ((32, 21), (1024, 101))
    """
    total, supervised = 1 + src_tokens + tgt_tokens + 1, tgt_tokens + 1
    return min(total, max_length), min(supervised, max_length - 1)


def data_stats(train_json: str, spm_model: str, max_length: int) -> dict:
    """Token statistics of the {src, tgt} JSON lines ``train_json`` under the SentencePiece model
    ``spm_model``: examples, mean length, mean causal context and supervised fraction (an estimate
    within a token or two of each toolkit's own template; ours reports its measured fraction too)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    lengths, supervised = [], 0
    with open(train_json, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                n, s = example_lengths(len(sp.encode(row["src"])), len(sp.encode(row["tgt"])), max_length)
                lengths.append(n)
                supervised += s
    return {
        "examples": len(lengths),
        "mean_length": sum(lengths) / len(lengths),
        "context": causal_context(lengths),
        "supervised_fraction": supervised / sum(lengths),
    }


def model_spm(model_dir: str) -> Optional[str]:
    """The SentencePiece model of a checkpoint directory (PaddleNLP's Llama: ``sentencepiece.bpe.model``;
    transformers': ``tokenizer.model``), None when it has none."""
    for name in ("sentencepiece.bpe.model", "tokenizer.model"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            return path
    return None


def flops_per_supervised_token(shape: dict, vocab: int, stats: dict, lora_rank: Optional[int]) -> float:
    """FLOPs per processed token (bench/flops.py) over the supervised fraction of the data:

    >>> shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    >>> flops_per_supervised_token(shape, 100, {"context": 2.5, "supervised_fraction": 0.5}, 2)
    715776.0
    """
    per_token = flops_per_token(shape, vocab, stats["context"], lora_rank)["total"]
    return per_token / stats["supervised_fraction"]
