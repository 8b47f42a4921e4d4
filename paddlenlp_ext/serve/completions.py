"""``/v1/completions`` bodies -> checked requests: the prompt forms lm-eval and the openai client send,
``logprobs`` k and ``echo`` (the chat side and the shared checks are in :mod:`.protocol`; no paddle)."""

from __future__ import annotations

from typing import Any, List

from .protocol import (
    COMPLETION_KEYS,
    MAX_N,
    MAX_TOP_LOGPROBS,
    GenRequest,
    Sampling,
    bad,
    bounded_int,
    common_fields,
    is_int,
    parse_sampling,
)


def parse_prompts(prompt: Any) -> List[Any]:
    """``/v1/completions``' prompt as a list of prompts, each a string or a list of token ids.

    >>> parse_prompts("hi"), parse_prompts(["a", "b"]), parse_prompts([1, 2]), parse_prompts([[1], [2, 3]])
    (['hi'], ['a', 'b'], [[1, 2]], [[1], [2, 3]])
    """
    what = "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    if prompt is None:
        raise bad("prompt", what, "missing_required_parameter")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad(
            "prompt", what + f", got {type(prompt).__name__ if prompt != [] else 'an empty list'}", "invalid_type"
        )
    if all(is_int(t) for t in prompt):
        return [list(prompt)]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and p and all(is_int(t) for t in p):
            out.append(list(p))
        else:
            raise bad(f"prompt[{i}]", f"prompt[{i}] must be a string or a non-empty list of token ids", "invalid_type")
    return out


def parse_completion(body: Any, models: List[str], default: Sampling) -> GenRequest:
    """A ``/v1/completions`` body -> GenRequest: prompts (parse_prompts), ``logprobs`` k, ``echo``."""
    echo = body.get("echo", False) if isinstance(body, dict) else False
    if not isinstance(echo, bool):
        raise bad("echo", f"echo must be true or false, got {echo!r}", "invalid_type")
    zero = isinstance(body, dict) and echo and body.get("max_tokens") == 0
    common = common_fields(dict(body, max_tokens=None) if zero else body, "/v1/completions", COMPLETION_KEYS, models)
    if zero:
        common["max_tokens"] = 0  # echo only: the prompt's logprobs, nothing generated (as OpenAI's legacy API)
    prompts = parse_prompts(body.get("prompt"))
    k = bounded_int(body, "logprobs", 0, MAX_TOP_LOGPROBS, None)
    best_of = bounded_int(body, "best_of", 1, MAX_N, None)
    if best_of is not None and best_of != common["n"]:
        raise bad(
            "best_of",
            f"best_of {best_of} != n {common['n']} is not supported (ranking samples by "
            "likelihood is not implemented): leave best_of out",
        )
    if common["stream"] and echo:
        raise bad(
            "echo",
            "echo with stream is not supported: send stream false (echo is for scoring prompts)",
            "unsupported_parameter",
        )
    return GenRequest(
        kind="completion", sampling=parse_sampling(body, default), prompt=prompts, logprobs=k, echo=echo, **common
    )
