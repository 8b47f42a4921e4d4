"""llm/merge_lora_params.py + paddlenlp_ext.merge: streaming, verified adapter merges.

Adapters of every type are trained for a few steps on the tiny model: LoRA
with the real training CLI (in the background), the others in-process with the
library (quantize_model / apply_adapters / AdamW / save_adapter, exactly what
the CLI does, minus the trainer).  Each merge is checked numerically (merged
tensors vs base + delta), by logits and eval loss (merged model vs base +
adapter, and vs the in-memory trained model itself), through PaddleNLP's
loader and through the training CLI.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import DATA_DIR, ROOT

from paddlenlp_ext.merge import (  # noqa: E402
    EXIT_ERROR,
    EXIT_VERIFY_FAILED,
    MERGE_INFO_NAME,
    VERIFY_FAILED_MARKER,
    MergeError,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    merge_adapter_checkpoint,
    parse_size,
)

CLI = os.path.join(ROOT, "llm", "run_finetune.py")
MERGE_CLI = os.path.join(ROOT, "llm", "merge_lora_params.py")
LORA_CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json")

#: kind -> flat config keys, turned into an AdapterConfig by adapter_config_from_args (as the CLI does)
KINDS = {
    "lora": None,  # trained by the CLI
    "rslora": {"lora": True, "lora_rank": 8, "rslora": True},
    "lora_plus": {"lora": True, "lora_rank": 8, "lora_plus_scale": 16.0},
    "pissa": {"lora": True, "lora_rank": 8, "pissa": True},
    "vera": {"vera": True, "vera_rank": 8},
    "nf4": {
        "lora": True,
        "lora_rank": 8,
        "quantization": {
            "weight_quantize_algo": "nf4",
            "weight_blocksize": 16,
            "weight_double_quant": False,
            "weight_double_quant_block_size": 256,
        },
    },
}
TOKENIZER_FILES = ("sentencepiece.bpe.model", "tokenizer_config.json", "special_tokens_map.json")


def _quiet(log_list=None):
    return (lambda m: log_list.append(m)) if log_list is not None else (lambda m: None)


def _batch(tokenizer, file, n, skip=0):
    """n examples of the advertise data as one padded batch with next-token labels (-100 on padding)."""
    with open(os.path.join(DATA_DIR, file)) as f:
        rows = [json.loads(line) for line in f][skip : skip + n]
    ids = [tokenizer(r["src"] + " " + r["tgt"])["input_ids"][:96] for r in rows]
    width = max(len(x) for x in ids)
    inp = np.full((len(ids), width), tokenizer.pad_token_id or 0, dtype="int64")
    lab = np.full((len(ids), width), -100, dtype="int64")
    for i, x in enumerate(ids):
        inp[i, : len(x)] = x
        lab[i, : len(x) - 1] = x[1:]
    return inp, lab


@pytest.fixture(scope="session")
def eval_batch(tiny_tokenizer):
    return _batch(tiny_tokenizer, "dev.json", 12)


def _train_in_process(kind, base_dir, out, tokenizer, eval_batch):
    """5 AdamW steps of adapter training, then save_adapter + config/tokenizer as the trainer does.
    Returns the trained (in-memory) model's eval logits."""
    import paddle
    import paddle.nn.functional as F

    from paddlenlp_ext.adapters import apply_adapters, save_adapter
    from paddlenlp_ext.adapters.config import adapter_config_from_args
    from paddlenlp_ext.models.quantize import quantize_model

    paddle.seed(1)
    cfg = adapter_config_from_args({**KINDS[kind], "model_name_or_path": base_dir})
    model = _load_model(base_dir)
    if cfg.quantization:
        q = cfg.quantization
        quantize_model(model, q["weight_quantize_algo"], block_size=q["weight_blocksize"])
    apply_adapters(model, cfg)
    params = [p for p in model.parameters() if not p.stop_gradient]
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=params, weight_decay=0.0)
    model.train()
    for step in range(5):
        inp, lab = _batch(tokenizer, "train.json", 8, skip=8 * step)
        out_ = model(input_ids=paddle.to_tensor(inp))
        logits = out_.logits if hasattr(out_, "logits") else out_[0]
        loss = F.cross_entropy(logits.astype("float32"), paddle.to_tensor(lab).unsqueeze(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.clear_grad()
    model.eval()
    save_adapter(model, cfg, str(out))
    model.config.save_pretrained(str(out))
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(base_dir, f), out / f)
    return _logits_and_loss(model, eval_batch)[0]


@pytest.fixture(scope="session")
def trained(tiny_model_dir, tiny_tokenizer, eval_batch, tmp_path_factory):
    """{kind: (adapter_dir, trained model's eval logits or None)}."""
    root = tmp_path_factory.mktemp("merge_adapters")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        CLI,
        LORA_CONFIG,
        "--output_dir",
        str(root / "lora"),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name_or_path",
        DATA_DIR,
        "--max_steps",
        "5",
        "--warmup_steps",
        "1",
        "--logging_steps",
        "5",
        "--per_device_train_batch_size",
        "8",
        "--eval_before_train",
        "false",
    ]
    log = open(root / "lora.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        out = {
            k: (str(root / k), _train_in_process(k, tiny_model_dir, root / k, tiny_tokenizer, eval_batch))
            for k in KINDS
            if KINDS[k] is not None
        }
    finally:
        rc = proc.wait(timeout=300)
        log.close()
    assert rc == 0, (root / "lora.log").read_text()[-4000:]
    out["lora"] = (str(root / "lora"), None)
    return out


@pytest.fixture(scope="session")
def adapters(trained):
    return {k: v[0] for k, v in trained.items()}


def _load_model(path, adapter_dir=None):
    from paddlenlp.transformers import AutoModelForCausalLM

    from paddlenlp_ext.adapters import load_adapter

    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    if adapter_dir:
        load_adapter(model, adapter_dir)
    model.eval()
    return model


def _logits_and_loss(model, batch):
    import paddle

    inp, lab = batch
    with paddle.no_grad():
        out = model(input_ids=paddle.to_tensor(inp))
    logits = (out.logits if hasattr(out, "logits") else out[0]).astype("float32").numpy()
    # mean token cross-entropy over the non-padding labels
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    mask = lab != -100
    nll = -np.take_along_axis(logp, np.where(mask, lab, 0)[..., None], -1)[..., 0]
    return logits, float((nll * mask).sum() / mask.sum())


def _read_st(path):
    """{name: float32 array} of a (possibly sharded) safetensors model dir (bf16 = U16 decoded)."""
    from safetensors.numpy import load_file

    idx = os.path.join(path, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
    out = {}
    for f in files:
        for k, v in load_file(os.path.join(path, f)).items():
            out[k] = bf16_bits_to_f32(v) if v.dtype == np.uint16 else v.astype(np.float32)
    return out


def _run_script(argv):
    spec = importlib.util.spec_from_file_location("merge_lora_params_cli", MERGE_CLI)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main([str(a) for a in argv])


def _no_leftovers(parent):
    return [n for n in os.listdir(parent) if ".merging-" in n]


# --------------------------------------------------------------- every type
@pytest.mark.parametrize("kind", list(KINDS))
def test_merge_reproduces_adapter_model(kind, trained, tiny_model_dir, eval_batch, tmp_path):
    from paddlenlp_ext.adapters import AdapterConfig, compute_delta, group_adapter_tensors, read_adapter_tensors

    adir, trained_logits = trained[kind]
    cfg = AdapterConfig.load(adir)
    logs = []
    out = tmp_path / "merged"
    res = merge_adapter_checkpoint(tiny_model_dir, adir, str(out), device="cpu", log=_quiet(logs))
    assert res.exit_code == 0 and res.verify["status"] == "passed", logs
    assert res.verify["relative_error"] <= 1e-4 and len(res.modules_merged) == 14
    assert res.verify["adapter_effect"] > 100 * res.verify["max_abs_logit_diff"]  # the adapter was really trained
    for f in (
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
        "sentencepiece.bpe.model",
        "model.safetensors",
        MERGE_INFO_NAME,
    ):
        assert (out / f).exists(), f
    assert not (out / VERIFY_FAILED_MARKER).exists() and not _no_leftovers(tmp_path)

    # tensors: merged = base + compute_delta for adapted modules, bit-identical elsewhere
    base, merged = _read_st(tiny_model_dir), _read_st(str(out))
    assert set(base) == set(merged)
    groups = group_adapter_tensors(read_adapter_tensors(adir))
    for name, w in base.items():
        mod = name[: -len(".weight")]
        if mod in groups:
            delta = compute_delta(cfg.layer_type, cfg, groups[mod], *w.shape)
            assert np.abs(delta).max() > 0, name
            np.testing.assert_allclose(merged[name], w + delta, rtol=0, atol=1e-6)
        else:
            assert np.array_equal(merged[name], w), name
    if kind == "pissa":
        # against the ORIGINAL base: W + s(AB - A0B0), written out independently of compute_delta;
        # a naive LoRA-style merge (W + sAB) would be far off.
        s = cfg.scaling
        t = groups["llama.layers.1.mlp.up_proj"]
        w = base["llama.layers.1.mlp.up_proj.weight"]
        want = w + s * (t["lora_A"] @ t["lora_B"]) - s * (t["pissa_A0"] @ t["pissa_B0"])
        np.testing.assert_allclose(merged["llama.layers.1.mlp.up_proj.weight"], want, atol=1e-5)
        assert np.abs(merged["llama.layers.1.mlp.up_proj.weight"] - (w + s * t["lora_A"] @ t["lora_B"])).max() > 0.1
    if kind == "nf4":
        assert cfg.quantization["weight_quantize_algo"] == "nf4"
        assert res.verify["reference"] == "full-precision base + adapter"
        assert "quantized_base_gap" in res.verify
        assert any("nf4-quantized base + adapter" in m for m in logs)
        assert json.load(open(out / MERGE_INFO_NAME))["merged_into"] == "full-precision base"

    # logits and eval loss on real dev examples: merged model == base + adapter
    ref_logits, ref_loss = _logits_and_loss(_load_model(tiny_model_dir, adir), eval_batch)
    got_logits, got_loss = _logits_and_loss(_load_model(str(out)), eval_batch)
    assert np.abs(got_logits - ref_logits).max() <= 1e-4
    assert got_loss == pytest.approx(ref_loss, rel=1e-4)
    if trained_logits is not None and not cfg.quantization:
        # ... and the very model that was trained (PiSSA: its residual base came from the SVD at init)
        assert np.abs(got_logits - trained_logits).max() <= 1e-4


def test_merged_model_is_usable_by_the_cli(adapters, tiny_model_dir, tmp_path, capsys):
    """The script's output as --model_name_or_path of run_finetune.py gives the eval loss that
    the trainer measured for the CLI-trained adapter model."""
    out = tmp_path / "merged"
    rc = _run_script(
        ["--model_name_or_path", tiny_model_dir, "--lora_path", adapters["lora"], "--output_path", out, "--no-verify"]
    )
    assert rc == 0 and "merged 14 modules" in capsys.readouterr().out
    trained = json.load(open(os.path.join(adapters["lora"], "run_summary.json")))["eval_loss"]
    ev = tmp_path / "eval"
    r = subprocess.run(
        [
            sys.executable,
            CLI,
            LORA_CONFIG,
            "--output_dir",
            str(ev),
            "--model_name_or_path",
            str(out),
            "--dataset_name_or_path",
            DATA_DIR,
            "--lora",
            "false",
            "--do_train",
            "false",
            "--eval_before_train",
            "false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.load(open(ev / "run_summary.json"))["eval_loss"]
    assert got == pytest.approx(trained, rel=1e-4)


# ------------------------------------------------------- layouts and dtypes
@pytest.fixture(scope="module")
def base_variants(tiny_model_dir, tmp_path_factory):
    """The tiny base re-saved by PaddleNLP: fp32 in 5 shards, bf16 in many shards, pdparams."""
    from paddlenlp.transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("bases")
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    m.save_pretrained(str(root / "fp32_sharded"), safe_serialization=True, max_shard_size="250KB")
    m.save_pretrained(str(root / "pdparams"), safe_serialization=False)
    m.save_pretrained(str(root / "pdparams_sharded"), safe_serialization=False, max_shard_size="200KB")
    mb = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="bfloat16")
    mb.save_pretrained(str(root / "bf16_sharded"), safe_serialization=True, max_shard_size="120KB")
    for d in root.iterdir():
        for f in ("sentencepiece.bpe.model", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(os.path.join(tiny_model_dir, f), d / f)
    return {d.name: str(d) for d in root.iterdir()}


def _shards(path, index_name="model.safetensors.index.json"):
    with open(os.path.join(path, index_name)) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def test_sharded_fp32_input_gives_sharded_output(adapters, base_variants, tiny_model_dir, tmp_path):
    src = base_variants["fp32_sharded"]
    assert len(_shards(src)) >= 3
    out = tmp_path / "merged"
    res = merge_adapter_checkpoint(src, adapters["pissa"], str(out), max_shard_size="250KB", device="cpu", log=_quiet())
    assert res.verify["status"] == "passed" and res.verify["relative_error"] <= 1e-4
    shards = _shards(str(out))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    sizes = [os.path.getsize(out / s) for s in shards]
    assert max(sizes) <= 250_000 + 4096
    idx = json.load(open(out / "model.safetensors.index.json"))
    assert idx["metadata"]["total_size"] == sum(v.nbytes for v in _read_st(tiny_model_dir).values())
    # same tensors as the single-file base + delta
    from paddlenlp_ext.adapters import AdapterConfig, compute_delta, group_adapter_tensors, read_adapter_tensors

    cfg = AdapterConfig.load(adapters["pissa"])
    groups = group_adapter_tensors(read_adapter_tensors(adapters["pissa"]))
    base, got = _read_st(tiny_model_dir), _read_st(str(out))
    for name, w in base.items():
        mod = name[: -len(".weight")]
        want = w + compute_delta("pissa", cfg, groups[mod], *w.shape) if mod in groups else w
        np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-6)


def test_bf16_sharded_input(adapters, base_variants, tmp_path):
    """bf16 (stored by PaddleNLP as U16): decoded with bit ops, merged in fp32, rounded to nearest even."""
    from paddlenlp_ext.adapters import AdapterConfig, compute_delta, group_adapter_tensors, read_adapter_tensors

    src = base_variants["bf16_sharded"]
    out = tmp_path / "merged"
    res = merge_adapter_checkpoint(src, adapters["lora"], str(out), max_shard_size="110KB", device="cpu", log=_quiet())
    assert res.dtype == "bfloat16" and res.tolerance == 5e-2
    assert res.verify["status"] == "passed", res.verify
    assert res.verify["adapter_effect"] > 10 * res.verify["max_abs_logit_diff"]
    assert len(_shards(str(out))) >= 3
    cfg = AdapterConfig.load(adapters["lora"])
    groups = group_adapter_tensors(read_adapter_tensors(adapters["lora"]))
    from safetensors.numpy import load_file

    raw_base, raw_out = {}, {}
    for d, acc in ((src, raw_base), (str(out), raw_out)):
        for f in _shards(d):
            acc.update(load_file(os.path.join(d, f)))
    name = "llama.layers.0.mlp.gate_proj.weight"
    assert raw_out[name].dtype == np.uint16  # same on-disk convention as PaddleNLP's save_pretrained
    w = bf16_bits_to_f32(raw_base[name])
    want = f32_to_bf16_bits(w + compute_delta("lora", cfg, groups[name[:-7]], *w.shape))
    assert np.array_equal(raw_out[name], want)
    assert np.array_equal(raw_out["llama.embed_tokens.weight"], raw_base["llama.embed_tokens.weight"])
    # PaddleNLP loads it as bf16
    from paddlenlp.transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(out), dtype="bfloat16")
    got = m.state_dict()[name].astype("float32").numpy()
    assert np.array_equal(got, bf16_bits_to_f32(want))


def test_bf16_bit_conversion_matches_paddle():
    import paddle

    rng = np.random.default_rng(0)
    x = rng.standard_normal(200_000) * rng.choice([1e-38, 1e-3, 1.0, 1e3, 1e37], 200_000)
    x = x.astype(np.float32)
    x[:3] = [np.inf, -np.inf, 3.3961e38]
    ours = f32_to_bf16_bits(x)
    theirs = paddle.to_tensor(x).astype("bfloat16").numpy()
    assert np.array_equal(ours, theirs)
    assert np.isnan(bf16_bits_to_f32(f32_to_bf16_bits(np.array([np.nan], np.float32)))).all()
    y = bf16_bits_to_f32(ours)
    assert np.array_equal(f32_to_bf16_bits(y), ours)  # exact round trip


@pytest.mark.parametrize("variant", ["pdparams", "pdparams_sharded"])
def test_pdparams_input(variant, adapters, base_variants, tmp_path):
    src = base_variants[variant]
    out = tmp_path / "merged"
    res = merge_adapter_checkpoint(src, adapters["vera"], str(out), device="cpu", log=_quiet())
    assert res.verify["status"] == "passed" and res.verify["relative_error"] <= 1e-4
    assert (out / "model.safetensors").exists()
    if variant == "pdparams_sharded":  # and pdparams output
        out2 = tmp_path / "merged_pd"
        merge_adapter_checkpoint(
            src,
            adapters["vera"],
            str(out2),
            safe_serialization=False,
            max_shard_size="200KB",
            verify=False,
            log=_quiet(),
        )
        assert len(_shards(str(out2), "model_state.pdparams.index.json")) >= 2
        assert not list(out2.glob("*.safetensors"))
        # PaddleNLP loads the pdparams output; same weights as the safetensors output
        from paddlenlp.transformers import AutoModelForCausalLM

        sd = AutoModelForCausalLM.from_pretrained(str(out2), dtype="float32").state_dict()
        ref = _read_st(str(out))
        for k, v in ref.items():
            assert np.array_equal(sd[k].numpy(), v), k


def test_parse_size():
    assert parse_size("1GB") == 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    with pytest.raises(MergeError):
        parse_size("lots")


# ----------------------------------------------------------- refusals / errors
def test_refuses_non_empty_output_unless_overwrite(adapters, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    argv = [
        "--model_name_or_path",
        tiny_model_dir,
        "--lora_path",
        adapters["lora"],
        "--merge_model_path",
        out,
        "--no-verify",
    ]
    assert _run_script(argv) == EXIT_ERROR
    assert "not empty" in capsys.readouterr().err and (out / "keep.txt").read_text() == "precious"
    assert _run_script(argv + ["--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert not _no_leftovers(tmp_path)
    # an empty directory is fine without --overwrite; the base dir itself never is
    empty = tmp_path / "empty"
    empty.mkdir()
    merge_adapter_checkpoint(tiny_model_dir, adapters["lora"], str(empty), verify=False, log=_quiet())
    with pytest.raises(MergeError, match="same directory"):
        merge_adapter_checkpoint(tiny_model_dir, adapters["lora"], tiny_model_dir, overwrite=True, verify=False)


def _copy_adapter(src, dst, rename=None, reshape=None):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(os.path.join(src, "adapter_model.safetensors"))
    if rename:
        t = {k.replace(*rename): v for k, v in t.items()}
    if reshape:
        t[reshape] = np.zeros((t[reshape].shape[0] + 1, t[reshape].shape[1]), np.float32)
    save_file(t, os.path.join(dst, "adapter_model.safetensors"), metadata={"format": "np"})
    return str(dst)


def test_mismatch_errors(adapters, tiny_model_dir, tmp_path):
    def fails(adapter, match, base=tiny_model_dir):
        out = tmp_path / "out"
        with pytest.raises(MergeError, match=match):
            merge_adapter_checkpoint(base, adapter, str(out), verify=False, log=_quiet())
        assert not out.exists() and not _no_leftovers(tmp_path)

    lora = adapters["lora"]
    # module names the base does not have (e.g. an adapter for a deeper model)
    fails(_copy_adapter(lora, tmp_path / "names", rename=("layers.1.", "layers.7.")), r"no weight in the base")
    # adapter tensor shapes that do not fit the base weight
    fails(
        _copy_adapter(lora, tmp_path / "shape", reshape="llama.layers.0.self_attn.q_proj.lora_A"),
        r"q_proj.lora_A: shape \[65, 8\] does not fit",
    )
    # model_type of the adapter's config.json vs the base's
    d = shutil.copytree(lora, tmp_path / "mtype")
    c = json.load(open(d / "config.json"))
    c["model_type"] = "qwen2"
    json.dump(c, open(d / "config.json", "w"))
    fails(str(d), "model_type mismatch")
    # missing files
    d = shutil.copytree(lora, tmp_path / "noweights")
    os.remove(d / "adapter_model.safetensors")
    fails(str(d), r"lacks \['adapter_model.safetensors'\]")
    fails(str(tmp_path / "nowhere"), "does not exist")
    bad_base = tmp_path / "badbase"
    bad_base.mkdir()
    shutil.copy(os.path.join(tiny_model_dir, "config.json"), bad_base / "config.json")
    fails(lora, "no model weights found", base=str(bad_base))
    # an index that names a missing shard
    with open(bad_base / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {"llama.embed_tokens.weight": "model-00001-of-00002.safetensors"}}, f)
    fails(lora, "do not exist", base=str(bad_base))


def test_verify_failure_marks_output(adapters, tiny_model_dir, tmp_path, capsys, monkeypatch):
    # an impossible tolerance through the script: exit code 3, output kept and marked
    out = tmp_path / "strict"
    rc = _run_script(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--lora_path",
            adapters["rslora"],
            "--merge_model_path",
            out,
            "--tolerance",
            "1e-12",
            "--device",
            "cpu",
        ]
    )
    assert rc == EXIT_VERIFY_FAILED
    assert "verification FAILED" in capsys.readouterr().err
    assert (out / VERIFY_FAILED_MARKER).exists() and (out / "model.safetensors").exists()
    assert json.load(open(out / MERGE_INFO_NAME))["verify"]["status"] == "failed"
    # a wrong merge (delta applied twice) is caught at the default tolerance
    import paddlenlp_ext.adapters.api as api

    real = api.compute_delta
    monkeypatch.setattr(api, "compute_delta", lambda *a, **k: 2 * real(*a, **k))
    out = tmp_path / "corrupt"
    res = merge_adapter_checkpoint(tiny_model_dir, adapters["lora"], str(out), device="cpu", log=_quiet())
    assert res.exit_code == EXIT_VERIFY_FAILED and res.verify["relative_error"] > 1e-3
    assert (out / VERIFY_FAILED_MARKER).exists()


def test_verify_is_skipped_when_the_model_does_not_fit(adapters, tiny_model_dir, tmp_path, monkeypatch):
    import paddlenlp_ext.merge.verify as verify  # where verify_merge looks the estimate up

    monkeypatch.setattr(verify, "estimate_verify_bytes", lambda ckpt: 10**15)
    logs = []
    res = merge_adapter_checkpoint(tiny_model_dir, adapters["lora"], str(tmp_path / "out"), log=_quiet(logs))
    assert res.verify["status"] == "skipped" and res.exit_code == 0
    assert any("[verify] skipped" in m for m in logs)
    assert not (tmp_path / "out" / VERIFY_FAILED_MARKER).exists()


def test_failure_midway_leaves_nothing_and_fallback_copy_path(adapters, base_variants, tmp_path, monkeypatch):
    import threading

    import paddlenlp_ext.merge.checkpoint_merge as pipeline  # looks add_delta_inplace up
    import paddlenlp_ext.merge.writer as writer  # owns the copy_file_range switch

    src = base_variants["fp32_sharded"]
    ref = tmp_path / "ref"
    merge_adapter_checkpoint(src, adapters["lora"], str(ref), max_shard_size="250KB", verify=False, log=_quiet())
    # untouched tensors copied with plain reads/writes instead of os.copy_file_range: same bytes
    monkeypatch.setattr(writer, "_COPY_FILE_RANGE_OK", False)

    def no_kernel_copy(*a):  # so the byte comparison below cannot pass on the kernel path by mistake
        raise AssertionError("os.copy_file_range called although the fallback is switched on")

    monkeypatch.setattr(os, "copy_file_range", no_kernel_copy, raising=False)
    alt = tmp_path / "alt"
    merge_adapter_checkpoint(src, adapters["lora"], str(alt), max_shard_size="250KB", verify=False, log=_quiet())
    for f in sorted(os.listdir(ref)):
        if f.endswith(".safetensors"):
            assert (ref / f).read_bytes() == (alt / f).read_bytes(), f
    # an error in the middle of the second shard: no output, no temp dir, no writer thread left behind
    real, calls = pipeline.add_delta_inplace, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 9:
            raise RuntimeError("disk on fire")
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "add_delta_inplace", failing)
    out = tmp_path / "broken"
    with pytest.raises(RuntimeError, match="disk on fire"):
        merge_adapter_checkpoint(src, adapters["lora"], str(out), max_shard_size="250KB", verify=False, log=_quiet())
    assert not out.exists() and not _no_leftovers(tmp_path)
    assert not [t for t in threading.enumerate() if t.name == "safetensors-writer"]
