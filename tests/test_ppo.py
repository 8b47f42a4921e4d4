"""PPO's math (paddlenlp_ext.ppo.objective) against a numpy reference written the other way round (padded
[B, L] arrays and a backward loop per row, as TRL's PPOTrainer lays them out), and whitening against
TRL's own ``masked_whiten``."""

import doctest

import numpy as np
import pytest


def test_doctests():
    from paddlenlp_ext.ppo import objective

    assert doctest.testmod(objective).failed == 0


def padded_case(seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.array([4, 1, 6, 3])
    B, L = len(lengths), int(lengths.max())
    mask = np.arange(L)[None] < lengths[:, None]  # [B, L]
    logps = rng.normal(-2, 1, (B, L))
    ref = logps + rng.normal(0, 0.3, (B, L))
    values = rng.normal(0, 1, (B, L))
    scores = rng.normal(0, 3, B)
    return lengths, mask, logps, ref, values, scores


def reference_gae(lengths, mask, logps, ref, values, scores, kl_coeff, clip_score, gamma, lam):
    """Padded rows, TRL's loop: rewards with the score at each row's last token, GAE backwards over the row."""
    B, L = mask.shape
    rewards = np.where(mask, -kl_coeff * (logps - ref), 0.0)
    rewards[np.arange(B), lengths - 1] += np.clip(scores, -clip_score, clip_score)
    v = np.where(mask, values, 0.0)
    adv = np.zeros((B, L))
    last = np.zeros(B)
    for t in reversed(range(L)):
        nextv = v[:, t + 1] if t < L - 1 else 0.0
        delta = rewards[:, t] + gamma * nextv - v[:, t]
        last = delta + gamma * lam * last
        adv[:, t] = last
    returns = adv + v
    return rewards, adv, returns


@pytest.mark.parametrize("gamma,lam,kl,clip_score", [(1.0, 0.95, 0.1, 50.0), (0.9, 0.5, 0.0, 1.0)])
def test_rewards_and_gae_match_reference(gamma, lam, kl, clip_score):
    from paddlenlp_ext.ppo.objective import gae, token_rewards, whiten

    lengths, mask, logps, ref, values, scores = padded_case()
    seg = np.repeat(np.arange(len(lengths)), lengths)
    r = token_rewards(logps[mask], ref[mask], scores, seg, kl, clip_score)
    adv, ret = gae(r, values[mask], seg, gamma, lam)
    r_ref, adv_ref, ret_ref = reference_gae(lengths, mask, logps, ref, values, scores, kl, clip_score, gamma, lam)
    np.testing.assert_allclose(r, r_ref[mask], atol=1e-12)
    np.testing.assert_allclose(adv, adv_ref[mask], atol=1e-12)
    np.testing.assert_allclose(ret, ret_ref[mask], atol=1e-12)
    w = whiten(adv)
    assert abs(w.mean()) < 1e-9 and abs(w.std(ddof=1) - 1) < 1e-6


def test_whiten_matches_trl():
    torch = pytest.importorskip("torch")
    core = pytest.importorskip("trl.core")
    from paddlenlp_ext.ppo.objective import whiten

    lengths, mask, _, _, values, _ = padded_case(1)
    t = torch.from_numpy(values)
    m = torch.from_numpy(mask)
    for shift in (True, False):
        theirs = core.masked_whiten(t, m, shift_mean=shift).numpy()[mask]
        np.testing.assert_allclose(whiten(values[mask], shift_mean=shift), theirs, atol=1e-9)


def test_policy_and_value_losses_match_reference():
    import paddle

    from paddlenlp_ext.ppo.objective import policy_loss, value_loss

    rng = np.random.default_rng(2)
    T, eps, vclip = 40, 0.2, 0.3
    old = rng.normal(-2, 1, T)
    new = old + rng.normal(0, 0.3, T)
    adv = rng.normal(0, 1, T)
    old_v, ret = rng.normal(0, 1, T), rng.normal(0, 1, T)
    new_v = old_v + rng.normal(0, 0.5, T)
    ratio = np.exp(new - old)
    pg1, pg2 = -adv * ratio, -adv * np.clip(ratio, 1 - eps, 1 + eps)
    want_pg = np.maximum(pg1, pg2).mean()
    # d/dnew of max(pg1, pg2): the unclipped branch's -A ratio where it is the max and not clipped, else 0
    active = pg1 >= pg2
    want_grad = np.where(active, -adv * ratio, 0.0) / T
    vc = np.clip(new_v, old_v - vclip, old_v + vclip)
    v1, v2 = (new_v - ret) ** 2, (vc - ret) ** 2
    want_v = 0.5 * np.maximum(v1, v2).mean()
    want_vgrad = np.where(v1 >= v2, new_v - ret, np.where(np.abs(new_v - old_v) < vclip, vc - ret, 0.0)) / T

    t = lambda x: paddle.to_tensor(x)  # noqa: E731  (float64)
    lp = t(new)
    lp.stop_gradient = False
    loss, clipped = policy_loss(lp, t(old), t(adv), eps)
    loss.backward()
    assert abs(float(loss) - want_pg) < 1e-12
    np.testing.assert_allclose(lp.grad.numpy(), want_grad, atol=1e-12)
    assert clipped.numpy().tolist() == (pg2 > pg1).tolist() and 0 < clipped.numpy().sum() < T
    v = t(new_v)
    v.stop_gradient = False
    vloss, vclipped = value_loss(v, t(old_v), t(ret), vclip)
    vloss.backward()
    assert abs(float(vloss) - want_v) < 1e-12
    np.testing.assert_allclose(v.grad.numpy(), want_vgrad, atol=1e-12)
    assert 0 < vclipped.numpy().sum() < T


def test_config_mode(tiny_model_dir, tmp_path):
    from conftest import ROOT

    from paddlenlp_ext.config.parse import ConfigError, load_config

    base = [
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        str(tmp_path / "o"),
        "--train_dataset_path",
        f"{ROOT}/llm/data/grpo_tiny",
    ]
    cfg = load_config(f"{ROOT}/llm/config/tiny/ppo_argument.json", base + ["--num_generations", "1"], mode="ppo")
    o = cfg.alignment
    assert (o.mode, o.loss_type, o.num_generations, o.beta, o.epsilon) == ("ppo", "ppo", 1, 0.02, 0.2)
    with pytest.raises(ConfigError) as e:
        load_config(
            None,
            base
            + [
                "--reward_funcs",
                '["paddlenlp_ext.grpo.rewards:contains_keyword"]',
                "--do_train",
                "true",
                "--scale_rewards",
                "group",
                "--gae_lambda",
                "-1",
                "--do_eval",
                "true",
            ],
            mode="ppo",
        )
    text = "\n".join(e.value.problems)
    for want in ("unknown key 'scale_rewards'", "gae_lambda: must be >= 0.0", "PPO has no evaluation set"):
        assert want in text, (want, text)


def test_data_parallel_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    from conftest import ROOT

    from paddlenlp_ext.config.parse import ConfigError, load_config

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    with pytest.raises(ConfigError) as e:
        load_config(
            f"{ROOT}/llm/config/tiny/ppo_argument.json",
            [
                "--model_name_or_path",
                tiny_model_dir,
                "--output_dir",
                str(tmp_path / "o"),
                "--train_dataset_path",
                f"{ROOT}/llm/data/grpo_tiny",
            ],
            mode="ppo",
        )
    assert "PPO runs on one process for now" in "\n".join(e.value.problems)
