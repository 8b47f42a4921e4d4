"""Reward models on the tiny model: the pairwise loss, packed == unpacked, saving and scoring, config."""

import contextlib
import doctest
import importlib
import math
import os

import numpy as np
import pytest

from conftest import ROOT

REWARD_TINY = os.path.join(ROOT, "llm", "data", "reward_tiny")
LORA_CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "reward_lora_argument.json")


@pytest.fixture(scope="module")
def reward_pairs(tiny_tokenizer):
    from paddlenlp_ext.dpo.data import read_preference_files, tokenize_preference_examples

    examples = read_preference_files([os.path.join(REWARD_TINY, "dev.json")])[:6]
    pairs, _ = tokenize_preference_examples(examples, tiny_tokenizer, 256, 128, use_chat_template=False)
    return examples, pairs


def reward_model(tiny_model_dir, flash=False, seed=0):
    import paddle
    from paddlenlp.transformers import AutoConfig, AutoModelForCausalLM

    from paddlenlp_ext.reward.head import attach_score_head

    from paddlenlp_ext.models.loading import decoder_class_for

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.use_flash_attention = flash
    cls, config = decoder_class_for(config)  # llama trains on our decoder (what run_reward and the scorer build)
    model = (cls or AutoModelForCausalLM).from_pretrained(tiny_model_dir, config=config)
    paddle.seed(seed)
    attach_score_head(model)
    return model


def forward(model, batch, flash):
    """(losses [N], chosen [N], rejected [N]) of one collated reward batch."""
    import paddle

    from paddlenlp_ext.reward.head import pairwise_loss, sequence_scores

    key = "attn_mask_startend_row_indices" if flash else "attention_mask"
    inputs = {k: paddle.to_tensor(batch[k]) for k in ("input_ids", "position_ids", key)}
    scores = sequence_scores(model, inputs, paddle.to_tensor(batch["score_index"])).reshape([-1, 2])  # [N, 2]
    return pairwise_loss(scores[:, 0], scores[:, 1]), scores[:, 0], scores[:, 1]


def collate(pairs, packing, flash, pad):
    from paddlenlp_ext.reward.data import RewardCollator, RewardDataset

    ds = RewardDataset(pairs, 256, packing, pad, shuffle=False)
    return RewardCollator(pad, flash, 256 if packing else None)([ds[i] for i in range(len(ds))])


def test_doctests():
    """The worked examples in the data transforms' docstrings."""
    for name in ("data", "head", "score_file"):
        module = importlib.import_module(f"paddlenlp_ext.reward.{name}")
        assert doctest.testmod(module).attempted > 0 and doctest.testmod(module).failed == 0, name


def test_loss_at_equal_scores_is_ln2(tiny_model_dir, reward_pairs, tiny_tokenizer):
    """Identical chosen and rejected answers get identical scores through the real model: loss = ln 2."""
    _, pairs = reward_pairs
    same = [dict(p, rejected=list(p["chosen"])) for p in pairs]
    model = reward_model(tiny_model_dir)
    model.eval()
    losses, chosen, rejected = forward(model, collate(same, "in_order", False, tiny_tokenizer.pad_token_id), False)
    np.testing.assert_allclose(chosen.numpy(), rejected.numpy(), atol=1e-5)
    assert abs(float(losses.mean()) - math.log(2.0)) < 1e-5


def test_loss_and_gradient_match_numpy():
    import paddle

    from paddlenlp_ext.reward.head import pair_score_metrics, pairwise_loss

    rng = np.random.default_rng(0)
    c, r = rng.normal(size=16).astype("float32") * 3, rng.normal(size=16).astype("float32") * 3
    tc, tr = paddle.to_tensor(c, stop_gradient=False), paddle.to_tensor(r, stop_gradient=False)
    loss = pairwise_loss(tc, tr).mean()
    loss.backward()
    d = (c - r).astype("float64")
    ref = np.mean(np.log1p(np.exp(-d)))
    grad_c = -1.0 / (1.0 + np.exp(d)) / len(d)  # d/dc of -log sigmoid(c - r), over the mean
    assert abs(float(loss) - ref) < 1e-6
    np.testing.assert_allclose(tc.grad.numpy(), grad_c, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(tr.grad.numpy(), -grad_c, rtol=1e-5, atol=1e-7)
    m = pair_score_metrics(tc, tr)
    assert np.mean(m["rewards/accuracies"]) == pytest.approx(float(np.mean(d > 0)))
    np.testing.assert_allclose(m["rewards/margins"], d, rtol=1e-5)


@pytest.mark.parametrize("attention", ["flashmask", "dense"])
def test_packed_equals_unpacked(tiny_model_dir, reward_pairs, tiny_tokenizer, attention):
    """Scores, loss and gradients (score head, a decoder weight) of packed rows == one pair per row."""
    from paddlenlp_ext.integrations.flashmask import cpu_flashmask

    _, pairs = reward_pairs
    flash = attention == "flashmask"
    pad = tiny_tokenizer.pad_token_id
    results = []
    with cpu_flashmask() if flash else contextlib.nullcontext():
        for packing in ("in_order", None):
            model = reward_model(tiny_model_dir, flash)
            batch = collate(pairs, packing, flash, pad)
            if packing:
                assert batch["input_ids"].shape[0] < len(pairs)  # several pairs share a row
            losses, chosen, rejected = forward(model, batch, flash)
            loss = losses.mean()
            loss.backward()
            q = model.llama.layers[0].self_attn.q_proj.weight
            results.append(
                (float(loss), chosen.numpy(), rejected.numpy(), model.score_head.weight.grad.numpy(), q.grad.numpy())
            )
    (la, ca, ra, ha, qa), (lb, cb, rb, hb, qb) = results
    assert abs(la - lb) < 1e-5
    np.testing.assert_allclose(ca, cb, atol=1e-5)
    np.testing.assert_allclose(ra, rb, atol=1e-5)
    np.testing.assert_allclose(ha, hb, atol=1e-5)
    np.testing.assert_allclose(qa, qb, atol=1e-5)
    assert np.abs(ha).max() > 1e-4 and np.abs(qa).max() > 1e-8  # the gradients are not trivially zero


@pytest.mark.parametrize("method", ["lora", "full"])
def test_scorer_round_trip(tiny_model_dir, reward_pairs, tiny_tokenizer, tmp_path, method):
    """Train a few steps -> save as the trainer does -> RewardScorer -> the training path's scores."""
    import paddle

    from paddlenlp_ext.adapters import AdapterConfig, apply_adapters
    from paddlenlp_ext.reward.io import RewardCheckpointIO
    from paddlenlp_ext.reward.scorer import RewardScorer

    examples, pairs = reward_pairs
    model = reward_model(tiny_model_dir)
    adapter_config = None
    if method == "lora":
        adapter_config = AdapterConfig(method="lora", r=4, alpha=8, base_model_name_or_path=tiny_model_dir)
        apply_adapters(model, adapter_config)
        model.score_head.weight.stop_gradient = False  # apply_adapters froze everything; the head trains
    params = [p for p in model.parameters() if not p.stop_gradient]
    opt = paddle.optimizer.Adam(learning_rate=1e-2, parameters=params)
    batch = collate(pairs, None, False, tiny_tokenizer.pad_token_id)
    for _ in range(3):
        loss = forward(model, batch, False)[0].mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
    model.eval()
    with paddle.no_grad():
        _, chosen, rejected = forward(model, batch, False)
    out = tmp_path / method
    tiny_tokenizer.save_pretrained(str(out))
    info = {
        "base_model_name_or_path": tiny_model_dir,
        "chat_template": False,
        "chat_template_file": None,
        "max_seq_len": 256,
        "max_prompt_len": 128,
    }
    RewardCheckpointIO(adapter_config, info).save(model, str(out))
    assert (out / "score_head.safetensors").exists() and (out / "reward_config.json").exists()
    scorer = RewardScorer.from_pretrained(str(out))
    ids = [p["prompt"] + p["chosen"] for p in pairs] + [p["prompt"] + p["rejected"] for p in pairs]
    got = scorer.score_ids(ids)
    np.testing.assert_allclose(got, np.concatenate([chosen.numpy(), rejected.numpy()]), atol=1e-5)
    assert np.abs(chosen.numpy() - rejected.numpy()).max() > 1e-3  # the trained head tells them apart
    # score_texts renders prompt + answer exactly as training did
    texts = scorer.score_texts([ex.src[-1] for ex in examples], [ex.chosen for ex in examples])
    # another batch (chosen answers only: other padding, other row lengths): the same scores within float rounding
    np.testing.assert_allclose(texts, got[: len(pairs)], rtol=1e-5, atol=1e-6)
    assert got.dtype == np.float32 and got.shape == (2 * len(pairs),)


def test_merged_reward_adapter_scores_as_the_adapter(tiny_model_dir, reward_pairs, tmp_path):
    import paddle

    from paddlenlp_ext.adapters import AdapterConfig, apply_adapters, iter_adapter_layers
    from paddlenlp_ext.merge import merge_adapter_checkpoint
    from paddlenlp_ext.models.tokenizer import load_tokenizer
    from paddlenlp_ext.reward.io import RewardCheckpointIO
    from paddlenlp_ext.reward.scorer import RewardScorer

    _, pairs = reward_pairs
    model = reward_model(tiny_model_dir)
    cfg = AdapterConfig(method="lora", r=4, alpha=8, base_model_name_or_path=tiny_model_dir)
    apply_adapters(model, cfg)
    paddle.seed(1)
    for _, layer in iter_adapter_layers(model):
        layer.lora_B.set_value(paddle.randn(layer.lora_B.shape) * 0.05)
    adapter = tmp_path / "adapter"
    load_tokenizer(tiny_model_dir).save_pretrained(str(adapter))
    RewardCheckpointIO(
        cfg,
        {
            "base_model_name_or_path": tiny_model_dir,
            "chat_template": False,
            "chat_template_file": None,
            "max_seq_len": 256,
            "max_prompt_len": 128,
        },
    ).save(model, str(adapter))
    merged = tmp_path / "merged"
    merge_adapter_checkpoint(tiny_model_dir, str(adapter), str(merged), verify=False)
    ids = [p["prompt"] + p["chosen"] for p in pairs]
    a = RewardScorer.from_pretrained(str(adapter)).score_ids(ids)
    b = RewardScorer.from_pretrained(str(merged)).score_ids(ids)
    np.testing.assert_allclose(a, b, atol=1e-4)
    assert not RewardScorer.from_pretrained(str(merged)).info["adapter"]


def test_score_index_marks_each_answers_last_token(reward_pairs, tiny_tokenizer):
    _, pairs = reward_pairs
    eos = tiny_tokenizer.eos_token_id
    for packing in ("in_order", None):
        batch = collate(pairs, packing, True, tiny_tokenizer.pad_token_id)
        flat = batch["input_ids"].reshape([-1])
        assert len(batch["score_index"]) == 2 * len(pairs)
        assert (flat[batch["score_index"]] == eos).all()  # untruncated answers end with eos


def test_reward_config_mode(tmp_path, tiny_model_dir):
    from paddlenlp_ext.config.parse import ConfigError, load_config

    base = ["--output_dir", str(tmp_path / "o"), "--model_name_or_path", tiny_model_dir]
    cfg = load_config(LORA_CONFIG, base, mode="reward")
    assert cfg.alignment.loss_type == "reward" and cfg.data.zero_padding and cfg.model.lora
    with pytest.raises(ConfigError) as e:
        load_config(
            LORA_CONFIG,
            base
            + [
                "--beta",
                "0.2",
                "--lazy",
                "true",
                "--max_length",
                "64",
                "--metric_for_best_model",
                "kl",
                "--neftune",
                "true",
            ],
            mode="reward",
        )
    msg = e.value.report()
    assert "'beta' is a DPO (llm/run_dpo.py) key; REWARD does not use it" in msg
    assert "lazy=true is not supported for reward models" in msg
    assert "'max_length' is a fine-tuning" in msg and "use max_seq_len instead" in msg
    assert "metric_for_best_model 'kl' is not a reward eval metric" in msg
    assert "neftune=true is not supported for reward" in msg


def test_family_without_a_decoder_body_is_refused(tmp_path, tiny_model_dir):
    import json
    import shutil

    from paddlenlp_ext.config.parse import ConfigError, load_config

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "gpt"
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        load_config(
            LORA_CONFIG, ["--output_dir", str(tmp_path / "o"), "--model_name_or_path", str(model)], mode="reward"
        )
    assert "model_type 'gpt' cannot take a reward head here" in e.value.report()


#: the keys of PaddleNLP's llm/config/llama/rm_flashmask_argument.json (values for the tiny model)
PADDLENLP_RM_CONFIG = {
    "train_dataset_path": REWARD_TINY,
    "dev_dataset_path": REWARD_TINY,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 8,
    "per_device_eval_batch_size": 1,
    "num_train_epochs": 1,
    "max_steps": 100,
    "learning_rate": 1e-06,
    "warmup_steps": 10,
    "logging_steps": 1,
    "evaluation_strategy": "steps",
    "save_strategy": "steps",
    "eval_steps": 100,
    "save_steps": 500,
    "max_seq_len": 4096,
    "max_prompt_len": 2048,
    "bf16": False,
    "fp16_opt_level": "O2",
    "do_train": True,
    "do_eval": True,
    "disable_tqdm": True,
    "load_best_model_at_end": True,
    "tensor_parallel_degree": 1,
    "sharding_parallel_degree": 1,
    "sharding": "stage1",
    "use_flash_attention": True,
    "flash_mask": True,
    "recompute": False,
    "recompute_granularity": "full",
    "benchmark": False,
    "unified_checkpoint": True,
    "autotuner_benchmark": False,
}


def test_paddlenlp_rm_config_keys_are_accepted(tmp_path, tiny_model_dir):
    import json

    from paddlenlp_ext.config.parse import ConfigError, load_config

    path = tmp_path / "rm_flashmask_argument.json"
    path.write_text(
        json.dumps(dict(PADDLENLP_RM_CONFIG, model_name_or_path=tiny_model_dir, output_dir=str(tmp_path / "o")))
    )
    cfg = load_config(str(path), mode="reward")
    assert cfg.alignment.max_seq_len == 4096 and cfg.model.flash_mask and cfg.data.zero_padding
    with pytest.raises(ConfigError) as e:  # PaddleNLP's value: 8-way tensor parallel
        load_config(str(path), ["--tensor_parallel_degree", "8"], mode="reward")
    assert "tensor_parallel_degree > 1 is not supported for reward" in e.value.report()
