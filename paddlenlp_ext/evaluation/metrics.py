"""Text metrics for generated answers: exact match, corpus BLEU-4, ROUGE-L (pure Python).

Tokens are words and punctuation marks; each CJK character is its own token
(so Chinese text, as in the docs' AdvertiseGen task, is scored per character).
"""

import math
import re
from collections import Counter
from typing import Dict, List, Sequence

_TOKEN = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff]|[^\W_]+|[^\w\s]", re.UNICODE)


def tokenize(text: str) -> List[str]:
    """``"A red dress, 红色."`` -> ``["a", "red", "dress", ",", "红", "色", "."]``."""
    return _TOKEN.findall(text.lower())


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def corpus_bleu(predictions: Sequence[str], references: Sequence[str], max_n: int = 4) -> float:
    """Corpus BLEU-4 (Papineni et al. 2002) with add-one smoothing of the n>1
    precisions (Lin & Och 2004), so short corpora do not collapse to 0.

    ``corpus_bleu(["the cat sat"], ["the cat sat"]) == 1.0``;
    ``corpus_bleu(["the cat"], ["the cat sat"])`` = BP exp(1 - 3/2) x precisions
    (1, 1, (0+1)/(0+1), (0+1)/(0+1)) = 0.6065.
    """
    matches, totals = [0] * max_n, [0] * max_n
    pred_len = ref_len = 0
    for p, r in zip(predictions, references):
        pt, rt = tokenize(p), tokenize(r)
        pred_len, ref_len = pred_len + len(pt), ref_len + len(rt)
        for n in range(1, max_n + 1):
            pn, rn = _ngrams(pt, n), _ngrams(rt, n)
            matches[n - 1] += sum(min(c, rn[g]) for g, c in pn.items())
            totals[n - 1] += max(len(pt) - n + 1, 0)
    if pred_len == 0:
        return 0.0
    log_p = 0.0
    for n in range(max_n):
        m, t = (matches[n], totals[n]) if n == 0 else (matches[n] + 1, totals[n] + 1)
        if m == 0:
            return 0.0
        log_p += math.log(m / t) / max_n
    bp = 1.0 if pred_len > ref_len else math.exp(1 - ref_len / pred_len)
    return bp * math.exp(log_p)


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (Lin 2004) of one pair.

    ``rouge_l("the red dress", "a red dress")``: LCS 2, precision 2/3, recall 2/3 -> 0.6667.
    """
    p, r = tokenize(prediction), tokenize(reference)
    if not p or not r:
        return float(p == r)
    lcs = _lcs(p, r)
    if lcs == 0:
        return 0.0
    prec, rec = lcs / len(p), lcs / len(r)
    return 2 * prec * rec / (prec + rec)


def score(predictions: Sequence[str], references: Sequence[str]) -> Dict[str, float]:
    """exact_match, bleu4, rouge_l (mean F1), each in [0, 1].

    ``score(["yes", "no"], ["yes", "maybe"])``: exact match 1/2; ROUGE-L
    (1 + 0) / 2; BLEU pools the corpus: unigrams 1/2 matched, no 2-, 3- or
    4-grams (smoothed (0+1)/(0+1) = 1), lengths 2 = 2 (no brevity penalty),
    so ``(1/2 * 1 * 1 * 1) ** (1/4) = 0.8409``.
    """
    n = max(len(predictions), 1)
    return {
        "exact_match": sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / n,
        "bleu4": corpus_bleu(predictions, references),
        "rouge_l": sum(rouge_l(p, r) for p, r in zip(predictions, references)) / n,
    }
