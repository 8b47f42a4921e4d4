"""KTO, reward models and GRPO on the dense rows of our decoder, through the real CLIs.

Every family-table row built with our decoder (``Family.decoder``) and a dense MLP is picked up here
without edits.  Each gets a directory as the hub ships one (transformers' ``save_pretrained`` of a random
tiny model with the row's non-default knobs, bf16, sharded: ``test_decoder_cli.save_row``), then:

* ``llm/run_kto.py`` (LoRA; the reference is the policy with its adapters off): step 1 sees policy ==
  reference, so every example's loss is weight / 2 = 0.5 exactly; the loss then falls;
* ``llm/run_reward.py`` (LoRA + the score head on the decoder body's last hidden state,
  ``models/heads.split_lm_head``): the train loss falls and the dev pair accuracy beats chance;
  ``llm/predict/reward_score.py`` on the output reproduces that accuracy;
* ``llm/run_grpo.py`` (LoRA, adapters-off reference): rollouts through the row's generate, finite losses, some
  steps with rewards that differ within a group (a non-zero advantage), and a policy that moved (KL > 0).

One test loops over the rows (one CLI call per row and mode) and reports every row's failure at once:
the slow suite pays for 3 short runs per row (about 40 s a row on 2 CPU cores).
"""

import functools
import json
import os

import pytest

from conftest import ROOT, run_jobs
from paddlenlp_ext.models.family_table import FAMILIES

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

DENSE_ROWS = [k for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp != "moe"]
LLM = os.path.join(ROOT, "llm")
TINY_CONFIG = os.path.join(LLM, "config", "tiny")


def _logs(out, key="loss"):
    with open(os.path.join(out, "trainer_state.json")) as f:
        return [h for h in json.load(f)["log_history"] if key in h and "step" in h]


def _summary(out):
    with open(os.path.join(out, "run_summary.json")) as f:
        return json.load(f)


def _kto(run, base, out):
    run(
        [
            os.path.join(LLM, "run_kto.py"),
            os.path.join(TINY_CONFIG, "kto_lora_argument.json"),
            "--model_name_or_path",
            base,
            "--output_dir",
            out,
            "--max_steps",
            "8",
            "--do_eval",
            "false",
            "--max_seq_len",
            "256",
            "--max_prompt_len",
            "128",
            "--warmup_steps",
            "0",
        ]
    )
    loss = [h["loss"] for h in _logs(out)]
    assert _summary(out)["reference"] == "adapters"
    assert len(loss) == 8 and abs(loss[0] - 0.5) < 1e-5, ("kto: policy != adapters-off reference at step 1", loss)
    assert min(loss[-3:]) < loss[0] - 0.05, ("kto: the loss does not fall", loss)


def _reward(run, base, out):
    run(
        [
            os.path.join(LLM, "run_reward.py"),
            os.path.join(TINY_CONFIG, "reward_lora_argument.json"),
            "--model_name_or_path",
            base,
            "--output_dir",
            out,
            "--max_steps",
            "12",
            "--max_seq_len",
            "256",
            "--max_prompt_len",
            "128",
            "--per_device_train_batch_size",
            "4",
        ]
    )
    loss = [h["loss"] for h in _logs(out)]
    ev = _summary(out)["eval"]
    assert len(loss) == 12 and all(x == x and abs(x) < 1e4 for x in loss), ("reward: loss", loss)
    assert sum(loss[-3:]) < sum(loss[:3]), ("reward: the loss does not fall", loss)
    assert ev["eval_rewards/accuracies"] > 0.5, ("reward: dev pair accuracy at or below chance", ev)
    # llm/predict/reward_score.py reloads the row + adapter + head and reproduces the dev pair accuracy
    scores = os.path.join(out, "scores.jsonl")
    r = run(
        [
            os.path.join(LLM, "predict", "reward_score.py"),
            "--model_name_or_path",
            out,
            "--input_file",
            os.path.join(ROOT, "llm", "data", "reward_tiny", "dev.json"),
            "--output_file",
            scores,
        ]
    )
    assert f"pair accuracy {ev['eval_rewards/accuracies']:.4f}" in r.stdout, (ev, r.stdout[-500:])


def _grpo(run, base, out, prompts):
    run(
        [
            os.path.join(LLM, "run_grpo.py"),
            os.path.join(TINY_CONFIG, "grpo_argument.json"),
            "--model_name_or_path",
            base,
            "--output_dir",
            out,
            "--train_dataset_path",
            prompts,
            "--lora",
            "true",
            "--max_steps",
            "4",
            "--num_generations",
            "4",
            "--max_completion_length",
            "8",
            "--learning_rate",
            "1e-2",
            "--report_to",
            "none",
        ]
    )
    logs = _logs(out, "reward")
    assert len(logs) == 4, logs
    assert all(abs(h["loss"]) < 1e4 and h["loss"] == h["loss"] for h in logs), ("grpo: loss", logs)
    assert any(h["reward_std"] > 0 for h in logs), ("grpo: no step with differing rewards in a group", logs)
    assert logs[-1]["kl"] > 0, ("grpo: the policy did not move from its adapters-off reference", logs)
    assert _summary(out)["method"].startswith("lora")


def test_kto_reward_and_grpo_train_every_dense_decoder_row(tmp_path):
    from test_decoder_cli import run, save_row

    assert len(DENSE_ROWS) >= 7, DENSE_ROWS
    # the keyword "e" is in some random completions and not in others: GRPO's advantages are not all 0
    prompts = tmp_path / "prompts.json"
    with open(os.path.join(LLM, "data", "grpo_tiny", "train.json"), encoding="utf-8") as src:
        rows = [{**json.loads(line), "keyword": "e"} for line in list(src)[:8]]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    jobs = {}
    for model_type in DENSE_ROWS:
        base = save_row(model_type, str(tmp_path / model_type / "base"))
        for name, train in (("kto", _kto), ("reward", _reward), ("grpo", _grpo)):
            out = str(tmp_path / model_type / name)
            extra = (prompts,) if name == "grpo" else ()
            jobs[f"{model_type} {name}"] = functools.partial(train, run, base, out, *extra)
    failures = run_jobs(jobs)
    assert not failures, json.dumps(failures, indent=1)
