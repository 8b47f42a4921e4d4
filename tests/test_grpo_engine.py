"""GRPO's rollout engine (``rollout_engine: engine``, paddlenlp_ext/generation/rollouts.py) against today's
``model.generate`` path on the tiny model: the same sampled tokens under the same seeds (rows ending at
different steps, temperature, top_p), greedy rollouts equal to ``generate``'s greedy search, a group's
tokens independent of the other groups of its batch, and multi-turn tool rollouts unchanged.
The speed is measured by bench/grpo.py."""

import doctest
from collections import Counter

import numpy as np
import pytest

PROMPTS = [[1, 50, 60, 70], [1, 80, 90], [1, 33, 44, 55, 66, 77, 88, 99, 111], [1, 7]]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from paddlenlp.transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def test_doctests():
    from paddlenlp_ext.generation import rollouts

    assert doctest.testmod(rollouts).failed == 0


def frequent_tokens(policy):
    """Tokens the tiny model samples often: used as EOS ids, so that rows end at different steps."""
    from paddlenlp_ext.grpo.sampling import sample_groups

    out = sample_groups(
        policy,
        PROMPTS,
        [0, 1, 2, 3],
        group=4,
        step=0,
        seed=1,
        max_new_tokens=12,
        temperature=1.0,
        top_p=1.0,
        eos_ids=[2],
        pad_id=0,
    )
    return [t for t, _ in Counter(t for row in out for t in row).most_common(4)]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_engine_samples_what_generate_samples(policy, temperature, top_p):
    from paddlenlp_ext.grpo.sampling import sample_groups

    eos = frequent_tokens(policy)
    kw = dict(group=4, step=5, seed=42, max_new_tokens=12, temperature=temperature, top_p=top_p, eos_ids=eos, pad_id=0)
    was = policy.training
    ours = sample_groups(policy, PROMPTS, [3, 8, 1, 6], engine="engine", **kw)
    assert policy.training == was
    base = sample_groups(policy, PROMPTS, [3, 8, 1, 6], engine="generate", **kw)
    assert ours == base
    lengths = {len(r) for r in ours}
    assert len(lengths) > 2 and any(r[-1] in eos and len(r) < 12 for r in ours)  # rows left at different steps
    assert len({tuple(r) for r in ours}) > len(PROMPTS)  # really sampled


def test_greedy_equals_generate_greedy_search(policy):
    import paddle
    from paddlenlp.generation import GenerationConfig

    from paddlenlp_ext.generation import SampleGroup, sample_batch

    ours = sample_batch(
        policy, [SampleGroup(p, 2, seed=0, max_new_tokens=10) for p in PROMPTS], eos_ids=[2], pad_id=0, greedy=True
    )
    cfg = GenerationConfig(
        decode_strategy="greedy_search", max_new_tokens=10, max_length=0, eos_token_id=2, pad_token_id=0, use_cache=True
    )
    policy.eval()
    for p, rows in zip(PROMPTS, ours):
        ids = paddle.to_tensor(np.asarray([p], "int64"))
        gen, _ = policy.generate(
            input_ids=ids,
            attention_mask=paddle.ones_like(ids),
            position_ids=paddle.to_tensor(np.arange(len(p), dtype="int64")[None]),
            generation_config=cfg,
        )
        want = gen.numpy()[0].tolist()
        want = want[: want.index(2) + 1] if 2 in want else want
        assert rows == [want, want]


def test_a_group_does_not_depend_on_its_batch(policy):
    """Per-group RNG states: a group alone, first, last or among other groups draws the same tokens."""
    from paddlenlp_ext.generation import SampleGroup, sample_batch

    a, b, c = (SampleGroup(PROMPTS[2], 3, 11, 9), SampleGroup(PROMPTS[0], 2, 12, 5), SampleGroup(PROMPTS[3], 4, 13, 7))
    kw = dict(eos_ids=[2], pad_id=0, temperature=1.0, top_p=0.95)
    alone = sample_batch(policy, [a], **kw)[0]
    assert sample_batch(policy, [b, a, c], **kw)[1] == alone
    assert sample_batch(policy, [c, b, a], **kw)[2] == alone
    assert sample_batch(policy, [a, c], **kw)[1] == sample_batch(policy, [c], **kw)[0]
    assert sample_batch(policy, [SampleGroup(PROMPTS[2], 3, 99, 9)], **kw)[0] != alone  # the seed matters


def test_multiturn_tool_rollouts_equal(policy, tiny_tokenizer):
    """run_tools with both engines: the call turns run the calculator, the next turns are sampled alike."""
    from paddlenlp_ext.data.chat_template import render, special_tokens_of
    from paddlenlp_ext.data.tokenize import _encode
    from paddlenlp_ext.examples.calculator import TEMPLATE, add, sft_conversation
    from paddlenlp_ext.grpo.multiturn import ToolEnv, run_tools
    from paddlenlp_ext.config.tool_schema import function_schema
    from paddlenlp_ext.grpo.tools import ToolRunner

    special, tools = special_tokens_of(tiny_tokenizer), [function_schema(add)]
    eos = tiny_tokenizer.eos_token_id
    prompts, first = [], []
    for a, b in ((2, 3), (10, 4)):
        msgs = [dict(m) for m in sft_conversation(a, b, call=True)["messages"]]
        msgs[1]["tool_calls"] = [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]
        full = _encode(tiny_tokenizer, render(TEMPLATE, msgs, tools, False, special))
        prompt = _encode(tiny_tokenizer, render(TEMPLATE, msgs[:1], tools, True, special))
        call = full[len(prompt) : full.index(eos, len(prompt)) + 1]  # the call turn, up to its EOS
        prompts += [prompt, prompt]
        first += [call, call[:-1]]  # the second of each pair did not end: no tool run
    runner = ToolRunner(["paddlenlp_ext.examples.calculator:add"], timeout=30.0)
    try:
        env = ToolEnv(
            tokenizer=tiny_tokenizer,
            source=TEMPLATE,
            special=special,
            style="hermes",
            schemas=tools,
            runner=runner,
            eos_ids=[eos],
        )
        kw = dict(step=2, seed=5, max_turns=3, budget=len(first[0]) + 120, temperature=1.0, top_p=1.0, pad_id=0)
        ours = run_tools(policy, env, prompts, first, [0, 1], 2, engine="engine", **kw)
        base = run_tools(policy, env, prompts, first, [0, 1], 2, engine="generate", **kw)
    finally:
        runner.close()

    def seen(e):  # a tool call's id is random (call_<uuid>)
        messages = [
            {**m, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]}
            if "tool_calls" in m
            else m
            for m in e.messages
        ]
        return e.tokens, e.trained, messages, e.turns, e.tool_calls

    assert [seen(e) for e in ours] == [seen(e) for e in base]
    assert [e.tool_calls for e in ours] == [1, 0, 1, 0] and ours[0].turns >= 2 and ours[1].turns == 1
    assert ours[0].messages[1] == {"role": "tool", "name": "add", "content": "5"}
    assert ours[2].messages[1]["content"] == "14" and 0 in ours[0].trained


def test_unknown_engine_is_an_error(policy):
    from paddlenlp_ext.grpo.sampling import sample_groups

    with pytest.raises(ValueError, match="rollout_engine must be engine or generate"):
        sample_groups(
            policy,
            PROMPTS[:1],
            [0],
            group=2,
            step=0,
            seed=0,
            max_new_tokens=2,
            temperature=1.0,
            top_p=1.0,
            eos_ids=[2],
            pad_id=0,
            engine="vllm",
        )


def test_a_step_of_two_micro_batches_samples_alike(policy):
    """sample_step: the engine decodes the step's micro-batches as one batch, generate one by one; same tokens."""
    from paddlenlp_ext.grpo.sampling import sample_step

    plan = [[2, 0], [3, 1]]
    kw = dict(group=2, step=1, seed=3, max_new_tokens=6, temperature=1.0, top_p=1.0, eos_ids=[2], pad_id=0)
    ours = sample_step(policy, PROMPTS, plan, engine="engine", **kw)
    assert ours == sample_step(policy, PROMPTS, plan, engine="generate", **kw)
    assert [len(m) for m in ours] == [4, 4]


def test_rollout_engine_key(tiny_model_dir, tmp_path):
    """engine by default, generate selectable, anything else refused naming the key (exit 2 at the CLI)."""
    from test_grpo import grpo_config

    from paddlenlp_ext.config.parse import ConfigError

    assert grpo_config(tiny_model_dir, tmp_path).alignment.rollout_engine == "engine"
    assert grpo_config(tiny_model_dir, tmp_path, "--rollout_engine", "generate").alignment.rollout_engine == "generate"
    with pytest.raises(ConfigError) as e:
        grpo_config(tiny_model_dir, tmp_path, "--rollout_engine", "vllm")
    assert "rollout_engine: must be one of engine, generate; got 'vllm'" in "\n".join(e.value.problems)
