"""End-to-end: every PEFT method (LoRA, rsLoRA, LoRA+, PiSSA, VeRA, NEFTune) through the real CLI.

Each method is trained once (20 steps, batch 8, seed 42, logging every 2 steps) on the
tiny model; the runs are cached for the module and the tests read their outputs:
the loss falls, the method string and the trainable parameter count are exact
(computed from the tiny model's config.json), and the adapter files hold exactly
the expected tensors.
"""

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import DATA_DIR, ROOT, all_on_first_use

# end-to-end through the CLI: `make test-slow` (CI runs it after `make test`)
pytestmark = pytest.mark.slow

CLI = os.path.join(ROOT, "llm", "run_finetune.py")
LORA_CFG = "llm/config/tiny/lora_argument.json"  # lr 1e-2, lora_rank 8
SFT_CFG = "llm/config/tiny/sft_argument.json"  # lr 3e-3
FAST = ("--max_steps", "20", "--per_device_train_batch_size", "8", "--logging_steps", "2")
NO_EVAL0 = ("--eval_before_train", "false")
R = 8  # lora_rank and vera_rank of the tiny configs (defaults)

# name -> (config, extra CLI args, expected run_summary["method"]); only lora and neftune_lora
# evaluate before training (to show NEFTune adds no noise in eval)
RUNS = {
    "lora": (LORA_CFG, (), "lora"),
    "rslora": (LORA_CFG, ("--rslora", "true", *NO_EVAL0), "lora+rslora"),
    "lora_plus": (LORA_CFG, ("--lora_plus_scale", "16", *NO_EVAL0), "lora+lora_plus_scale=16"),
    # randomized SVD (2 power iterations) to also cover pissa_niter; the exact SVD runs in bench/peft_methods.py
    "pissa": (LORA_CFG, ("--pissa", "true", "--pissa_niter", "2", *NO_EVAL0), "lora+pissa"),
    # VeRA trains only r + out scalars per layer: it needs a much larger lr than LoRA (1e-2 barely moves it in 20 steps)
    "vera": (LORA_CFG, ("--vera", "true", "--lora", "false", "--learning_rate", "1", *NO_EVAL0), "vera"),
    "neftune_lora": (LORA_CFG, ("--neftune", "true", "--neftune_noise_alpha", "5"), "lora+neftune"),
    "neftune_full": (SFT_CFG, ("--neftune", "true", "--neftune_noise_alpha", "5", *NO_EVAL0), "full+neftune"),
}
METHODS = list(RUNS)


# ---------------------------------------------------------------------------------------------
# expected shapes / counts from the tiny model's config.json
def tiny_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def adapted_linears(c):
    """{full sublayer name: (in_features, out_features)} of every nn.Linear in the decoder layers."""
    h, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = h // c["num_attention_heads"]
    q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    per_layer = {
        "self_attn.q_proj": (h, q_out),
        "self_attn.k_proj": (h, kv_out),
        "self_attn.v_proj": (h, kv_out),
        "self_attn.o_proj": (q_out, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    return {f"llama.layers.{i}.{k}": v for i in range(c["num_hidden_layers"]) for k, v in per_layer.items()}


def base_param_count(c):
    h, v = c["hidden_size"], c["vocab_size"]
    linears = sum(i * o for i, o in adapted_linears(c).values())  # Llama linears have no bias
    norms = c["num_hidden_layers"] * 2 * h + h  # input/post-attention RMSNorm per layer + final norm
    embeddings = v * h * (1 if c.get("tie_word_embeddings") else 2)  # embed_tokens + lm_head
    return linears + norms + embeddings


def expected_adapter_tensors(c, method):
    """{key in adapter_model.safetensors: shape}"""
    out = {}
    for name, (fin, fout) in adapted_linears(c).items():
        if method == "vera":
            out.update({f"{name}.vera_d": (R,), f"{name}.vera_b": (fout,)})
        else:
            out.update({f"{name}.lora_A": (fin, R), f"{name}.lora_B": (R, fout)})
            if method == "pissa":
                out.update({f"{name}.pissa_A0": (fin, R), f"{name}.pissa_B0": (R, fout)})
    return out


def expected_trainable(c, method):
    lin = adapted_linears(c).values()
    if method == "neftune_full":
        return base_param_count(c)
    if method == "vera":
        return sum(R + o for _, o in lin)  # d: [r], b: [out] per layer
    return sum(R * (i + o) for i, o in lin)  # A: [in, r], B: [r, out] per layer


# ---------------------------------------------------------------------------------------------
class Run:
    def __init__(self, out):
        self.out = out
        self.summary = json.loads((out / "run_summary.json").read_text())
        state = json.loads((out / "trainer_state.json").read_text())
        self.losses = [h["loss"] for h in state["log_history"] if "loss" in h]
        self.adapter_config = (
            json.loads((out / "adapter_config.json").read_text()) if (out / "adapter_config.json").exists() else None
        )

    def adapter_tensors(self):
        from safetensors.numpy import load_file

        return load_file(str(self.out / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """run(name) -> Run: the first call trains every run of RUNS through the CLI, two at a time
    (conftest.all_on_first_use); a test then fails only if its own runs failed."""
    base = tmp_path_factory.mktemp("methods")

    def train(name):
        config, extra, _ = RUNS[name]
        cmd = [
            sys.executable,
            CLI,
            os.path.join(ROOT, config),
            "--output_dir",
            str(base / name),
            "--model_name_or_path",
            tiny_model_dir,
            "--dataset_name_or_path",
            DATA_DIR,
            *FAST,
            *extra,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, f"{name}: {' '.join(cmd)}\n" + r.stdout[-3000:] + r.stderr[-6000:]

    trained = all_on_first_use({name: functools.partial(train, name) for name in RUNS})
    cache = {}

    def get(name):
        trained(name)
        if name not in cache:
            cache[name] = Run(base / name)
        return cache[name]

    return get


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_method_learns_reports_and_saves(run, tiny_model_dir, method):
    c = tiny_config(tiny_model_dir)
    r = run(method)
    s = r.summary
    # loss falls by a clear margin (all start near ln(vocab)-ish 7.5; 20 steps bring them to 4.2-5.9)
    assert len(r.losses) == 10, r.losses
    assert r.losses[-1] < r.losses[0] - 1.0, r.losses
    assert s["global_steps"] == 20 and s["eval_loss"] < r.losses[0] - 1.0
    # method string and exact parameter counts
    assert s["method"] == RUNS[method][2]
    assert s["trainable_params"] == expected_trainable(c, method)
    adapter_params = 0 if method == "neftune_full" else s["trainable_params"]
    assert s["total_params"] == base_param_count(c) + adapter_params
    # saved files
    if method == "neftune_full":
        assert (r.out / "model.safetensors").exists() and r.adapter_config is None
        assert not (r.out / "adapter_model.safetensors").exists()
        return
    assert not list(r.out.glob("model*.safetensors")) and not list(r.out.glob("*.pdparams"))
    tensors = r.adapter_tensors()
    expected = expected_adapter_tensors(c, method)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in tensors.values())
    cfg = r.adapter_config
    assert cfg["r"] == R
    assert cfg["method"] == ("vera" if method == "vera" else "lora")
    assert cfg["rslora"] == (method == "rslora")
    assert cfg["pissa"] == (method == "pissa")
    assert cfg["lora_plus_scale"] == (16.0 if method == "lora_plus" else 1.0)
    # the trainable tensors moved away from their init (B = 0 for LoRA, b = 0 for VeRA)
    trained = "vera_b" if method == "vera" else "lora_B"
    assert all(np.abs(v).max() > 0 for k, v in tensors.items() if k.endswith(trained))


def test_exact_counts_for_the_tiny_model(tiny_model_dir):
    """The formulas above, spelled out for hidden 64, intermediate 176, 2 layers, 4 heads, 2 kv heads, vocab 512."""
    c = tiny_config(tiny_model_dir)
    if (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_hidden_layers"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["vocab_size"],
    ) != (64, 176, 2, 4, 2, 512):
        pytest.skip("tiny model config changed; the formula-based test above still applies")
    # per layer LoRA: q 8*(64+64) + k,v 8*(64+32) + o 8*(64+64) + gate,up,down 8*(64+176)  = 9344
    assert expected_trainable(c, "lora") == 2 * 9344 == 18688
    # per layer VeRA: (8+64) q,o + (8+32) k,v + (8+176) gate,up + (8+64) down = 664
    assert expected_trainable(c, "vera") == 2 * 664 == 1328
    assert base_param_count(c) == 158016


def test_lora_plus_trains_B_faster_and_learns_faster(run):
    """Same lr (1e-2), steps, seed and data: B learning at 16x lr grows much larger and the loss falls faster."""
    lora, plus = run("lora"), run("lora_plus")
    norm = lambda t, suffix: float(
        np.sqrt(
            sum(
                (v.astype(np.float64) ** 2).sum()  # noqa: E731
                for k, v in t.items()
                if k.endswith(suffix)
            )
        )
    )
    lt, pt = lora.adapter_tensors(), plus.adapter_tensors()
    assert norm(pt, "lora_B") > 5 * norm(lt, "lora_B")  # measured ~10x
    # the first logged loss is identical (B = 0 at init, and lr is 0 at step 0 of the warmup)
    assert plus.losses[0] == pytest.approx(lora.losses[0], abs=1e-4)
    assert plus.losses[-1] < lora.losses[-1] - 0.2  # measured 4.72 vs 5.26
    assert plus.summary["eval_loss"] < lora.summary["eval_loss"] - 0.2  # measured 4.60 vs 5.20


def test_rslora_scales_up_the_update(run):
    """r = 8, alpha = 16: rsLoRA's scale alpha/sqrt(r) = 5.66 > alpha/r = 2, so it learns faster at the same lr."""
    lora, rs = run("lora"), run("rslora")
    assert rs.losses[0] == pytest.approx(lora.losses[0], abs=1e-4)
    assert rs.summary["eval_loss"] < lora.summary["eval_loss"] - 0.2  # measured 4.37 vs 5.20


def test_pissa_keeps_outputs_at_init_and_saves_A0_B0(run):
    lora, pissa = run("lora"), run("pissa")
    # PiSSA starts from the same function as the base model (W_res + s*A0@B0 == W): same first loss as LoRA
    assert pissa.losses[0] == pytest.approx(lora.losses[0], abs=1e-3)
    t = pissa.adapter_tensors()
    for k in [k for k in t if k.endswith(".lora_A")]:
        m = k[: -len(".lora_A")]
        assert not np.allclose(t[k], t[m + ".pissa_A0"]), m  # A trained away from its SVD init
        assert np.abs(t[m + ".pissa_A0"]).max() > 0 and np.abs(t[m + ".pissa_B0"]).max() > 0
    assert pissa.adapter_config["pissa_niter"] == 2


def test_neftune_adds_noise_in_training_only(run):
    """Same seed and data as plain LoRA: the eval loss before training is identical (no noise in eval),
    the first training loss differs (noisy embeddings in training); both learn (checked in the matrix)."""
    lora, neft = run("lora"), run("neftune_lora")
    assert neft.summary["eval_loss_before_train"] == pytest.approx(lora.summary["eval_loss_before_train"], rel=1e-6)
    assert abs(neft.losses[0] - lora.losses[0]) > 1e-2  # measured 7.51 vs 7.47
    assert (
        abs(neft.summary["eval_loss"] - lora.summary["eval_loss"]) < 0.5
    )  # noise is a regulariser, not a different method
