"""Multi-turn tool rollouts: a completion's tool calls are run, their results appended, generation continues.

After the first turn (``sampling.sample_groups``), for each completion, while its last turn ended with an
EOS, holds tool calls (parsed by the server's parser, ``serve.tools.parse_tool_calls``, in the format the
chat template writes) and fewer than ``max_turns`` turns were made:

1. every call runs in the tool process (``tools.ToolRunner``: no network, ``tool_timeout``); an error,
   a timeout or an unknown tool is the result text (``{"error": ...}``), never a crash;
2. the results become ``tool`` messages; the tokens between the turn's EOS and the next assistant turn
   (the template's tool turn and generation prompt, :func:`tool_suffix_ids`) are appended with mask 0;
3. the next turn is sampled after ``prompt + everything so far`` (one sequence, seeded by (seed, prompt
   index, step, generation index, turn)) and appended with mask 1.

The whole completion -- generated turns and what was inserted between them -- fits
``max_completion_length`` (as TRL): tool results that would leave no room for another token are not
appended and the completion ends with its calling turn.  The generated tokens are kept as sampled
(never re-tokenized), so the scored log-probs are those of the sampled tokens.

Worked example (hermes template, max_turns 2): the first turn ``<tool_call>{"name": "add", "arguments":
{"a": 2, "b": 3}}</tool_call></s>`` -> add(a=2, b=3) -> tool message "5" -> the suffix tokens of
``\\n<|im_start|>user\\n<tool_response>\\n5\\n</tool_response></s>\\n<|im_start|>assistant\\n`` (mask 0) ->
the second turn ``The answer is 5.</s>`` (mask 1).  The reward functions get ``messages``: the prompt's
messages, the assistant turn with its ``tool_calls``, the tool message and the final assistant turn.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

import numpy as np
import paddle
from paddlenlp.generation import GenerationConfig

from ..data.chat_template import TemplateRenderError, render
from ..data.tokenize import _encode
from ..generation import SampleGroup, sample_batch
from ..serve.tools import parse_tool_calls
from .sampling import cut_completion
from .tools import ToolRunner

__all__ = ["ToolEnv", "Episode", "tool_suffix_ids", "turn_seed", "run_tools"]


@dataclass
class ToolEnv:
    """What a multi-turn rollout needs besides the model: the template and its tool-call format, the tools."""

    tokenizer: object
    source: str  # the jinja chat template (the one the prompts were rendered with)
    special: Dict  # its special-token variables
    style: str  # "hermes" or "llama3" (serve.tools.tool_style)
    schemas: List[Dict]  # the tools' JSON schemas (the template's tools=)
    runner: ToolRunner
    eos_ids: List[int]
    _suffix_cache: Dict[str, List[int]] = field(default_factory=dict)


@dataclass
class Episode:
    """One completion: its tokens (all turns and what is between them), which of them were generated, the
    conversation after the prompt (assistant and tool messages), and its counts."""

    tokens: List[int]
    trained: List[int]
    messages: List[Dict] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    turns: int = 1


def turn_seed(seed: int, prompt_index: int, step: int, generation: int, turn: int) -> int:
    """A 31-bit seed for turn ``turn`` (>= 1, the second turn) of one completion.

    >>> turn_seed(42, 3, 7, 0, 1) == turn_seed(42, 3, 7, 0, 1), turn_seed(42, 3, 7, 0, 1) == turn_seed(42, 3, 7, 1, 1)
    (True, False)
    """
    digest = hashlib.sha256(
        f"grpo-turn:{int(seed)}:{int(prompt_index)}:{int(step)}:{int(generation)}:{int(turn)}".encode()
    ).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def tool_suffix_ids(env: ToolEnv, tool_messages: List[Dict]) -> List[int]:
    """The token ids the template writes after an assistant turn's end-of-turn token (its EOS) up to the next
    assistant turn's first token: the tool messages and the generation prompt.  As TRL's: render a short
    conversation ending with a calling assistant turn with and without ``tool_messages`` (+ generation
    prompt), tokenize both, cut the shorter after its last EOS; the longer must continue it."""
    name = tool_messages[0].get("name", "tool")
    call = [{"type": "function", "function": {"name": name, "arguments": {}}}]
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
    prefix_text = render(env.source, head, env.schemas, False, env.special)
    full_text = render(env.source, head + tool_messages, env.schemas, True, env.special)
    prefix, full = _encode(env.tokenizer, prefix_text), _encode(env.tokenizer, full_text)
    ends = [k for k, t in enumerate(prefix) if t in env.eos_ids]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise TemplateRenderError(
            "the chat template renders an assistant turn differently once a tool message "
            "follows it, so the tool result's tokens cannot be appended to the sampled turn"
        )
    return full[len(prefix) :]


def _assistant_message(text: str, style: str):
    """(assistant message, [(name, arguments JSON)]) of one decoded turn."""
    content, calls = parse_tool_calls(text, style)
    message: Dict = {"role": "assistant", "content": content or ""}
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in calls
        ]
    return message, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def sample_one(
    model,
    ids: Sequence[int],
    seed: int,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_ids: Sequence[int],
    pad_id: int,
) -> List[int]:
    """One continuation of ``ids`` (sampling.sample_groups' settings, one row, its own seed)."""
    cfg = GenerationConfig(
        decode_strategy="sampling",
        max_new_tokens=int(max_new_tokens),
        max_length=0,
        top_k=0,
        top_p=float(top_p),
        temperature=float(temperature),
        repetition_penalty=1.0,
        eos_token_id=list(eos_ids) if len(eos_ids) > 1 else int(eos_ids[0]),
        pad_token_id=int(pad_id),
        use_cache=True,
    )
    paddle.seed(seed)
    row = paddle.to_tensor(np.asarray(ids, dtype=np.int64)[None])  # [1, L]
    pos = paddle.to_tensor(np.arange(len(ids), dtype=np.int64)[None])  # [1, L]
    gen, _ = model.generate(
        input_ids=row, attention_mask=paddle.ones_like(row), position_ids=pos, generation_config=cfg
    )
    return cut_completion(gen.numpy()[0], max_new_tokens, eos_ids)


def _after_turn(env: ToolEnv, ep: Episode, turn: Sequence[int], budget: int, max_turns: int):
    """Book the turn just sampled into ``ep``; run its tool calls and append their results: the room left for
    the next turn (> 0), or None when the completion has ended (no calls, no EOS, max_turns, no room)."""
    text = env.tokenizer.decode([t for t in turn if t not in env.eos_ids], skip_special_tokens=True)
    message, calls = _assistant_message(text, env.style)
    ep.messages.append(message)
    ended = bool(turn) and int(turn[-1]) in env.eos_ids
    if not calls or not ended or ep.turns >= max_turns:
        return None
    results = []
    for name, arguments in calls:
        content, ok = env.runner.call(name, arguments)
        ep.tool_calls += 1
        ep.tool_failures += int(not ok)
        results.append({"role": "tool", "name": name, "content": content})
    suffix = tool_suffix_ids(env, results)
    room = budget - len(ep.tokens) - len(suffix)
    if room < 1:  # no room left for another turn: the results are not appended (as TRL)
        return None
    ep.messages += results
    ep.tokens += suffix
    ep.trained += [0] * len(suffix)
    return room


def run_tools(
    model,
    env: ToolEnv,
    prompts: Sequence[Sequence[int]],
    first: Sequence[Sequence[int]],
    prompt_indices: Sequence[int],
    group: int,
    *,
    step: int,
    seed: int,
    max_turns: int,
    budget: int,
    temperature: float,
    top_p: float,
    pad_id: int,
    engine: str = "generate",
) -> List[Episode]:
    """Every completion of a micro-batch to its end (the module docstring).  ``prompts[k]`` / ``first[k]``:
    the prompt and first turn of completion k (prompt ``prompt_indices[k // group]``, generation ``k % group``).
    ``engine``: "generate" samples each next turn alone with ``model.generate``; "engine" samples the next
    turns of all completions together, one round per turn (``generation.sample_batch``: the same tokens)."""
    was_training = model.training
    state = paddle.get_rng_state()
    episodes = [Episode(tokens=list(turn), trained=[1] * len(turn)) for turn in first]
    model.eval()
    try:
        with paddle.no_grad():
            live = [(k, first[k]) for k in range(len(episodes))]  # completions whose last turn is to be booked
            while live:
                pending = []  # (k, seed, room) of the completions that go on
                for k, turn in live:
                    ep = episodes[k]
                    if ep.turns > 1 and not turn:
                        continue
                    room = _after_turn(env, ep, turn, budget, max_turns)
                    if room is not None:
                        pending.append(
                            (k, turn_seed(seed, prompt_indices[k // group], step, k % group, ep.turns), room)
                        )
                if engine == "engine":
                    groups = [SampleGroup(list(prompts[k]) + episodes[k].tokens, 1, s, room) for k, s, room in pending]
                    turns = [
                        rows[0]
                        for rows in sample_batch(
                            model, groups, eos_ids=env.eos_ids, pad_id=pad_id, temperature=temperature, top_p=top_p
                        )
                    ]
                else:
                    turns = [
                        sample_one(
                            model,
                            list(prompts[k]) + episodes[k].tokens,
                            s,
                            max_new_tokens=room,
                            temperature=temperature,
                            top_p=top_p,
                            eos_ids=env.eos_ids,
                            pad_id=pad_id,
                        )
                        for k, s, room in pending
                    ]
                for (k, _, _), turn in zip(pending, turns):
                    episodes[k].tokens += turn
                    episodes[k].trained += [1] * len(turn)
                    episodes[k].turns += 1
                live = [(k, turn) for (k, _, _), turn in zip(pending, turns)]
    finally:
        paddle.set_rng_state(state)
        if was_training:
            model.train()
    return episodes


def final_answers(episodes: Sequence[Episode]) -> List[str]:
    """The content of each completion's last assistant message (what reward functions get as ``completions``).

    >>> final_answers([Episode([], [], [{"role": "assistant", "content": "5"}])])
    ['5']
    """
    return [next((m["content"] for m in reversed(e.messages) if m["role"] == "assistant"), "") for e in episodes]


def tool_metrics(calls: np.ndarray, failures: np.ndarray, turns: np.ndarray) -> Dict[str, float]:
    """Logged per step (TRL's names): ``tools/call_frequency`` (mean calls per completion),
    ``tools/failure_frequency`` (failed share of the calls), ``tools/turns`` (mean assistant turns).

    >>> tool_metrics(np.array([1, 0, 2, 1]), np.array([0, 0, 1, 0]), np.array([2, 1, 2, 2]))
    {'tools/call_frequency': 1.0, 'tools/failure_frequency': 0.25, 'tools/turns': 1.75}
    """
    total = float(np.sum(calls))
    return {
        "tools/call_frequency": float(np.mean(calls)),
        "tools/failure_frequency": float(np.sum(failures)) / total if total else 0.0,
        "tools/turns": float(np.mean(turns)),
    }
