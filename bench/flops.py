"""The FLOPs of a training step, counted from the model's shape and the tokens it processed.

Only the matrix products count (what MKL's sgemm does); norms, rotary, activations, softmax, the loss
and the optimizer are elementwise and left out (a few percent of the work at these shapes).  The count
is the *useful* work of a step, the same for every toolkit that trains the same model on the same tokens,
whatever its kernels do (a dense attention mask over a packed row does more, and is not credited).

**A linear layer** ``y = x @ W`` with ``W`` [in, out], per token:

* forward: ``2 * in * out`` (a multiply and an add per weight);
* backward, input gradient ``dx = dy @ W^T``: ``2 * in * out`` (needed whenever anything below the layer
  trains);
* backward, weight gradient ``dW = x^T @ dy``: ``2 * in * out`` (only when ``W`` trains).

So full training costs ``6 * in * out`` per token (the familiar ``6 * N * tokens``), and a frozen base
weight under LoRA ``4 * in * out``: no weight gradient.  The one exception is a linear whose input
depends on nothing trainable: the first decoder layer's q/k/v projections read the frozen embeddings
(through a norm), so under LoRA they need no input gradient either: ``2 * in * out``.

**A LoRA branch** ``x @ A @ B`` (``A`` [in, r], ``B`` [r, out]) trains both: ``6 * r * (in + out)`` per
token (``2 * r * (in + out)`` for the first layer's q/k/v input gradients is again not needed, ``4 * r *
(in + out)`` there).

**Attention** (no weights: forward, then a backward of twice the forward's products: ``dQ``, ``dK``
from ``dS``, ``dV`` and ``dP``).  A query at position ``i`` of its document (1-based, causal) takes
``2 * i * hidden`` for ``Q K^T`` and as much for ``P V`` (``hidden = heads * head_dim``), so a document of
``L`` tokens costs ``2 * hidden * L * (L + 1)`` forward per layer, ``6 * hidden * L * (L + 1)`` for the step.
Per processed token that is ``12 * hidden * c`` with ``c`` the mean causal context, ``sum(L * (L + 1)) /
(2 * sum(L))`` over the documents (:func:`causal_context`; packed rows: per document, not per row).

**The LM head** ``[hidden, vocab]``: as a linear (frozen under LoRA: ``4 * hidden * vocab``).  The
embedding lookup is no product.

Worked example, the end-to-end benchmark's 0.26B Llama (hidden 1024, intermediate 2816, 16 layers, 16
heads, vocab 32000) under LoRA r8 on the seven decoder linears, per token:

* frozen linears: per layer q, k, v, o ``4 * 1024 * 1024`` + gate, up, down ``3 * 1024 * 2816`` =
  12,845,056 weights; x 16 layers = 205,520,896; at ``4`` FLOPs each = 822,083,584, less the first
  layer's q/k/v input gradients ``3 * 2 * 1024 * 1024`` = 6,291,456: 815,792,128;
* LM head: ``4 * 1024 * 32000`` = 131,072,000;
* LoRA: per layer ``8 * (4 * 2048 + 3 * 3840)`` = 157,696 weights; x 16 = 2,523,136; at 6 FLOPs =
  15,138,816, less the first layer's q/k/v ``3 * 2 * 8 * 1024`` = 49,152: 15,089,664;
* attention at a mean causal context of 100 tokens (documents of ~200): ``12 * 1024 * 100 * 16`` =
  19,660,800;

in all 981,614,592 FLOPs per token, 0.98 GFLOP: 3.6 x the 0.27B parameters (full training would be
``6 * 238,288,896 + 19,660,800`` = 1.45 GFLOP, 5.4 x).  At 90 tokens/s that is 88 GFLOP/s.

Nothing here imports paddle.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

#: the seven decoder linears LoRA targets in the benchmarks
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def decoder_linears(shape: dict) -> Dict[str, tuple]:
    """(in, out) of each decoder linear of a Llama-like layer (grouped-query k/v: ``kv_heads * head_dim``):

    >>> decoder_linears({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    ...                  "num_key_value_heads": 2})["k_proj"]
    (64, 32)
    """
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads = shape["num_attention_heads"]
    kv = (shape.get("num_key_value_heads") or heads) * (shape.get("head_dim") or hidden // heads)
    q = heads * (shape.get("head_dim") or hidden // heads)
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def causal_context(lengths: Sequence[int]) -> float:
    """The mean causal context of a token (how many keys its query sees, itself included) over documents
    of these lengths: ``sum(L * (L + 1)) / (2 * sum(L))``.

    >>> causal_context([3, 1])   # positions 1, 2, 3 and 1: (1 + 2 + 3 + 1) / 4
    1.75
    """
    total = sum(lengths)
    return sum(n * (n + 1) for n in lengths) / (2 * total) if total else 0.0


def flops_per_token(
    shape: dict, vocab: int, context: float, lora_rank: Optional[int] = None, targets: Sequence[str] = DECODER_LINEARS
) -> Dict[str, float]:
    """Training FLOPs per processed token by part (see the module docstring), and their ``total``.

    ``lora_rank`` None: full training (every weight trains); else LoRA of that rank on ``targets``, the
    rest frozen.  ``context``: the mean causal context (:func:`causal_context`).

    The tiny model (hidden 64, intermediate 128, 2 layers, 4 heads, vocab 100), documents of 4 tokens
    (context 2.5), LoRA r2 on all seven linears:

    >>> f = flops_per_token({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    ...                      "num_attention_heads": 4}, vocab=100, context=2.5, lora_rank=2)
    >>> f["frozen"], f["lora"], f["lm_head"], f["attention"], f["total"]
    (303104, 25344, 25600, 3840.0, 357888.0)

    frozen: 2 layers x 40,960 weights x 4 = 327,680, less layer 0's q/k/v input gradients 3 x 2 x 64 x 64
    = 24,576; LoRA: 2 layers x (4 x 2 x 128 + 3 x 2 x 192) = 4,352 branch weights x 6 = 26,112, less
    layer 0's q/k/v branch input gradients 3 x 2 x 2 x 64 = 768; LM head 4 x 64 x 100; attention
    12 x 64 x 2.5 x 2 layers.
    """
    layers = shape["num_hidden_layers"]
    hidden = shape["hidden_size"]
    linears = decoder_linears(shape)
    first_layer_qkv = ("q_proj", "k_proj", "v_proj")
    out = {"frozen": 0, "lora": 0, "full": 0}
    for name, (n_in, n_out) in linears.items():
        weights = n_in * n_out
        if lora_rank is None:
            out["full"] += 6 * weights * layers
            continue
        out["frozen"] += 4 * weights * layers
        if name in first_layer_qkv:
            out["frozen"] -= 2 * weights  # layer 0 reads the frozen embeddings: no input gradient
        if name in targets:
            branch = lora_rank * (n_in + n_out)
            out["lora"] += 6 * branch * layers
            if name in first_layer_qkv:
                out["lora"] -= 2 * lora_rank * n_in  # nor through its LoRA branch
    out["lm_head"] = (6 if lora_rank is None else 4) * hidden * vocab
    heads = shape["num_attention_heads"]
    width = heads * (shape.get("head_dim") or hidden // heads)  # the q/k width (hidden unless head_dim says)
    out["attention"] = 12 * width * context * layers
    out["total"] = float(sum(out.values()))
    return out


def achieved(
    tokens_per_s: Optional[float], per_token: Optional[float], peak_flops: Optional[float]
) -> Dict[str, float]:
    """Achieved FLOP/s and its fraction of the measured peak:
    ``achieved(90, 1e9, 300e9)`` -> ``{'gflops': 90.0, 'of_peak': 0.3}``; None where a figure is missing
    (``per_token`` None: a case whose FLOPs are not counted, such as DPO).
    """
    if tokens_per_s is None or per_token is None:
        return {"gflops": None, "of_peak": None}
    flops = tokens_per_s * per_token
    return {"gflops": flops / 1e9, "of_peak": flops / peak_flops if peak_flops else None}
