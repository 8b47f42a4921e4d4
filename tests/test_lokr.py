"""LoKr adapters (paddlenlp_ext.adapters.lokr): Kronecker-product weight updates.

Checks, in order: the factorization rule on hand-worked dimensions (and against
PaddleNLP 3.0.0b4's own function); the delta on a small example written out by
hand, against numpy's kron and the layer's forward pass; zero delta at init;
the decompose_both variant; bit-level agreement with PaddleNLP's LoKrLinear;
merge/unmerge; save/load/resume; the offline merge script; config validation;
and, through the real CLI, that LoKr learns and reloads/resumes to the same
eval loss.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import DATA_DIR, ROOT

import paddle  # noqa: E402
import paddle.nn as nn  # noqa: E402

from paddlenlp_ext.adapters import (  # noqa: E402
    METHODS,
    AdapterConfig,
    AdapterConfigError,
    AdapterError,
    apply_adapters,
    compute_delta,
    factorization,
    group_adapter_tensors,
    iter_adapter_layers,
    load_adapter,
    load_adapter_weights,
    lokr_shapes,
    merge_adapters,
    read_adapter_tensors,
    save_adapter,
    unmerge_adapters,
)
from paddlenlp_ext.adapters.config import adapter_config_from_args  # noqa: E402

CLI = os.path.join(ROOT, "llm", "run_finetune.py")
MERGE_CLI = os.path.join(ROOT, "llm", "merge_lora_params.py")
LOKR_CFG = os.path.join(ROOT, "llm", "config", "tiny", "lokr_argument.json")


def lokr(r=4, alpha=0.0, factor=-1, both=False):
    """AdapterConfig built from flat keys, exactly as the CLI does."""
    return adapter_config_from_args(
        {"lokr": True, "lokr_dim": r, "lokr_alpha": alpha, "lokr_factor": factor, "lokr_decompose_both": both}
    )


def randomize(layers, seed=0, std=0.2):
    """Non-trivial values in every LoKr tensor (as after training)."""
    rng = np.random.default_rng(seed)
    for layer in layers:
        for t in layer.adapter_state_dict().values():
            t.set_value(paddle.to_tensor(rng.normal(0, std, size=t.shape).astype(np.float32)))


def kron_delta(cfg, t, scale):
    """[in, out] delta written independently of the library: scale * kron(W1, W2).T."""
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    return scale * np.kron(w1, w2).T


# --------------------------------------------------------------- factorization
def test_factorization_worked_examples():
    # 4096 = 64 * 64: the most balanced pair
    assert factorization(4096, -1) == (64, 64)
    # 768 = 2^8 * 3; a factor that divides is taken as is: (8, 768 / 8)
    assert factorization(768, 8) == (8, 96)
    # 768 with -1: largest divisor <= sqrt(768) = 27.7 is 24 -> (24, 32)
    assert factorization(768, -1) == (24, 32)
    # the tiny model's 176 = 11 * 16; factor 10 does not divide 176: divisors 1, 2, 4, 8 are <= 10, 11 is not
    assert factorization(176, -1) == (11, 16)
    assert factorization(176, 10) == (8, 22)
    # 32: divisors 2, 4 then 8 crosses sqrt(32) -> mirror pair (4, 8); a prime only splits as (1, p)
    assert factorization(32) == (4, 8) and factorization(127) == (1, 127)
    # a dividing factor is not reordered (W1 is the larger side)
    assert factorization(64, 32) == (32, 2)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="factor must be -1 or a positive integer"):
            factorization(64, bad)


def test_factorization_matches_paddlenlp():
    from paddlenlp.peft.lokr.lokr_layers import factorization as reference

    cases = [(d, f) for d in range(1, 600) for f in [-1, *range(1, 33)]] + [(4096, -1), (11008, -1), (11008, 16)]
    assert [factorization(d, f) for d, f in cases] == [tuple(reference(d, f)) for d, f in cases]


def test_shapes_follow_paddlenlp_rule():
    # [64, 176] Linear: in 64 = 8*8, out 176 = 11*16; W1 [out_m, in_m] = [11, 8], W2 [16, 8]
    assert dict(lokr_shapes(lokr(r=4), 64, 176)) == {"lokr_w1": (11, 8), "lokr_w2_a": (16, 4), "lokr_w2_b": (4, 8)}
    # r = 8 is not < max(16, 8) / 2: a rank-8 product would not save anything, W2 is full
    assert dict(lokr_shapes(lokr(r=8), 64, 176)) == {"lokr_w1": (11, 8), "lokr_w2": (16, 8)}
    # decompose_both: W1 low rank too when r < max(11, 8) / 2
    assert dict(lokr_shapes(lokr(r=2, both=True), 64, 176)) == {
        "lokr_w1_a": (11, 2),
        "lokr_w1_b": (2, 8),
        "lokr_w2_a": (16, 2),
        "lokr_w2_b": (2, 8),
    }
    assert "lokr_w1" in lokr_shapes(lokr(r=8, both=True), 64, 176)  # 8 >= 5.5: W1 stays full


# ------------------------------------------------------------------ the math
def test_delta_on_a_worked_example():
    """in 6 = 2*3, out 4 = 2*2, r = 1 (< max(2, 3) / 2, so W2 = w2_a @ w2_b), alpha 2 -> scale 2."""
    cfg = lokr(r=1, alpha=2.0)
    assert cfg.scaling == 2.0
    paddle.seed(0)
    base = nn.Linear(6, 4)
    layer = METHODS["lokr"](base, cfg)
    assert layer.state_suffixes == ("lokr_w1", "lokr_w2_a", "lokr_w2_b")
    w1 = np.array([[1, 2], [3, 4]], np.float32)  # [out_m, in_m]
    w2_a = np.array([[1], [2]], np.float32)  # [out_n, r]
    w2_b = np.array([[1, 0, -1]], np.float32)  # [r, in_n]
    for name, v in (("lokr_w1", w1), ("lokr_w2_a", w2_a), ("lokr_w2_b", w2_b)):
        getattr(layer, name).set_value(paddle.to_tensor(v))
    # kron(W1, W2) with W2 = [[1, 0, -1], [2, 0, -2]], by hand: row a*2+c, column b*3+d = W1[a,b] * W2[c,d]
    kron_by_hand = np.array(
        [[1, 0, -1, 2, 0, -2], [2, 0, -2, 4, 0, -4], [3, 0, -3, 4, 0, -4], [6, 0, -6, 8, 0, -8]], np.float32
    )
    want = 2.0 * kron_by_hand.T  # [in 6, out 4]
    np.testing.assert_array_equal(np.kron(w1, w2_a @ w2_b), kron_by_hand)
    np.testing.assert_allclose(layer.delta_weight().numpy(), want, atol=1e-6)
    tensors = {k: v.numpy() for k, v in layer.adapter_state_dict().items()}
    np.testing.assert_allclose(compute_delta("lokr", cfg, tensors, 6, 4), want, atol=1e-6)
    x = paddle.to_tensor(np.random.default_rng(0).normal(size=(2, 3, 6)).astype(np.float32))
    np.testing.assert_allclose((layer(x) - base(x)).numpy(), x.numpy() @ want, atol=1e-5)
    # alpha 0 (PaddleNLP's default) means scale 1: same tensors, half the delta
    assert lokr(r=1).scaling == 1.0 and lokr(r=4, alpha=8).scaling == 2.0


@pytest.mark.parametrize(
    "in_f,out_f,r,alpha,factor,both",
    [
        (64, 176, 4, 0.0, -1, False),  # W1 full, W2 low rank
        (176, 64, 8, 16.0, -1, False),  # W1 and W2 full
        (64, 176, 2, 6.0, -1, True),  # decompose_both: all four low-rank factors
        (768, 64, 8, 4.0, 8, False),  # factor 8: in 768 = 8 * 96, out 64 = 8 * 8
    ],
)
def test_delta_equals_kron_and_forward_difference(in_f, out_f, r, alpha, factor, both):
    cfg = lokr(r, alpha, factor, both)
    paddle.seed(1)
    base = nn.Linear(in_f, out_f)
    layer = METHODS["lokr"](base, cfg)
    x = paddle.randn([2, 5, in_f])
    # init: W1 (or w1_a) is 0, so the output is exactly the base output; the other factors are kaiming-uniform
    zero = "lokr_w1_a" if both and "lokr_w1_a" in layer.state_suffixes else "lokr_w1"
    assert not getattr(layer, zero).numpy().any()
    for name in layer.state_suffixes:
        if name != zero:
            v = getattr(layer, name).numpy()
            assert 0 < np.abs(v).max() <= 1 / np.sqrt(v.shape[0]), name
    np.testing.assert_array_equal(layer(x).numpy(), base(x).numpy())
    assert not layer.delta_weight().numpy().any()

    randomize([layer])
    t = {k: v.numpy() for k, v in layer.adapter_state_dict().items()}
    want = kron_delta(cfg, t, cfg.scaling)
    assert want.shape == (in_f, out_f) and np.abs(want).max() > 1e-2
    np.testing.assert_allclose(layer.delta_weight().numpy(), want, atol=1e-5)
    np.testing.assert_allclose(compute_delta("lokr", cfg, t, in_f, out_f), want, atol=1e-5)
    np.testing.assert_allclose((layer(x) - base(x)).numpy(), x.numpy() @ want, atol=1e-5, rtol=1e-5)


def test_same_outputs_as_paddlenlp_lokr_linear():
    """Same tensor names, shapes, orientation and scale as paddlenlp.peft.lokr.LoKrLinear."""
    from paddlenlp.peft.lokr.lokr_layers import LoKrLinear as Reference

    for in_f, out_f, r, alpha, factor, both in [
        (64, 176, 4, 0.0, -1, False),
        (176, 64, 2, 6.0, -1, True),
        (768, 64, 8, 16.0, 8, False),
    ]:
        paddle.seed(0)
        base = nn.Linear(in_f, out_f)
        ours = METHODS["lokr"](base, lokr(r, alpha, factor, both))
        ref = Reference(in_f, out_f, lokr_dim=r, lokr_alpha=alpha, factor=factor, decompose_both=both)
        ref.weight.set_value(base.weight)
        ref.bias.set_value(base.bias)
        ref_params = {n: p for n, p in ref.named_parameters() if n.startswith("lokr_")}
        assert sorted(ref_params) == sorted(ours.state_suffixes)
        randomize([ours])
        for n, p in ref_params.items():
            p.set_value(getattr(ours, n))
        x = paddle.randn([3, in_f])
        assert ours.scaling == ref.scale
        np.testing.assert_allclose(ours(x).numpy(), ref(x).numpy(), atol=1e-5)


def test_merge_unmerge_exact():
    paddle.seed(2)
    base = nn.Linear(64, 176)
    w0 = base.weight.numpy().copy()
    layer = METHODS["lokr"](base, lokr(r=2, alpha=3.0, both=True))
    randomize([layer])
    x = paddle.randn([4, 64])
    y = layer(x).numpy()
    delta = layer.delta_weight().numpy()
    layer.merge()
    layer.merge()  # idempotent
    np.testing.assert_allclose(base.weight.numpy(), w0 + delta, atol=1e-6)
    np.testing.assert_allclose(layer(x).numpy(), y, atol=1e-5)
    layer.unmerge()
    np.testing.assert_allclose(base.weight.numpy(), w0, atol=1e-6)
    np.testing.assert_allclose(layer(x).numpy(), y, atol=1e-5)


# ---------------------------------------------------- model level: save / load
def test_model_save_load_resume_and_strictness(tmp_path):
    from test_adapters import batch_ids, logits, tiny_llama

    cfg = lokr(r=2, both=True)
    model = tiny_llama()
    orig = {n: p.numpy().copy() for n, p in model.named_parameters()}
    ids = batch_ids()
    y0 = logits(model, ids)
    info = apply_adapters(model, cfg)
    assert len(info["adapted_modules"]) == 14
    np.testing.assert_array_equal(logits(model, ids), y0)  # delta 0 at init
    randomize([l for _, l in iter_adapter_layers(model)], std=0.3)
    y = logits(model, ids)
    assert np.abs(y - y0).max() > 1e-2

    merge_adapters(model)
    np.testing.assert_allclose(logits(model, ids), y, atol=1e-5)
    merged = {n: l.base_layer.weight.numpy().copy() for n, l in iter_adapter_layers(model)}
    unmerge_adapters(model)

    save_adapter(model, cfg, str(tmp_path))
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["method"] == "lokr" and saved["r"] == 2 and saved["alpha"] == 2.0 and saved["lokr_decompose_both"]
    groups = group_adapter_tensors(read_adapter_tensors(str(tmp_path)))
    for n, _ in iter_adapter_layers(model):
        w0 = orig[f"{n}.weight"]
        np.testing.assert_allclose(w0 + compute_delta("lokr", cfg, groups[n], *w0.shape), merged[n], atol=1e-5)

    fresh = tiny_llama()
    assert load_adapter(fresh, str(tmp_path)) == cfg
    np.testing.assert_allclose(logits(fresh, ids), y, atol=1e-5)
    resumed = tiny_llama()
    apply_adapters(resumed, lokr(r=2, both=True))
    load_adapter_weights(resumed, str(tmp_path))
    np.testing.assert_allclose(logits(resumed, ids), y, atol=1e-5)
    # a different factorization is a different adapter: refused by name, not mis-loaded
    other = tiny_llama()
    apply_adapters(other, lokr(r=2, both=False))
    with pytest.raises(AdapterError, match="lokr_decompose_both"):
        load_adapter_weights(other, str(tmp_path))


def test_config_errors():
    for keys, needle in [
        ({"pissa": True}, "pissa=True only applies to method='lora', not 'lokr'"),
        ({"rslora": True}, "rslora=True only applies to method='lora'"),
        ({"lokr_dim": 0}, "r (rank) must be a positive integer"),
        ({"lokr_factor": 0}, "lokr_factor must be -1"),
        ({"lokr_factor": -4}, "lokr_factor must be -1"),
        ({"lokr_alpha": -1.5}, "alpha must be a finite number > 0"),
        ({"vera": True}, "only one adapter method at a time; got vera and lokr"),
    ]:
        with pytest.raises(AdapterConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            adapter_config_from_args({"lokr": True, **keys})
    with pytest.raises(AdapterConfigError, match="only apply to method='lokr'"):
        AdapterConfig(method="lora", r=4, lokr_factor=8)


def test_lokr_path_is_an_alias_of_lora_path(tmp_path, tiny_model_dir):
    from paddlenlp_ext.config.parse import ConfigError, load_config

    adapter = tmp_path / "adapter"
    lokr(r=4).save(str(adapter))
    cfg = tmp_path / "c.json"
    base = {
        "model_name_or_path": tiny_model_dir,
        "dataset_name_or_path": DATA_DIR,
        "output_dir": str(tmp_path / "o"),
        "do_eval": True,
        "lokr": True,
        "lokr_dim": 4,
    }
    cfg.write_text(json.dumps({**base, "lokr_path": str(adapter)}))
    c = load_config(str(cfg))
    assert c.adapter_method == "lokr" and c.model.lora_path == str(adapter) and "lora_path" in c.derived
    for extra, needle in [
        ({"lokr": False}, "lokr_path needs lokr=true"),
        ({"lora_path": str(tmp_path)}, "lokr_path and lora_path are aliases but differ"),
        ({"lokr_dim": 8}, "lokr_dim says 8 but the adapter in lora_path was trained with 4"),
        ({"lokr_factor": 4}, "lokr_factor says 4"),
    ]:
        cfg.write_text(json.dumps({**base, "lokr_path": str(adapter), **extra}))
        with pytest.raises(ConfigError) as e:
            load_config(str(cfg))
        assert needle in "\n".join(e.value.problems), e.value.problems


# ------------------------------------------------------------- offline merge
def test_offline_merge_script(tmp_path, tiny_model_dir):
    """Adapter on the real tiny checkpoint -> llm/merge_lora_params.py -> merged weights are W + delta
    (delta from np.kron, not the library) and the merged model's logits are the adapter model's."""
    import importlib.util

    from paddlenlp.transformers import AutoModelForCausalLM
    from safetensors.numpy import load_file

    from test_adapters import batch_ids

    cfg = adapter_config_from_args(
        {
            "lokr": True,
            "lokr_dim": 2,
            "lokr_alpha": 4.0,
            "lokr_decompose_both": True,
            "model_name_or_path": tiny_model_dir,
            "model_type": "llama",
        }
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    model.eval()
    ids = batch_ids()
    with paddle.no_grad():
        base_logits = model(input_ids=ids, return_dict=True).logits.numpy()
    apply_adapters(model, cfg)
    randomize([l for _, l in iter_adapter_layers(model)], std=0.3)
    adir = tmp_path / "adapter"
    save_adapter(model, cfg, str(adir))
    with paddle.no_grad():
        want_logits = model(input_ids=ids, return_dict=True).logits.numpy()
    assert np.abs(want_logits - base_logits).max() > 0.5  # the adapter matters

    spec = importlib.util.spec_from_file_location("merge_lora_params_cli", MERGE_CLI)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "merged"
    assert (
        script.main(
            [
                "--model_name_or_path",
                tiny_model_dir,
                "--lora_path",
                str(adir),
                "--merge_model_path",
                str(out),
                "--device",
                "cpu",
            ]
        )
        == 0
    )  # includes --verify

    base = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    merged = load_file(str(out / "model.safetensors"))
    groups = group_adapter_tensors(read_adapter_tensors(str(adir)))
    assert len(groups) == 14 and set(merged) == set(base)
    for name, w in base.items():
        mod = name[: -len(".weight")]
        if mod in groups:
            want = w + kron_delta(cfg, groups[mod], 4.0 / 2)
            assert np.abs(merged[name] - w).max() > 1e-3, name
            np.testing.assert_allclose(merged[name], want, atol=1e-5)
        else:
            assert np.array_equal(merged[name], w), name
    m2 = AutoModelForCausalLM.from_pretrained(str(out), dtype="float32")
    m2.eval()
    with paddle.no_grad():
        got_logits = m2(input_ids=ids, return_dict=True).logits.numpy()
    assert np.abs(got_logits - want_logits).max() <= 1e-4


def test_offline_merge_rejects_wrong_tensor_set(tmp_path, tiny_model_dir):
    from safetensors.numpy import save_file

    from paddlenlp_ext.merge import MergeError, merge_adapter_checkpoint

    cfg = lokr(r=4)
    d = tmp_path / "adapter"
    cfg.save(str(d))
    # q_proj [64, 64] with r=4 needs lokr_w1 [8, 8] and a full lokr_w2 [8, 8]; give it the low-rank pair instead
    save_file(
        {
            "llama.layers.0.self_attn.q_proj.lokr_w1": np.zeros((8, 8), np.float32),
            "llama.layers.0.self_attn.q_proj.lokr_w2_a": np.zeros((8, 4), np.float32),
            "llama.layers.0.self_attn.q_proj.lokr_w2_b": np.zeros((4, 8), np.float32),
        },
        str(d / "adapter_model.safetensors"),
    )
    with pytest.raises(MergeError, match=r"a lokr adapter needs \['lokr_w1', 'lokr_w2'\]"):
        merge_adapter_checkpoint(tiny_model_dir, str(d), str(tmp_path / "m"), device="cpu", log=lambda m: None)


# ------------------------------------------------------------------ real CLI
def _cli(out, *overrides):
    cmd = [
        sys.executable,
        CLI,
        LOKR_CFG,
        "--output_dir",
        str(out),
        "--model_name_or_path",
        os.path.join(ROOT, "build", "tiny-llama"),
        "--dataset_name_or_path",
        DATA_DIR,
        *map(str, overrides),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads((out / "run_summary.json").read_text())


def test_cli_lokr_learns_reloads_and_resumes(tiny_model_dir, tmp_path):
    """20 steps (batch 8, lr 0.1 from the tiny config) through llm/run_finetune.py."""
    fast = ("--max_steps", 20, "--per_device_train_batch_size", 8, "--logging_steps", 5)
    s = _cli(tmp_path / "train", *fast, "--save_strategy", "steps", "--save_steps", 10)
    assert s["method"] == "lokr" and s["global_steps"] == 20
    # per decoder layer, lokr_dim 4 on hidden 64 / kv 32 / intermediate 176 (see lokr_shapes):
    # q, o 8x8 + 8x8 = 128; k, v 4x8 + 8x8 = 96; gate, up 11x8 + 16x4 + 4x8 = 184; down 8x11 + 8x4 + 4x16 = 184
    assert s["trainable_params"] == 2 * (2 * 128 + 2 * 96 + 3 * 184) == 2000
    # measured 7.530 -> 5.720
    assert s["eval_loss"] < s["eval_loss_before_train"] - 1.5, s
    out = tmp_path / "train"
    tensors = read_adapter_tensors(str(out))
    assert len(tensors) == 2 * (2 * 2 + 2 * 2 + 3 * 3)
    assert all(np.abs(v).max() > 0 for k, v in tensors.items() if k.endswith(".lokr_w1"))  # W1 moved off 0

    # the saved adapter through lokr_path, eval only: the same eval loss
    s2 = _cli(tmp_path / "reload", "--lokr_path", out, "--do_train", "false", "--eval_before_train", "false")
    assert s2["method"] == "lokr" and s2["eval_loss"] == pytest.approx(s["eval_loss"], rel=1e-5)

    # resume from the step-10 checkpoint: the same 20-step result
    shutil.copytree(out / "checkpoint-10", tmp_path / "resume" / "checkpoint-10")
    s3 = _cli(
        tmp_path / "resume",
        *fast,
        "--eval_before_train",
        "false",
        "--resume_from_checkpoint",
        tmp_path / "resume" / "checkpoint-10",
    )
    assert s3["global_steps"] == 20
    assert s3["eval_loss"] == pytest.approx(s["eval_loss"], rel=1e-4)
