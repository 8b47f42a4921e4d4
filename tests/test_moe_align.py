"""The router's load-balancing loss in preference and RL training on the decoder's MoE rows (docs/moe.md).

Fast, in-process, on the tiny transformers-saved MoE rows of ``test_decoder_parity`` (4 experts, top-2), each
loaded fresh: for DPO, KTO, reward models, GRPO and PPO on every MoE row, the training loss
of the trainer's ``compute_loss`` / ``_micro_loss`` with ``router_aux_loss_coef`` = 0.1 equals the same trainer's
loss without the aux term plus 0.1 x the aux loss computed independently: the model's whole forward
(``DecoderForCausalLM.forward``, judged against transformers' ``aux_loss`` in tests/test_moe_parity.py) over the
policy's batch with its real-token mask.  The batch has tail padding (rows of different lengths) and the aux loss
over every position differs (negative control); the policy's routers are moved away from the reference copy's,
so an aux loss of the reference forward would not match.  With coefficient 0 the aux term is absent (no
``moe_aux_log``: the loss is the mode's own, nothing logged); with coefficient 0 and a bias update rate the loss is
unchanged and the policy forward's expert counts move the correction bias.

Slow: ``llm/run_dpo.py``, ``run_kto.py``, ``run_reward.py`` and ``run_grpo.py`` with LoRA and
``router_aux_loss_coef`` 0.05 on a tiny transformers-saved mixtral: the aux loss is logged, finite and positive.
"""

import functools
import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest

from paddlenlp_ext.models.family_table import FAMILIES, feature_problem

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MOE_ROWS = [k for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp == "moe"]
COEF = 0.1


def test_alignment_is_allowed_on_every_moe_row():
    assert len(MOE_ROWS) >= 6
    for mode in ("dpo", "kto", "reward", "grpo"):
        assert all(feature_problem(k, mode) is None for k in MOE_ROWS), mode


def _policy(model_type, tmp_path_factory, coef=COEF):
    """A fresh copy of the row's tiny model (test_decoder_parity's checkpoint) in training mode, with the run's
    coefficient set as training/moe_aux.configure sets it."""
    from test_decoder_parity import build, load_ours

    _, path, _ = build(model_type, tmp_path_factory)
    model = load_ours(path, model_type)
    model.config.router_aux_loss_coef = coef
    model.config.output_router_logits = coef > 0
    model.train()
    return model


def _args(tmp_path):
    from paddlenlp.trainer import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, report_to=["none"])


def _pairs(seed=0):
    rng = np.random.default_rng(seed)

    def ids(lo, hi):
        return [int(t) for t in rng.integers(3, 120, size=int(rng.integers(lo, hi)))]

    # two short pairs (5-16 tokens) and a long one (32): the unpacked rows are tail-padded to 32, so padding is
    # about half the positions and an aux loss that counted it would be far off
    short = [{"prompt": ids(2, 6), "chosen": ids(2, 7), "rejected": ids(1, 6)} for _ in range(2)]
    return short + [{"prompt": ids(12, 13), "chosen": ids(10, 11), "rejected": ids(10, 11)}]


def _tensors(batch):
    import paddle

    return {k: paddle.to_tensor(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def _pair_batch(collator_cls=None, flash_mask=True):
    from paddlenlp_ext.dpo.pair_rows import PreferenceCollator, build_pair_row
    from paddlenlp_ext.reward.data import last_token_positions

    rows = []
    for p in _pairs():
        row = build_pair_row([p])
        row["score_index"] = last_token_positions([p])
        rows.append(row)
    batch = (collator_cls or PreferenceCollator)(pad_token_id=0, flash_mask=flash_mask)(rows)
    assert batch["real_tokens"].sum() < batch["real_tokens"].size  # tail padding in the batch
    return batch


def _independent_aux(model, batch, mask_padding=True):
    """The aux loss of the model's whole forward on ``batch`` over its real tokens (all tokens if not
    ``mask_padding``): DecoderForCausalLM.forward, the path tests/test_moe_parity.py judges against transformers."""
    import paddle

    kw = {
        k: batch[k]
        for k in ("input_ids", "position_ids", "attn_mask_startend_row_indices", "attention_mask")
        if batch.get(k) is not None
    }
    real = batch["real_tokens"] if mask_padding else paddle.ones_like(batch["real_tokens"])
    with paddle.no_grad():
        model.moe_next_forward(token_mask=real)
        out = model(**kw, output_router_logits=True, return_dict=True)
    model.moe_state = {}
    return float(out.aux_loss)


def _skew_routers(model):
    """Move the policy's router weights away from the reference copy's (scaled), so that the two forwards give
    different aux losses."""
    import paddle

    with paddle.no_grad():
        for blk in model.moe_blocks():
            for p in blk.router_parameters():
                p.set_value(p * 3.0)


def _with_and_without(trainer, model, loss_fn):
    """(loss with the aux term, the aux loss logged, loss without it) of ``loss_fn()`` on ``trainer``."""
    from paddlenlp_ext.training.moe_aux import attach_moe_log

    attach_moe_log(trainer, model, 0.0)
    log = trainer.moe_aux_log
    assert log is not None and log.coef == COEF
    with_aux = loss_fn()
    log.fill(logs := {"loss": 0.0}, 1)
    trainer.moe_aux_log = None  # the same trainer, model and batch without the aux term
    without = loss_fn()
    return with_aux, logs.get("aux_loss"), without


def _check(model, batch, with_aux, logged, without):
    aux = _independent_aux(model, batch)
    assert aux > 0 and abs(logged - aux) < 1e-5, (logged, aux)
    assert abs(float(with_aux) - (float(without) + COEF * aux)) < 1e-5, (float(with_aux), float(without), aux)
    # negative control: over every position (padding included) the aux loss is another number
    assert abs(_independent_aux(model, batch, mask_padding=False) - aux) > 1e-4
    return aux


@pytest.mark.parametrize("model_type", MOE_ROWS)
def test_dpo_loss_is_the_preference_loss_plus_coef_times_the_policy_aux(model_type, tmp_path, tmp_path_factory):
    import paddle

    from paddlenlp_ext.config.schema import DPOArgument
    from paddlenlp_ext.dpo.trainer import DPOTrainer

    model = _policy(model_type, tmp_path_factory)
    trainer = DPOTrainer(model=model, args=_args(tmp_path), dpo_config=DPOArgument(sft_loss_ratio=0.5))
    assert trainer.reference == "copy"
    _skew_routers(model)  # the reference copy keeps the checkpoint's routers
    batch = _tensors(_pair_batch())
    with_aux, logged, without = _with_and_without(trainer, model, lambda: trainer.compute_loss(model, dict(batch)))
    _check(model, batch, with_aux, logged, without)
    # the aux term's gradient reaches the routers (it is part of the loss, not only a logged number)
    router = model.moe_blocks()[0].router_parameters()[0]
    (with_aux - without).backward()
    assert float(paddle.abs(router.grad).sum()) > 0


@pytest.mark.parametrize("model_type", MOE_ROWS)
def test_kto_and_reward_losses_add_coef_times_the_policy_aux(model_type, tmp_path, tmp_path_factory):
    import paddle

    from paddlenlp_ext.config.schema import KTOArgument, RewardArgument
    from paddlenlp_ext.kto.trainer import KTOTrainer
    from paddlenlp_ext.reward.data import RewardCollator
    from paddlenlp_ext.reward.head import attach_score_head
    from paddlenlp_ext.reward.trainer import RewardTrainer

    model = _policy(model_type, tmp_path_factory)
    kto = KTOTrainer(model=model, args=_args(tmp_path), kto_config=KTOArgument())
    _skew_routers(model)
    batch = _tensors(_pair_batch())
    labels = paddle.to_tensor(np.array([1, 0, 1], dtype=np.int64))
    _check(model, batch, *_with_and_without(kto, model, lambda: kto.compute_loss(model, dict(batch, kto_label=labels))))

    # the reward model: the score head on the MoE body keeps the body's router aux loss
    model = _policy(model_type, tmp_path_factory)
    paddle.seed(0)
    attach_score_head(model)
    reward = RewardTrainer(model=model, args=_args(tmp_path), reward_config=RewardArgument())
    batch = _tensors(_pair_batch(RewardCollator, flash_mask=False))  # the dense 4-D mask this time
    _check(model, batch, *_with_and_without(reward, model, lambda: reward.compute_loss(model, dict(batch))))


def _rollout_micro(trainer, model):
    """One GRPO micro-batch: 2 prompts x G=2 completions of different lengths (tail-padded rows), the reference's
    log-probs from the trainer's own reference forward."""
    from paddlenlp_ext.grpo.rollout import MicroRollout, Rollout

    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    completions = [[11, 12, 13, 2], [14, 2], [15, 16, 17, 18, 19], [20, 21, 2]]
    batch = trainer._row_batch(prompts, completions)
    m = MicroRollout(
        indices=[0, 1],
        completions=completions,
        rewards=np.array([1.0, 0.0, 0.5, 0.0]),
        per_func={},
        advantages=np.array([1.0, -1.0, 0.7, -0.7], dtype=np.float32),
        batch=batch,
    )
    m.ref_logps = trainer._reference_token_logps(model, batch)
    trainer._rollout = Rollout(
        step=0, micro=[m], global_tokens=int(batch["logp_token"].shape[0]), global_sequences=len(completions)
    )
    return m


@pytest.mark.parametrize("model_type", MOE_ROWS)
def test_grpo_and_ppo_losses_add_coef_times_the_policy_aux(model_type, tmp_path, tmp_path_factory):
    import paddle

    from paddlenlp_ext.config.schema import GRPOArgument, PPOArgument
    from paddlenlp_ext.grpo.trainer import GRPOTrainer
    from paddlenlp_ext.ppo.trainer import PPOTrainer

    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    rewards = SimpleNamespace(names=["r"])
    for cls, config in ((GRPOTrainer, GRPOArgument(num_generations=2)), (PPOTrainer, PPOArgument())):
        model = _policy(model_type, tmp_path_factory)
        trainer = cls(
            model=model,
            args=_args(tmp_path),
            tokenizer=tokenizer,
            grpo_config=config,
            rewards=rewards,
            flash_mask=True,
            packed=False,
        )
        assert trainer.reference == "copy"
        _skew_routers(model)
        m = _rollout_micro(trainer, model)
        if cls is PPOTrainer:
            t = int(m.batch["logp_token"].shape[0])
            m.old_logps, m.old_values = m.ref_logps, paddle.zeros([t])
            m.token_advantages, m.returns = paddle.linspace(-1.0, 1.0, t), paddle.ones([t])
        _check(model, m.batch, *_with_and_without(trainer, model, lambda: trainer._micro_loss(model, m)[0]))


def test_coef_zero_has_no_aux_term_and_the_bias_update_reads_the_policy_forward(tmp_path, tmp_path_factory):
    from paddlenlp_ext.config.schema import DPOArgument
    from paddlenlp_ext.dpo.trainer import DPOTrainer
    from paddlenlp_ext.training.moe_aux import attach_moe_log

    model = _policy("deepseek_v3", tmp_path_factory, coef=0.0)
    trainer = DPOTrainer(model=model, args=_args(tmp_path), dpo_config=DPOArgument())
    batch = _tensors(_pair_batch())
    attach_moe_log(trainer, model, 0.0)
    assert trainer.moe_aux_log is None  # coefficient 0, no bias update: nothing to add, nothing logged
    plain = float(trainer.compute_loss(model, dict(batch)))
    # coefficient 0 with DeepSeek-V3's bias update: the loss is the DPO loss alone; the counts move the bias
    attach_moe_log(trainer, model, 0.01)
    log = trainer.moe_aux_log
    assert log is not None and log.coef == 0.0
    assert float(trainer.compute_loss(model, dict(batch))) == plain
    log.fill(logs := {"loss": plain}, 1)
    assert "aux_loss" not in logs and logs["expert_load_max_over_mean"] >= 1.0
    blk = model.moe_blocks()[0]
    before = blk.correction_bias.numpy().copy()
    trainer.compute_loss(model, dict(batch))  # the step's forward (the logged one above was taken by fill)
    update = [c for c in trainer.callback_handler.callbacks if type(c).__name__ == "MoEBiasUpdate"]
    assert len(update) == 1
    update[0].on_step_end(trainer.args, trainer.state, trainer.control)
    moved = blk.correction_bias.numpy() - before
    assert np.abs(moved).max() == pytest.approx(0.01) and log.bias_updates == 1
    # the reference copy's bias is not the policy's: it keeps the checkpoint's
    ref_blk = trainer.ref_model.moe_blocks()[0]
    assert np.array_equal(ref_blk.correction_bias.numpy(), before)


# -- slow: the four CLIs on a tiny MoE row with LoRA and the aux loss ------------------------------------------------


def _logs(out, key):
    with open(os.path.join(out, "trainer_state.json")) as f:
        return [h for h in json.load(f)["log_history"] if key in h and "step" in h]


@pytest.mark.slow
def test_the_four_alignment_clis_train_an_moe_row_with_lora_and_the_aux_loss(tmp_path):
    from conftest import ROOT, run_jobs
    from test_decoder_cli import run, save_row

    llm, tiny = os.path.join(ROOT, "llm"), os.path.join(ROOT, "llm", "config", "tiny")
    base = save_row("mixtral", str(tmp_path / "base"))
    common = [
        "--model_name_or_path",
        base,
        "--router_aux_loss_coef",
        "0.05",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
    ]
    pref = [
        "--max_seq_len",
        "256",
        "--max_prompt_len",
        "128",
        "--do_eval",
        "false",
        "--warmup_steps",
        "0",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
    ]
    runs = {
        "dpo": [os.path.join(llm, "run_dpo.py"), os.path.join(tiny, "dpo_lora_argument.json"), *pref],
        "kto": [os.path.join(llm, "run_kto.py"), os.path.join(tiny, "kto_lora_argument.json"), *pref],
        "reward": [os.path.join(llm, "run_reward.py"), os.path.join(tiny, "reward_lora_argument.json"), *pref],
        "grpo": [
            os.path.join(llm, "run_grpo.py"),
            os.path.join(tiny, "grpo_argument.json"),
            "--lora",
            "true",
            "--max_steps",
            "2",
            "--num_generations",
            "2",
            "--max_completion_length",
            "4",
        ],
    }

    def one(mode, cmd):
        out = str(tmp_path / mode)
        r = run([*cmd, *common, "--output_dir", out])
        logs = _logs(out, "loss")
        assert logs and all(math.isfinite(h["loss"]) for h in logs), (mode, logs)
        assert all(math.isfinite(h["aux_loss"]) and h["aux_loss"] > 0 for h in logs), (mode, logs)
        assert all(h["expert_load_max_over_mean"] >= 1.0 for h in logs), (mode, logs)
        with open(os.path.join(out, "run_summary.json")) as f:
            summary = json.load(f)
        assert summary["method"] == "lora" and summary["moe"]["router_aux_loss_coef"] == 0.05, (mode, summary)
        assert "aux loss" in r.stdout, (mode, r.stdout[-1500:])

    failures = run_jobs({mode: functools.partial(one, mode, cmd) for mode, cmd in runs.items()})
    assert not failures, json.dumps(failures, indent=1)
