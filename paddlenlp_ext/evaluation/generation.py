"""eval_with_do_generation: generate each dev answer and score it against the reference."""

import json
import os
from typing import Dict, List, Sequence, Tuple

import paddle

from ..data.tokenize import generation_prompt
from .metrics import score


def generate_answers(model, tokenizer, examples: Sequence, src_length: int, max_length: int, use_template: bool,
                     top_k: int, top_p: float) -> List[Dict]:
    """One generation per example (greedy when top_k == 1 and top_p == 1.0, else sampling)."""
    sampling = not (top_k == 1 and top_p == 1.0)
    kwargs = dict(decode_strategy="sampling" if sampling else "greedy_search",
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if sampling:
        kwargs.update(top_k=top_k, top_p=top_p)
    was_training = model.training
    model.eval()
    rows = []
    with paddle.no_grad():
        for ex in examples:
            prompt, reference = generation_prompt(ex, tokenizer, src_length, max_length, use_template)
            max_new = max(max_length - len(prompt), 1)
            ids, _ = model.generate(paddle.to_tensor([prompt], dtype="int64"), max_new_tokens=max_new,
                                    attention_mask=paddle.ones([1, len(prompt)], dtype="int64"), use_cache=True,
                                    **kwargs)
            out = [int(t) for t in ids[0].numpy()]
            if tokenizer.eos_token_id in out:
                out = out[: out.index(tokenizer.eos_token_id)]
            rows.append({"origin": ex.origin, "src": ex.src[-1], "reference": reference,
                         "prediction": tokenizer.decode(out, skip_special_tokens=True).strip()})
    if was_training:
        model.train()
    return rows


def evaluate_by_generation(model, tokenizer, examples, src_length, max_length, use_template, top_k, top_p,
                           output_dir: str = None) -> Tuple[Dict[str, float], List[Dict]]:
    """Metrics (eval_exact_match, eval_bleu4, eval_rouge_l); with ``output_dir``
    the predictions go to ``output_dir/generated_predictions.json`` (JSON lines)."""
    rows = generate_answers(model, tokenizer, examples, src_length, max_length, use_template, top_k, top_p)
    metrics = {f"eval_{k}": v for k, v in score([r["prediction"] for r in rows],
                                                [r["reference"] for r in rows]).items()}
    if output_dir:
        with open(os.path.join(output_dir, "generated_predictions.json"), "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return metrics, rows
