"""GRPO's multi-turn tool rollouts without the CLI: tool schemas against transformers' get_json_schema, the
config checks of tools / max_turns / tool_timeout, the sandboxed tool process (timeout, no network, crashes),
the template tokens appended between turns, and the loss: tool-result tokens carry no loss and no gradient.
The CLI toy is in test_grpo_tools_e2e.py."""

import doctest
import json
import os
import socket
import threading

import numpy as np
import pytest

from conftest import ROOT

TOY_CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "grpo_argument.json")
ADD = "paddlenlp_ext.examples.calculator:add"


def test_doctests():
    from paddlenlp_ext.examples import calculator
    from paddlenlp_ext.grpo import multiturn, tool_worker, tools

    for module in (calculator, multiturn, tool_worker, tools):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_schema_equals_transformers_get_json_schema():
    """What apply_chat_template(tools=[function]) renders: transformers' own schema of the same function."""
    pytest.importorskip("transformers")
    from typing import Dict, List, Optional, Union

    from transformers.utils import get_json_schema

    from paddlenlp_ext.examples.calculator import add
    from paddlenlp_ext.config.tool_schema import function_schema

    def search(
        query: str,
        limit: int = 3,
        exact: bool = False,
        tags: Optional[List[str]] = None,
        weights: Dict[str, float] = None,
        key: Union[int, str] = 0,
    ) -> List[str]:
        """Search the notes.

        Longer explanation.

        Args:
            query: What to look for,
                over two lines.
            limit: How many results.
            exact: Whole words only.
            tags: Only notes with these tags.
            weights: Per-field weights.
            key: A key.

        Returns:
            The matching titles.
        """

    for func in (add, search):
        assert function_schema(func) == get_json_schema(func)


def load(tmp_path, *overrides):
    from paddlenlp_ext.config.parse import load_config

    return load_config(
        TOY_CONFIG,
        [
            "--output_dir",
            str(tmp_path / "o"),
            "--model_name_or_path",
            os.path.join(ROOT, "build", "tiny-llama"),
            *map(str, overrides),
        ],
        mode="grpo",
    )


def test_config_checks(tmp_path):
    from paddlenlp_ext.config.parse import ConfigError

    cfg = load(tmp_path, "--tools", json.dumps([ADD]), "--max_turns", "3", "--tool_timeout", "2.5")
    assert cfg.alignment.tools == [ADD] and cfg.alignment.max_turns == 3 and cfg.alignment.tool_timeout == 2.5
    assert load(tmp_path).alignment.max_turns == 1 and load(tmp_path).alignment.tools is None  # today's behaviour
    cases = [
        (("--tools", '["nowhere_mod:f"]', "--max_turns", "2"), "tools[0]: 'nowhere_mod:f': cannot import module"),
        (
            ("--tools", '["grpo_tools:no_doc"]', "--max_turns", "2"),
            "tools[0] 'grpo_tools:no_doc': no_doc has no docstring",
        ),
        (
            ("--tools", json.dumps([ADD, ADD]), "--max_turns", "2"),
            "tools[1] 'paddlenlp_ext.examples.calculator:add': a second tool named 'add'",
        ),
        (("--tools", json.dumps([ADD])), "set max_turns >= 2"),
        (("--max_turns", "2"), "max_turns 2 needs tools"),
        (("--tool_timeout", "3"), "tool_timeout is set but there are no tools"),
        (("--tools", json.dumps([ADD]), "--max_turns", "2", "--tool_timeout", "0"), "tool_timeout"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as e:
            load(tmp_path, *overrides)
        assert message in str(e.value), (overrides, str(e.value))


@pytest.fixture(scope="module")
def runner():
    from paddlenlp_ext.grpo.tools import ToolRunner

    r = ToolRunner(
        [
            ADD,
            "grpo_tools:slow",
            "grpo_tools:fetch",
            "grpo_tools:run_program",
            "grpo_tools:crash",
            "grpo_tools:chatty",
            "grpo_tools:resolve",
        ],
        timeout=1.0,
    )
    yield r
    r.close()


def test_calls_results_and_errors(runner):
    assert runner.call("add", '{"a": 2, "b": 3}') == ("5", True)
    assert runner.call("chatty", {"x": 4}) == ("8", True)  # its print does not disturb the protocol
    content, ok = runner.call("add", {"a": 2})
    assert not ok and json.loads(content)["error"].startswith("TypeError: add() missing 1 required positional")
    assert runner.call("add", "{not json") == (
        '{"error": "the arguments are not JSON: Expecting property name enclosed in double quotes"}',
        False,
    )
    content, ok = runner.call("nope", {})
    assert not ok and "unknown tool 'nope'" in content


def test_timeout_and_crash_are_results_and_the_next_call_works(runner):
    content, ok = runner.call("slow", {"seconds": 30})
    assert not ok and json.loads(content) == {"error": "slow: timed out after 1 s"}
    assert runner.call("add", {"a": 1, "b": 1}) == ("2", True)  # a fresh tool process
    content, ok = runner.call("crash", {})
    assert not ok and json.loads(content) == {"error": "crash: the tool process exited"}
    assert runner.call("slow", {"seconds": 0}) == ("done", True)


def test_no_network(runner):
    """A tool that connects to a server listening on this machine's loopback gets an error result (the audit hook
    refuses the socket; in a network namespace the loopback would not reach it either), and starting a program is
    refused too; the parent is unaffected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def answer():
        try:
            conn, _ = server.accept()
            conn.sendall(b"secret")
            conn.close()
        except OSError:
            pass

    threading.Thread(target=answer, daemon=True).start()
    try:
        content, ok = runner.call("fetch", {"port": port})
        assert not ok and "PermissionError: GRPO tools run without network: creating a socket is refused" in content
        content, ok = runner.call("resolve", {"host": "localhost"})
        assert not ok and "resolving a host name is refused" in content
        content, ok = runner.call("run_program", {})
        assert not ok and "starting a program is refused" in content
        assert "audit hook" in runner.isolation
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:  # the parent still can
            assert s.recv(100) == b"secret"
    finally:
        server.close()


def test_suffix_tokens_are_what_training_renders(tiny_tokenizer):
    """prompt + sampled call turn + the suffix of the tool message = the tokens SFT renders for the same
    conversation (the rollout continues exactly the text the model was trained on)."""
    from paddlenlp_ext.data.chat_template import render, special_tokens_of
    from paddlenlp_ext.data.tokenize import _encode
    from paddlenlp_ext.examples.calculator import TEMPLATE, add, sft_conversation
    from paddlenlp_ext.grpo.multiturn import ToolEnv, tool_suffix_ids
    from paddlenlp_ext.config.tool_schema import function_schema

    conv = sft_conversation(2, 3, call=True)
    msgs = [dict(m) for m in conv["messages"]]
    msgs[1]["tool_calls"] = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    special = special_tokens_of(tiny_tokenizer)
    tools = [function_schema(add)]
    full = _encode(tiny_tokenizer, render(TEMPLATE, msgs, tools, False, special))
    prompt = _encode(tiny_tokenizer, render(TEMPLATE, msgs[:1], tools, True, special))
    eos = tiny_tokenizer.eos_token_id
    assert full[: len(prompt)] == prompt
    end1 = full.index(eos, len(prompt)) + 1  # the call turn as sampled, up to its EOS
    env = ToolEnv(
        tokenizer=tiny_tokenizer,
        source=TEMPLATE,
        special=special,
        style="hermes",
        schemas=tools,
        runner=None,
        eos_ids=[eos],
    )
    suffix = tool_suffix_ids(env, [{"role": "tool", "name": "add", "content": "5"}])
    assert full[end1 : end1 + len(suffix)] == suffix
    answer = full[end1 + len(suffix) :]
    assert tiny_tokenizer.decode(answer, skip_special_tokens=True).strip() == "The answer is 5."
    text = tiny_tokenizer.decode(full[len(prompt) : end1 - 1], skip_special_tokens=True)
    from paddlenlp_ext.grpo.multiturn import _assistant_message

    message, calls = _assistant_message(text, "hermes")
    assert calls == [("add", '{"a": 2, "b": 3}')] and message["tool_calls"][0]["function"]["arguments"] == {
        "a": 2,
        "b": 3,
    }


class Logits:
    """A stand-in policy whose logits are one trainable tensor [1, S, V] (the loss's path from logits on)."""

    def __init__(self, S, V, seed=0):
        import paddle

        self.param = paddle.create_parameter(
            [1, S, V],
            "float32",
            default_initializer=paddle.nn.initializer.Assign(
                np.random.default_rng(seed).normal(size=(1, S, V)).astype("float32")
            ),
        )

    def __call__(self, **kw):
        return self.param


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo", "cispo"])
def test_tool_tokens_carry_no_loss_and_no_gradient(loss_type):
    """One prompt, G = 2 multi-turn completions [call, EOS | tool result x3 | answer, EOS] with masks 1 1 0 0 0 1 1:
    the positions that predict the tool-result tokens get exactly zero gradient, the generated ones do not, the
    token count is the generated tokens only, and the loss equals the loss of the generated tokens alone."""
    import paddle

    from paddlenlp_ext.grpo.objective import aggregate, token_losses
    from paddlenlp_ext.grpo.rows import sequence_rows
    from paddlenlp_ext.grpo.trainer import token_logps

    prompt = [5, 6, 7]
    completions = [[10, 2, 30, 31, 32, 11, 2], [12, 2, 33, 34, 35, 13, 14]]
    trained = [[1, 1, 0, 0, 0, 1, 1]] * 2
    rows = sequence_rows([prompt, prompt], completions, 0, capacity=20, flash_mask=False, completion_masks=trained)
    batch = {k: paddle.to_tensor(v) if isinstance(v, np.ndarray) else v for k, v in rows.items()}
    assert batch["logp_token"].numpy().tolist() == [10, 2, 11, 2, 12, 2, 13, 14]  # tool tokens: not scored
    policy = Logits(20, 40)
    logps = token_logps(policy, batch, 1.0)  # [T = 8]
    adv = paddle.to_tensor(np.asarray([1.0, -1.0], dtype=np.float32))
    seg = batch["logp_segment"]
    per, _, _ = token_losses(
        logps,
        logps.detach() - 0.05,
        adv[seg],
        logps.detach() + 0.1,
        epsilon=0.2,
        beta=0.04,
        epsilon_high=5.0 if loss_type == "cispo" else None,
        loss_type=loss_type,
        segment=seg,
        sequences=2,
    )
    loss = aggregate(
        per, loss_type, segment=seg, sequences=2, global_tokens=8, global_sequences=2, max_completion_length=7
    )
    loss.backward()
    grad = np.abs(policy.param.grad.numpy()[0]).sum(-1)  # [S]: gradient reaching each position's logits
    # row layout: prompt (3) + completion (7) per sequence; position p predicts token p + 1
    # (completion token j sits at s + 3 + j and is predicted at s + 2 + j): the tool tokens j = 2, 3, 4
    tool_positions = [s + 2 + j for s in (0, 10) for j in (2, 3, 4)]
    generated_positions = [s + 2 + j for s in (0, 10) for j in (0, 1, 5, 6)]
    assert np.all(grad[tool_positions] == 0.0), grad
    assert np.all(grad[generated_positions] > 0), grad
    # the scored log-probs are exactly those of the generated tokens (the tool tokens only condition later ones)
    full = paddle.nn.functional.log_softmax(policy.param[0].detach(), -1).numpy()  # [S, V]
    want = np.asarray(
        [full[p, t] for p, t in zip(generated_positions, [10, 2, 11, 2, 12, 2, 13, 14])], dtype=np.float32
    )
    np.testing.assert_allclose(logps.numpy(), want, rtol=1e-6, atol=1e-6)


def test_rollout_with_tool_masks_survives_a_checkpoint(tmp_path):
    """save_rollout / load_rollout keep the multi-turn masks and tool counts, and rebuild the rows with them."""
    from paddlenlp_ext.grpo.rollout import MicroRollout, Rollout, load_rollout, save_rollout

    completions, trained = [[10, 2, 30, 31, 11, 2], [12, 13, 2]], [[1, 1, 0, 0, 1, 1], [1, 1, 1]]
    micro = MicroRollout(
        indices=[3],
        completions=completions,
        rewards=np.array([1.0, 0.0]),
        per_func={},
        advantages=np.array([0.7, -0.7], dtype=np.float32),
        batch=None,
        trained=trained,
        tool_calls=np.array([1.0, 0.0]),
        tool_failures=np.array([0.0, 0.0]),
        turns=np.array([2.0, 1.0]),
    )
    save_rollout(Rollout(step=4, micro=[micro], global_tokens=7, global_sequences=2), str(tmp_path / "r.npz"))
    seen = []
    back = load_rollout(str(tmp_path / "r.npz"), lambda *args: seen.append(args) or "rows")
    m = back.micro[0]
    assert seen == [([3], completions, trained)] and m.batch == "rows"
    assert m.trained == trained and m.turns.tolist() == [2.0, 1.0] and m.tool_calls.tolist() == [1.0, 0.0]
    assert back.global_tokens == 7
