"""KTO: the loss against a numpy reference and the paper's closed form at init, packed == unpacked
(loss and gradients), data validation with file:line, and the config mode (no CLI: see test_kto_e2e.py)."""

import contextlib
import doctest
import json
import os

import numpy as np
import pytest

from conftest import ROOT

KTO_TINY = os.path.join(ROOT, "llm", "data", "kto_tiny", "train.json")


def test_doctests():
    from paddlenlp_ext.kto import data, losses

    for module in (data, losses):
        assert doctest.testmod(module).failed == 0


def numpy_kto(logps, ref, kl_logps, ref_kl, labels, beta, wd, wu):
    """The KTO paper's loss written out in numpy (float64)."""
    z0 = max(0.0, float(np.mean(kl_logps - ref_kl)))
    r = logps - ref
    sig = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    per = np.where(labels == 1, wd * (1 - sig(beta * (r - z0))), wu * (1 - sig(beta * (z0 - r))))
    return per, z0


@pytest.mark.parametrize("seed,kl_shift", [(0, 3.0), (1, -3.0), (2, 0.5)])
def test_loss_matches_numpy_reference(seed, kl_shift):
    import paddle

    from paddlenlp_ext.kto.losses import kl_reference_point, kto_loss, kto_metrics

    rng = np.random.default_rng(seed)
    n = 11
    logps, ref = rng.normal(-40, 10, n), rng.normal(-40, 10, n)
    kl_logps = rng.normal(-50, 5, n)
    ref_kl = kl_logps - kl_shift + rng.normal(0, 1, n)  # kl_shift < 0: z0 is clamped at 0
    labels = rng.integers(0, 2, n)
    labels[:2] = [0, 1]
    t = lambda a: paddle.to_tensor(a, dtype="float32")  # noqa: E731
    z0 = kl_reference_point(t(kl_logps), t(ref_kl))
    per, rewards = kto_loss(
        t(logps), t(ref), paddle.to_tensor(labels), z0, beta=0.3, desirable_weight=1.33, undesirable_weight=0.7
    )
    want, want_z0 = numpy_kto(logps, ref, kl_logps, ref_kl, labels, 0.3, 1.33, 0.7)
    assert abs(float(z0) - want_z0) < 1e-5 and (want_z0 == 0.0) == (kl_shift < 0)
    np.testing.assert_allclose(per.numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rewards.numpy(), 0.3 * (logps - ref), rtol=1e-5, atol=1e-4)
    m = kto_metrics(per, rewards, t(logps), paddle.to_tensor(labels), z0)
    d = labels == 1
    assert abs(m["loss/chosen"] - want[d].mean()) < 1e-5 and abs(m["loss/rejected"] - want[~d].mean()) < 1e-5
    assert abs(m["rewards/chosen"] - 0.3 * (logps - ref)[d].mean()) < 1e-3
    assert m["count/chosen"] == d.sum() and abs(m["kl"] - want_z0) < 1e-5


@pytest.fixture(scope="module")
def kto_pairs(tiny_tokenizer):
    from paddlenlp_ext.dpo.data import tokenize_preference_examples
    from paddlenlp_ext.kto.data import mismatched_pairs, read_kto_files

    examples = mismatched_pairs(read_kto_files([KTO_TINY])[:12])
    pairs, _ = tokenize_preference_examples(examples, tiny_tokenizer, 256, 128, use_chat_template=False)
    for pair, ex in zip(pairs, examples):
        pair["label"] = ex.label
    assert {p["label"] for p in pairs} == {True, False}
    return pairs


def model_for(tiny_model_dir, flash):
    from paddlenlp.transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.use_flash_attention = flash
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config)


def kto_forward(model, batch, flash, ref=None, beta=0.1, wd=1.0, wu=2.0):
    """(loss, logps, z0) of one collated KTO batch; ``ref``: (ref logps, ref KL logps) or None = policy (no grad)."""
    import paddle

    from paddlenlp_ext.dpo.logps import pair_logps, scored_logits
    from paddlenlp_ext.kto.losses import kl_reference_point, kto_loss

    key = "attn_mask_startend_row_indices" if flash else "attention_mask"
    inputs = {k: paddle.to_tensor(batch[k]) for k in ("input_ids", "position_ids", key)}
    logits, index = scored_logits(model, inputs, paddle.to_tensor(batch["logp_index"]))
    logps, kl_logps, _, _ = pair_logps(
        logits,
        index,
        paddle.to_tensor(batch["logp_token"]),
        paddle.to_tensor(batch["logp_segment"]),
        int(batch["num_pairs"]),
    )
    if ref is None:
        ref = (logps.detach(), kl_logps.detach())
    z0 = kl_reference_point(kl_logps, ref[1])
    losses, _ = kto_loss(
        logps, ref[0], paddle.to_tensor(batch["kto_label"]), z0, beta=beta, desirable_weight=wd, undesirable_weight=wu
    )
    return losses.mean(), logps, kl_logps, z0


def test_loss_at_init_is_the_papers_closed_form(tiny_model_dir, kto_pairs, tiny_tokenizer):
    """policy == reference: r = 0 and z0 = max(0, 0) = 0, so each example's loss is w * (1 - sigmoid(0)) = w / 2."""
    import paddle

    from paddlenlp_ext.kto.data import KTOCollator, KTODataset

    model = model_for(tiny_model_dir, False)
    model.eval()
    ds = KTODataset(kto_pairs, 256, "in_order", tiny_tokenizer.pad_token_id, shuffle=False)
    batch = KTOCollator(tiny_tokenizer.pad_token_id, False, 256)([ds[i] for i in range(len(ds))])
    with paddle.no_grad():
        loss, _, _, z0 = kto_forward(model, batch, False, wd=1.33, wu=0.7)
    labels = np.asarray([p["label"] for p in kto_pairs])
    want = float(np.mean(np.where(labels, 0.5 * 1.33, 0.5 * 0.7)))
    assert float(z0) == 0.0
    assert abs(float(loss) - want) < 1e-6, (float(loss), want)


@pytest.mark.parametrize("attention", ["eager_dense_mask", "flash_mask"])
def test_packed_equals_unpacked_loss_and_gradients(tiny_model_dir, kto_pairs, tiny_tokenizer, attention):
    import paddle

    from paddlenlp_ext.integrations.flashmask import cpu_flashmask
    from paddlenlp_ext.kto.data import KTOCollator, KTODataset

    flash = attention == "flash_mask"
    model = model_for(tiny_model_dir, flash)
    model.eval()
    pad = tiny_tokenizer.pad_token_id
    rng = np.random.default_rng(0)
    n = len(kto_pairs)
    # a reference that differs from the policy, the same numbers for both layouts (pairs stay in data order)
    results = []
    with cpu_flashmask() if flash else contextlib.nullcontext():
        for packing in (None, "in_order"):
            ds = KTODataset(kto_pairs, 640, packing, pad, shuffle=False)
            rows = [ds[i] for i in range(len(ds))]
            batch = KTOCollator(pad, flash, 640 if packing else None)(rows)
            assert [j for pack in ds.packs for j in pack] == list(range(n))
            with paddle.no_grad():
                _, logps, kl_logps, _ = kto_forward(model, batch, flash)
            ref = (
                logps + paddle.to_tensor(rng.normal(0, 2, n), dtype="float32") if packing is None else results[0][3][0],
                kl_logps - 1.0 if packing is None else results[0][3][1],
            )
            model.clear_gradients()
            loss, _, _, z0 = kto_forward(model, batch, flash, ref=ref)
            loss.backward()
            grads = {p.name: p.grad.numpy().copy() for p in model.parameters() if p.grad is not None}
            results.append((len(rows), float(loss), grads, ref, float(z0)))
    (rows_u, loss_u, g_u, _, z_u), (rows_p, loss_p, g_p, _, z_p) = results
    assert rows_p < rows_u == n  # really packed
    assert z_u > 0 and abs(z_u - z_p) < 5e-5  # float32 sums over differently laid-out rows
    assert abs(loss_u - loss_p) < 1e-5, (loss_u, loss_p)
    assert g_u.keys() == g_p.keys() and len(g_u) > 5
    worst = max(float(np.abs(g_u[k] - g_p[k]).max()) for k in g_u)
    assert worst < 1e-5, worst


def test_bad_records_are_reported_with_file_and_line(tmp_path):
    from paddlenlp_ext.data.reader import DataError
    from paddlenlp_ext.kto.data import read_kto_files

    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "label": True}
    lines = [
        good,
        {**good, "label": "yes"},
        {k: v for k, v in good.items() if k != "label"},
        {"messages": good["messages"][:1], "label": False},
        {**good, "label": 1},
    ]
    path = tmp_path / "kto.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(DataError) as e:
        read_kto_files([str(path)])
    msg = str(e.value)
    assert f"{path}:2: 'label' must be the JSON boolean true or false, got \"yes\"" in msg
    assert f"{path}:3: missing key 'label'" in msg
    assert f"{path}:4:" in msg and f"{path}:5: 'label' must be the JSON boolean" in msg
    assert f"{path}:1" not in msg
    single = tmp_path / "one.jsonl"
    single.write_text(json.dumps(good) + "\n")
    with pytest.raises(DataError, match="at least 2 are needed"):
        read_kto_files([str(single)])


def test_demo_file_parses_when_present():
    from paddlenlp_ext.kto.data import read_kto_files

    candidates = [
        os.path.join(os.path.dirname(ROOT), "shared", "data", "kto_en_demo.json"),
        "/work/shared/data/kto_en_demo.json",
    ]
    path = next((p for p in candidates if os.path.isfile(p)), None)
    if path is None:
        pytest.skip("kto_en_demo.json not available")
    examples = read_kto_files([path])
    labels = {ex.label for ex in examples}
    assert len(examples) > 10 and labels == {True, False}


def test_config_mode(tiny_model_dir, tmp_path):
    from paddlenlp_ext.config.parse import ConfigError, load_config

    data = os.path.join(ROOT, "llm", "data", "kto_tiny")
    base = [
        "--model_name_or_path",
        tiny_model_dir,
        "--train_dataset_path",
        data,
        "--output_dir",
        str(tmp_path),
        "--do_train",
        "true",
        "--lora",
        "true",
    ]
    cfg = load_config(None, base + ["--desirable_weight", "1.33"], mode="kto")
    assert cfg.alignment.desirable_weight == 1.33 and cfg.alignment.loss_type == "kto" and cfg.data.zero_padding
    with pytest.raises(ConfigError) as e:
        load_config(
            None,
            base
            + [
                "--loss_type",
                "sigmoid",
                "--desirable_weight",
                "0",
                "--undesirable_weight",
                "0",
                "--lazy",
                "true",
                "--max_length",
                "128",
            ],
            mode="kto",
        )
    msg = "\n".join(e.value.problems)
    assert "'loss_type' is a DPO (llm/run_dpo.py) key; KTO does not use it" in msg
    assert "desirable_weight and undesirable_weight are both 0" in msg
    assert "lazy=true is not supported for KTO" in msg
    assert "in a KTO config use max_seq_len instead" in msg
    with pytest.raises(ConfigError) as e:  # KTO keys are not DPO keys
        load_config(None, base + ["--desirable_weight", "1.0"], mode="dpo")
    assert "unknown key 'desirable_weight'" in "\n".join(e.value.problems)
