"""eval_with_do_generation: generate each dev answer and score it against the reference.

Every data format: the dev records are read as training reads them (``dataset_format``, ``dataset_columns``,
``dataset_info.json`` names), each one's LAST assistant turn (a src/tgt record's last tgt) is the reference,
and the prompt is what training renders before that answer (the run's renderer: the jinja template, PaddleNLP's
template or none, with the one truncation policy) -- :func:`prompt_and_reference`.
"""

import json
import os
from typing import Any, Dict, List, Sequence, Tuple

import paddle

from ..data.formats.convo import Conversation, Message
from ..data.reader import Example
from ..data.tokenize import IGNORE_INDEX, generation_prompt
from .metrics import score


def prompt_and_reference(item: Any, renderer) -> Tuple[List[int], str, str]:
    """``(prompt ids, reference text, last question)`` of a dev record (``Example`` or ``Conversation``).

    The record is rendered as training renders it (every loss flag reset, prompts not learned), and the
    prompt is every token before the last run of learned tokens -- the last answer.  For
    ``[user "hi", assistant "yo"]`` without a template (bos 1, "hi" -> [5], "yo" -> [6]): ``([1, 5], "yo", "hi")``.
    """
    if isinstance(item, Example):
        reference, question = item.tgt[-1], item.src[-1]
    else:
        last = max(i for i, m in enumerate(item.messages) if m.role == "assistant")
        msgs = [Message(m.role, m.content, m.tool_calls, m.reasoning) for m in item.messages[: last + 1]]
        item = Conversation(msgs, tools=item.tools, origin=item.origin, format=item.format)
        reference = msgs[-1].content
        question = next((m.content for m in reversed(msgs) if m.role == "user"), "")
    learn_prompt, renderer.train_on_prompt = renderer.train_on_prompt, False  # the prompt must not look learned
    try:
        feats, _, _ = renderer(item)
    finally:
        renderer.train_on_prompt = learn_prompt
    if not feats:
        raise ValueError(f"{item.origin}: no token of the reference fits max_length={renderer.max_length}")
    labels = feats[0]["labels"]  # shifted: labels[k] is the token after input_ids[k]
    end = max(k for k, t in enumerate(labels) if t != IGNORE_INDEX)
    first = end
    while first > 0 and labels[first - 1] != IGNORE_INDEX:
        first -= 1
    return list(feats[0]["input_ids"][: first + 1]), reference, question


def read_dev_items(cfg) -> List[Any]:
    """The dev records of every source of ``dataset_name_or_path``, in any data format (as training reads them)."""
    from ..data.formats.detect import read_items
    from ..data.mixture import split_sources
    from ..data.build import source_files

    d, items = cfg.data, []
    for src in split_sources(d.dataset_name_or_path):
        files, fmt, columns = source_files(src, "dev", d)
        if files:
            items += read_items(files, fmt, columns)[0]
    return items


def evaluate_dev_by_generation(cfg, model, tokenizer, output_dir: str) -> Dict[str, float]:
    """``eval_with_do_generation`` of a fine-tuning run: the dev records of any format, prompts rendered with
    the training template (:func:`prompt_and_reference`), metrics as :func:`evaluate_by_generation`."""
    from ..data.build import make_renderer
    from ..data.tokenize import resolve_chat_template

    d, g = cfg.data, cfg.generate
    renderer = make_renderer(cfg, tokenizer, resolve_chat_template(tokenizer, None))
    items = read_dev_items(cfg)
    metrics, _ = evaluate_by_generation(
        model,
        tokenizer,
        items,
        d.src_length,
        d.max_length,
        None,
        g.top_k,
        g.top_p,
        output_dir if d.save_generation_output else None,
        renderer=renderer,
    )
    return metrics


def generate_answers(
    model,
    tokenizer,
    examples: Sequence,
    src_length: int,
    max_length: int,
    use_template: bool,
    top_k: int,
    top_p: float,
    renderer=None,
) -> List[Dict]:
    """One generation per example (greedy when top_k == 1 and top_p == 1.0, else sampling).  With ``renderer``
    the examples may be of any format (:func:`prompt_and_reference`), else they are src/tgt ``Example`` s."""
    sampling = not (top_k == 1 and top_p == 1.0)
    kwargs = dict(
        decode_strategy="sampling" if sampling else "greedy_search",
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if sampling:
        kwargs.update(top_k=top_k, top_p=top_p)
    was_training = model.training
    model.eval()
    rows = []
    with paddle.no_grad():
        for ex in examples:
            if renderer is not None:
                prompt, reference, question = prompt_and_reference(ex, renderer)
            else:
                prompt, reference = generation_prompt(ex, tokenizer, src_length, max_length, use_template)
                question = ex.src[-1]
            max_new = max(max_length - len(prompt), 1)
            ids, _ = model.generate(
                paddle.to_tensor([prompt], dtype="int64"),
                max_new_tokens=max_new,
                attention_mask=paddle.ones([1, len(prompt)], dtype="int64"),
                use_cache=True,
                **kwargs,
            )
            out = [int(t) for t in ids[0].numpy()]
            if tokenizer.eos_token_id in out:
                out = out[: out.index(tokenizer.eos_token_id)]
            rows.append(
                {
                    "origin": ex.origin,
                    "src": question,
                    "reference": reference,
                    "prediction": tokenizer.decode(out, skip_special_tokens=True).strip(),
                }
            )
    if was_training:
        model.train()
    return rows


def evaluate_by_generation(
    model,
    tokenizer,
    examples,
    src_length,
    max_length,
    use_template,
    top_k,
    top_p,
    output_dir: str = None,
    renderer=None,
) -> Tuple[Dict[str, float], List[Dict]]:
    """Metrics (eval_exact_match, eval_bleu4, eval_rouge_l); with ``output_dir``
    the predictions go to ``output_dir/generated_predictions.json`` (JSON lines)."""
    rows = generate_answers(model, tokenizer, examples, src_length, max_length, use_template, top_k, top_p, renderer)
    metrics = {
        f"eval_{k}": v for k, v in score([r["prediction"] for r in rows], [r["reference"] for r in rows]).items()
    }
    if output_dir:
        with open(os.path.join(output_dir, "generated_predictions.json"), "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return metrics, rows
