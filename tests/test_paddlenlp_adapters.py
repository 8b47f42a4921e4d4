"""Adapters saved by PaddleNLP itself (paddlenlp.peft LoRAModel / VeRAModel .save_pretrained) are read
everywhere an adapter is read: AdapterConfig.load / read_adapter_tensors / load_adapter, the merge
(llm/merge_lora_params.py and PaddleNLP's location llm/tools/merge_lora_params.py with PaddleNLP's
flags), the training CLI's lora_path and its config validation.

Every adapter here is written by PaddleNLP's own classes on the tiny model, with random non-zero
lora_A / lora_B; the expected numbers come from numpy (W + s*A@B with the arrays we set) and from
PaddleNLP's own LoRAModel (forward and merge()), never from the code under test.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import DATA_DIR, ROOT

from paddlenlp_ext.adapters import AdapterConfig, load_adapter, read_adapter_tensors
from paddlenlp_ext.adapters.paddlenlp_format import REFUSED_LORA_KEYS, PaddleNLPAdapterError
from paddlenlp_ext.config.parse import ConfigError, load_config
from paddlenlp_ext.merge import MergeError, merge_adapter_checkpoint

CLI = os.path.join(ROOT, "llm", "run_finetune.py")
MERGE_CLI = os.path.join(ROOT, "llm", "merge_lora_params.py")
PNLP_MERGE_CLI = os.path.join(ROOT, "llm", "tools", "merge_lora_params.py")
LORA_CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json")
ALL_LINEARS = [f".*{n}.*" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]


def _run_script(path, argv):
    spec = importlib.util.spec_from_file_location(f"script_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main([str(a) for a in argv])


def _base_model(base_dir):
    from paddlenlp.transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, dtype="float32")


def _save_paddlenlp_lora(base_dir, out_dir, seed=0, **lora_kw):
    """PaddleNLP's LoRAModel on the tiny model with random non-zero A and B, saved with its own
    save_pretrained.  Returns {module: {"lora_A": A, "lora_B": B}} as set."""
    import paddle
    from paddlenlp.peft import LoRAConfig, LoRAModel

    lm = LoRAModel(_base_model(base_dir), LoRAConfig(**lora_kw))
    rng = np.random.default_rng(seed)
    factors = {}
    for name, p in lm.model.named_parameters():
        mod, _, suffix = name.rpartition(".")
        if suffix in ("lora_A", "lora_B"):
            v = (0.3 * rng.standard_normal(p.shape)).astype(np.float32)
            p.set_value(paddle.to_tensor(v))
            factors.setdefault(mod, {})[suffix] = v
    lm.save_pretrained(out_dir)
    return factors


def _paddlenlp_merged_weights(base_dir, lora_dir):
    """PaddleNLP's own answer: LoRAModel.from_pretrained + merge()."""
    from paddlenlp.peft import LoRAModel

    lm = LoRAModel.from_pretrained(_base_model(base_dir), lora_dir)
    lm.merge()
    return {k: v.numpy() for k, v in lm.model.state_dict().items() if "lora" not in k}


def _read_st(path):
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _read_pd(path):
    import paddle

    return {k: v.numpy() for k, v in paddle.load(os.path.join(path, "model_state.pdparams")).items()}


def _check_merged(merged, base, factors, scaling):
    """adapted weights == W + scaling*A@B (numpy, 1e-5); every other tensor bit-identical; returns max error."""
    assert set(merged) == set(base)
    worst = 0.0
    for name, w in base.items():
        mod = name[: -len(".weight")]
        if mod in factors:
            want = w + np.float32(scaling) * (factors[mod]["lora_A"] @ factors[mod]["lora_B"])
            assert np.abs(want - w).max() > 1e-2, name  # the adapter really changes this weight
            err = float(np.abs(merged[name] - want).max())
            assert err <= 1e-5, (name, err)
            worst = max(worst, err)
        else:
            assert np.array_equal(merged[name], w), name
    return worst


@pytest.fixture(scope="module")
def pnlp(tiny_model_dir, tmp_path_factory):
    """PaddleNLP adapters: all decoder linears (r=4, alpha=8 -> s=2), rsLoRA on q/v (s=8/sqrt(4)=4), VeRA."""
    root = tmp_path_factory.mktemp("paddlenlp_adapters")
    out = {}
    d = str(root / "lora")
    out["lora"] = (
        d,
        _save_paddlenlp_lora(
            tiny_model_dir,
            d,
            seed=1,
            r=4,
            lora_alpha=8,
            target_modules=ALL_LINEARS,
            base_model_name_or_path=tiny_model_dir,
        ),
    )
    d = str(root / "rslora")
    out["rslora"] = (
        d,
        _save_paddlenlp_lora(
            tiny_model_dir, d, seed=2, r=4, lora_alpha=8, rslora=True, target_modules=[".*q_proj.*", ".*v_proj.*"]
        ),
    )
    from paddlenlp.peft import VeRAConfig, VeRAModel

    d = str(root / "vera")  # as PaddleNLP's run_finetune.py builds it
    vm = VeRAModel(
        _base_model(tiny_model_dir), VeRAConfig(target_modules=ALL_LINEARS, r=4, vera_alpha=4, pissa_init=True)
    )
    vm.mark_only_vera_as_trainable(notfreezeB=True)
    vm.save_pretrained(d)
    out["vera"] = (d, None)
    return out


# ------------------------------------------------------------------- config
def test_config_mapping(pnlp, tmp_path):
    d, factors = pnlp["lora"]
    assert sorted(os.listdir(d)) == ["config.json", "lora_config.json", "lora_model_state.pdparams"]
    cfg = AdapterConfig.load(d)
    assert (cfg.method, cfg.layer_type, cfg.r, cfg.alpha, cfg.rslora, cfg.scaling) == (
        "lora",
        "lora",
        4,
        8.0,
        False,
        2.0,
    )
    assert cfg.target_modules == ALL_LINEARS and cfg.model_type == "llama" and cfg.quantization is None
    assert json.load(open(os.path.join(d, "lora_config.json")))["scaling"] == cfg.scaling
    tensors = read_adapter_tensors(d)
    assert len(tensors) == 2 * 14 and set(tensors) == {f"{m}.{s}" for m in factors for s in ("lora_A", "lora_B")}
    for mod, t in factors.items():  # same keys, same [in, r] / [r, out] layout, same values
        assert np.array_equal(tensors[f"{mod}.lora_A"], t["lora_A"]) and tensors[f"{mod}.lora_A"].shape[1] == 4
        assert np.array_equal(tensors[f"{mod}.lora_B"], t["lora_B"])
    assert AdapterConfig.load(pnlp["rslora"][0]).scaling == 4.0  # 8 / sqrt(4), PaddleNLP's rsLoRA

    # LoRA+ ratio, dropout, a QLoRA base (config.json's quantization_config) map to ours
    e = _edited(d, tmp_path / "e", lora_plus_scale=16.0, lora_dropout=0.1)
    m = json.load(open(os.path.join(e, "config.json")))
    m["quantization_config"] = {
        "weight_quantize_algo": "nf4",
        "weight_blocksize": 64,
        "weight_double_quant": True,
        "weight_double_quant_block_size": 256,
        "quant_type": None,
    }
    json.dump(m, open(os.path.join(e, "config.json"), "w"))
    c = AdapterConfig.load(e)
    assert (c.lora_plus_scale, c.dropout) == (16.0, 0.1)
    assert c.quantization == {
        "weight_quantize_algo": "nf4",
        "weight_blocksize": 64,
        "weight_double_quant": True,
        "weight_double_quant_block_size": 256,
    }


def test_weight_file_variants_bf16_and_sharded_safetensors(pnlp, tmp_path):
    """bf16 lora_model_state.pdparams (paddle.save of bf16 Tensors) and the trainer's sharded
    peft_model-*.safetensors + index (bf16 as PaddleNLP's U16) read as the exact float32 values."""
    import paddle
    from safetensors.numpy import save_file

    src, factors = pnlp["lora"]
    flat = {f"{m}.{s}": v for m, t in factors.items() for s, v in t.items()}
    bf = {k: paddle.to_tensor(v).astype("bfloat16") for k, v in flat.items()}
    want = {k: t.astype("float32").numpy() for k, t in bf.items()}
    assert max(np.abs(want[k] - flat[k]).max() for k in flat) > 0  # bf16 really rounds

    d1 = _edited(src, tmp_path / "bf16", dtype="bfloat16")
    paddle.save(bf, os.path.join(d1, "lora_model_state.pdparams"))
    got = read_adapter_tensors(d1)
    assert all(got[k].dtype == np.float32 and np.array_equal(got[k], want[k]) for k in flat)

    d2 = _edited(src, tmp_path / "sharded")
    os.remove(os.path.join(d2, "lora_model_state.pdparams"))
    keys = sorted(flat)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :])):
        name = f"peft_model-0000{i + 1}-of-00002.safetensors"
        save_file({k: bf[k].numpy() for k in part}, os.path.join(d2, name), metadata={"format": "np"})  # uint16
        weight_map.update({k: name for k in part})
    json.dump(
        {"metadata": {}, "weight_map": weight_map}, open(os.path.join(d2, "peft_model.safetensors.index.json"), "w")
    )
    got = read_adapter_tensors(d2)
    assert set(got) == set(flat) and all(np.array_equal(got[k], want[k]) for k in flat)


# -------------------------------------------------------------------- merge
def test_merge_equals_numpy_and_paddlenlp(pnlp, tiny_model_dir, tmp_path, capsys):
    d, factors = pnlp["lora"]
    out = tmp_path / "merged"
    rc = _run_script(
        MERGE_CLI,
        ["--model_name_or_path", tiny_model_dir, "--lora_path", d, "--merge_model_path", out, "--device", "cpu"],
    )
    log = capsys.readouterr().out
    assert rc == 0 and "merged 14 modules" in log and "verify: passed" in log, log
    base, merged = _read_st(tiny_model_dir), _read_st(str(out))
    err = _check_merged(merged, base, factors, scaling=2.0)
    print(f"max |merged - (W + 2*A@B)| = {err:.2e}")
    info = json.load(open(out / "merge_info.json"))
    assert info["adapter_config"]["alpha"] == 8.0 and info["verify"]["status"] == "passed"
    # PaddleNLP's own LoRAModel.merge() on the same directory gives the same weights
    ref = _paddlenlp_merged_weights(tiny_model_dir, d)
    assert max(float(np.abs(ref[k] - merged[k]).max()) for k in merged) <= 1e-5


def test_paddlenlp_merge_location_and_flags(pnlp, tiny_model_dir, tmp_path, capsys):
    d, factors = pnlp["lora"]
    out = tmp_path / "pd"
    # PaddleNLP's current flags; --safe_serialization defaults to False as there -> model_state.pdparams
    rc = _run_script(
        PNLP_MERGE_CLI,
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--lora_path",
            d,
            "--output_path",
            out,
            "--device",
            "gpu",
            "--low_gpu_mem",
            "True",
        ],
    )
    log = capsys.readouterr().out
    assert rc == 0 and "verify: passed" in log, log
    assert "--low_gpu_mem has no effect" in log and "--device gpu: the merge itself runs on the CPU" in log
    assert (out / "model_state.pdparams").exists() and not list(out.glob("*.safetensors"))
    assert (out / "tokenizer_config.json").exists() and (out / "config.json").exists()
    base = _read_st(tiny_model_dir)
    _check_merged(_read_pd(str(out)), base, factors, scaling=2.0)

    # the older flags: --merge_lora_model_path, no --model_name_or_path (-> lora_config's base_model_name_or_path)
    out2 = tmp_path / "st"
    rc = _run_script(
        PNLP_MERGE_CLI,
        ["--lora_path", d, "--merge_lora_model_path", out2, "--safe_serialization", "true", "--no-verify"],
    )
    log = capsys.readouterr().out
    assert rc == 0 and f"base_model_name_or_path {tiny_model_dir}" in log, log
    _check_merged(_read_st(str(out2)), base, factors, scaling=2.0)

    with pytest.raises(SystemExit) as e:  # unknown flags are an error, not ignored
        _run_script(PNLP_MERGE_CLI, ["--lora_path", d, "--output_path", tmp_path / "x", "--use_vocab_extend", "true"])
    assert e.value.code == 2 and "unrecognized arguments: --use_vocab_extend" in capsys.readouterr().err
    # refusals exit 1 with the reason
    rc = _run_script(
        PNLP_MERGE_CLI,
        ["--model_name_or_path", tiny_model_dir, "--lora_path", pnlp["vera"][0], "--output_path", tmp_path / "v"],
    )
    assert rc == 2 and "vera_A" in capsys.readouterr().err and not (tmp_path / "v").exists()


def test_rslora_scaling(pnlp, tiny_model_dir, tmp_path):
    d, factors = pnlp["rslora"]
    res = merge_adapter_checkpoint(tiny_model_dir, d, str(tmp_path / "m"), device="cpu", log=lambda m: None)
    assert res.verify["status"] == "passed" and len(res.modules_merged) == 4
    merged, base = _read_st(str(tmp_path / "m")), _read_st(tiny_model_dir)
    _check_merged(merged, base, factors, scaling=8 / np.sqrt(4))  # 4, not alpha/r = 2
    ref = _paddlenlp_merged_weights(tiny_model_dir, d)
    assert max(float(np.abs(ref[k] - merged[k]).max()) for k in merged) <= 1e-5


# --------------------------------------------------------- forward and eval
def test_forward_equals_paddlenlp_lora_model(pnlp, tiny_model_dir):
    import paddle
    from paddlenlp.peft import LoRAModel

    d, _ = pnlp["lora"]
    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 512, size=(2, 24)))
    with paddle.no_grad():
        base = _base_model(tiny_model_dir)
        base.eval()
        ref0 = base(input_ids=ids)[0].numpy()
        lm = LoRAModel.from_pretrained(_base_model(tiny_model_dir), d)
        lm.eval()
        ref = lm(input_ids=ids)[0].numpy()
        ours = _base_model(tiny_model_dir)
        cfg = load_adapter(ours, d)
        ours.eval()
        got = ours(input_ids=ids)[0].numpy()
    assert cfg.scaling == 2.0
    assert np.abs(ref - ref0).max() > 0.5  # the adapter moves the logits
    assert np.abs(got - ref).max() <= 1e-4, np.abs(got - ref).max()


def test_eval_cli_lora_path_equals_merged_model(pnlp, tiny_model_dir, tmp_path):
    """run_finetune.py evaluates the PaddleNLP adapter (lora_path) and its merge to the same loss."""
    d, _ = pnlp["lora"]
    merged = tmp_path / "merged"
    merge_adapter_checkpoint(tiny_model_dir, d, str(merged), verify=False, log=lambda m: None)
    common = [
        "--dataset_name_or_path",
        DATA_DIR,
        "--do_train",
        "false",
        "--do_eval",
        "true",
        "--eval_before_train",
        "false",
    ]
    runs = {
        "adapter": ["--model_name_or_path", tiny_model_dir, "--lora", "true", "--lora_path", d, "--lora_rank", "4"],
        "merged": ["--model_name_or_path", merged, "--lora", "false"],
        "base": ["--model_name_or_path", tiny_model_dir, "--lora", "false"],
    }
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {
        k: subprocess.Popen(
            [sys.executable, CLI, LORA_CONFIG, "--output_dir", str(tmp_path / k), *common, *map(str, argv)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env,
        )
        for k, argv in runs.items()
    }
    logs = {k: p.communicate()[0] for k, p in procs.items()}
    for k, p in procs.items():
        assert p.returncode == 0, logs[k][-4000:]
    s = {k: json.load(open(tmp_path / k / "run_summary.json")) for k in runs}
    # r * (in + out) for q, k, v, o, gate, up, down of each of the 2 layers
    dims = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 176), (64, 176), (176, 64)]
    assert s["adapter"]["method"] == "lora" and s["adapter"]["trainable_params"] == 2 * sum(
        4 * (i + o) for i, o in dims
    )
    loss = {k: v["eval_loss"] for k, v in s.items()}
    print(f"eval loss: {loss}")
    assert loss["adapter"] == pytest.approx(loss["merged"], rel=1e-4)
    # the adapter was applied, not silently dropped: measured 7.5165 vs base 7.5299, >10x the 1e-4 tolerance above
    assert abs(loss["adapter"] - loss["base"]) > 10 * 1e-4 * loss["base"]


# ----------------------------------------------------------------- refusals
def test_vera_is_refused_everywhere(pnlp, tiny_model_dir, tmp_path):
    d, _ = pnlp["vera"]
    from paddle import load

    saved = load(os.path.join(d, "vera_model_state.pdparams"))
    assert saved and not any(k.endswith("vera_A") for k in saved)  # the premise of the refusal
    for call in (
        lambda: AdapterConfig.load(d),
        lambda: read_adapter_tensors(d),
        lambda: load_adapter(_base_model(tiny_model_dir), d),
    ):
        with pytest.raises(PaddleNLPAdapterError, match=r"vera_config\.json: PaddleNLP VeRA adapters cannot be read"):
            call()
    with pytest.raises(MergeError, match="vera_A"):
        merge_adapter_checkpoint(tiny_model_dir, d, str(tmp_path / "m"), verify=False)
    p = _config_problems(tiny_model_dir, tmp_path, {"vera": True, "lora_path": d})
    assert "PaddleNLP VeRA adapters cannot be read" in p


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "lora_config.json")
    d = json.load(open(path))
    d.update(changes)
    json.dump(d, open(path, "w"))
    return str(dst)


def _config_problems(tiny_model_dir, tmp_path, keys):
    cfg = {
        "model_name_or_path": tiny_model_dir,
        "dataset_name_or_path": DATA_DIR,
        "output_dir": str(tmp_path / "o"),
        "do_eval": True,
        **keys,
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    try:
        load_config(str(path))
    except ConfigError as e:
        return "\n".join(e.problems)
    return ""


UNSUPPORTED = [
    ("use_mora", True),
    ("lora_use_mixer", True),
    ("trainable_bias", "lora"),
    ("pissa", True),
    ("loraga", True),
    ("do_qat", True),
    ("trainable_modules", [".*embed_tokens.*"]),
    ("enable_lora_list", [[True, False, True]]),
    ("tensor_parallel_degree", "2"),
    ("use_dora", True),
    ("lora_alpha", -1),
    ("scaling", 4.0),
]


@pytest.mark.parametrize("key,value", UNSUPPORTED, ids=[k for k, _ in UNSUPPORTED])
def test_unsupported_feature_is_refused_naming_file_and_key(key, value, pnlp, tiny_model_dir, tmp_path):
    d = _edited(pnlp["lora"][0], tmp_path / "a", **{key: value})
    path = os.path.join(d, "lora_config.json")
    with pytest.raises(PaddleNLPAdapterError) as e:
        AdapterConfig.load(d)
    msg = str(e.value)
    assert msg.startswith(f"{path}: {key}=") and ("not supported" in msg or "does not match" in msg), msg
    if key in REFUSED_LORA_KEYS:
        assert REFUSED_LORA_KEYS[key] in msg
    if key == "use_mora":  # the same message at config validation (exit 2 before loading) and in the merge
        assert msg in _config_problems(tiny_model_dir, tmp_path, {"lora": True, "lora_rank": 4, "lora_path": d})
        with pytest.raises(MergeError) as m:
            merge_adapter_checkpoint(tiny_model_dir, d, str(tmp_path / "m"), verify=False)
        assert str(m.value) == msg


def test_unsupported_tensor_in_state_is_refused(pnlp, tmp_path):
    """A mixer matrix in the weights (even with a config that does not say so) is named, not skipped."""
    import paddle

    d = _edited(pnlp["lora"][0], tmp_path / "a")
    path = os.path.join(d, "lora_model_state.pdparams")
    state = paddle.load(path)
    state["llama.layers.0.self_attn.q_proj.lora_AB"] = paddle.ones([4, 4])
    paddle.save(state, path)
    with pytest.raises(
        PaddleNLPAdapterError,
        match=r"lora_model_state\.pdparams: tensor "
        r"'llama\.layers\.0\.self_attn\.q_proj\.lora_AB' is a MoSLoRA",
    ):
        read_adapter_tensors(d)


def test_config_validation_reads_paddlenlp_config(pnlp, tiny_model_dir, tmp_path):
    d, _ = pnlp["lora"]
    assert _config_problems(tiny_model_dir, tmp_path, {"lora": True, "lora_rank": 4, "lora_path": d}) == ""
    p = _config_problems(tiny_model_dir, tmp_path, {"lora": True, "lora_rank": 8, "rslora": True, "lora_path": d})
    assert "lora_rank says 8 but the adapter in lora_path was trained with 4" in p
    assert "rslora says True but the adapter in lora_path was trained with False" in p
    empty = tmp_path / "empty"
    empty.mkdir()
    p = _config_problems(tiny_model_dir, tmp_path, {"lora": True, "lora_path": str(empty)})
    assert "has no adapter_config.json (nor PaddleNLP's lora_config.json" in p


# ------------------------------------------------------------ saved per tensor-parallel rank
def _tp_split(src, dst, n, pp=False):
    """PaddleNLP's per-rank save of the adapter in ``src`` under tensor_parallel_degree n: column targets keep A
    and split B along axis 1, row targets (o_proj, down_proj) split A along axis 0 and keep B
    (ColumnParallelLoRALinear / RowParallelLoRALinear); with ``pp`` each rank's file is cut in two stages."""
    import paddle

    full = {k: v.numpy() for k, v in paddle.load(os.path.join(src, "lora_model_state.pdparams")).items()}
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "lora_model_state.pdparams":
            shutil.copy(os.path.join(src, name), dst)
    cfg = json.load(open(os.path.join(dst, "lora_config.json")))
    cfg["tensor_parallel_degree"] = n
    json.dump(cfg, open(os.path.join(dst, "lora_config.json"), "w"))
    for r in range(n):
        state = {}
        for k, v in full.items():
            row = any(t in k for t in ("o_proj", "down_proj"))
            axis = (0 if k.endswith("lora_A") else None) if row else (1 if k.endswith("lora_B") else None)
            state[k] = v if axis is None else np.split(v, n, axis=axis)[r]
        stages = (
            [dict(state)]
            if not pp
            else [
                {k: v for k, v in state.items() if ".layers.0." in k},
                {k: v for k, v in state.items() if ".layers.0." not in k},
            ]
        )
        for s, part in enumerate(stages):
            name = f"lora_model_state.tp{r:02d}_pp{s:02d}.pdparams" if pp else f"lora_model_state.tp{r:02d}.pdparams"
            paddle.save({k: paddle.to_tensor(v) for k, v in part.items()}, os.path.join(dst, name))
    return full


@pytest.mark.parametrize("n,pp", [(2, False), (4, True)])
def test_tensor_parallel_shards_are_joined(pnlp, tiny_model_dir, tmp_path, n, pp):
    """merge and lora_path read PaddleNLP's per-rank files as the complete adapter: the same merged weights."""
    from paddlenlp_ext.adapters import read_adapter_tensors

    d, factors = pnlp["lora"]
    sharded = str(tmp_path / "tp")
    full = _tp_split(d, sharded, n, pp)
    got = read_adapter_tensors(sharded)
    assert set(got) == set(full)
    for k in full:
        np.testing.assert_array_equal(got[k], full[k])
    merged = {}
    for which in (d, sharded):
        out = tmp_path / f"merged_{len(merged)}"
        merge_adapter_checkpoint(tiny_model_dir, which, str(out), verify=False)
        merged[which] = _read_st(str(out))
    assert all(np.array_equal(merged[d][k], merged[sharded][k]) for k in merged[d])


def test_tensor_parallel_shards_refusals(pnlp, tmp_path):
    import paddle

    from paddlenlp_ext.adapters import read_adapter_tensors

    d, _ = pnlp["lora"]
    sharded = str(tmp_path / "tp")
    _tp_split(d, sharded, 2)
    os.remove(os.path.join(sharded, "lora_model_state.tp00.pdparams"))
    with pytest.raises(PaddleNLPAdapterError, match=r"ranks \[1\] are not 0..0"):
        read_adapter_tensors(sharded)
    bad = str(tmp_path / "bad")
    _tp_split(d, bad, 2)
    path = os.path.join(bad, "lora_model_state.tp01.pdparams")
    state = paddle.load(path)
    key = next(k for k in state if "q_proj.lora_A" in k)  # replicated on column targets
    state[key] = state[key] + 1.0
    paddle.save(state, path)
    with pytest.raises(PaddleNLPAdapterError, match=rf"{re.escape(key)} should be the same on every"):
        read_adapter_tensors(bad)
    cfg = json.load(open(os.path.join(bad, "lora_config.json")))
    cfg["tensor_parallel_degree"] = 4
    json.dump(cfg, open(os.path.join(bad, "lora_config.json"), "w"))
    with pytest.raises(PaddleNLPAdapterError, match="2 tensor-parallel rank files but lora_config.json says"):
        read_adapter_tensors(bad)


def test_tensor_parallel_split_rules():
    import doctest

    from paddlenlp_ext.adapters import paddlenlp_tp

    assert doctest.testmod(paddlenlp_tp, verbose=False).failed == 0
    with pytest.raises(PaddleNLPAdapterError, match="fused projection"):
        paddlenlp_tp.split_axis("llama.layers.0.self_attn.qkv_proj.lora_B")
    with pytest.raises(PaddleNLPAdapterError, match="does not know how PaddleNLP splits 'lm_head'"):
        paddlenlp_tp.split_axis("lm_head.lora_B")


def test_pipeline_stage_files_are_read_together(pnlp, tmp_path):
    """PaddleNLP's LoRA saved under pipeline parallel: lora_model_state.ppXX.pdparams, one per stage."""
    import paddle

    d, _ = pnlp["lora"]
    full = {k: v.numpy() for k, v in paddle.load(os.path.join(d, "lora_model_state.pdparams")).items()}
    staged = tmp_path / "pp"
    shutil.copytree(d, staged)
    os.remove(staged / "lora_model_state.pdparams")
    for s, part in enumerate(
        ({k: v for k, v in full.items() if ".layers.0." in k}, {k: v for k, v in full.items() if ".layers.0." not in k})
    ):
        paddle.save(
            {k: paddle.to_tensor(v) for k, v in part.items()}, str(staged / f"lora_model_state.pp{s:02d}.pdparams")
        )
    got = read_adapter_tensors(str(staged))
    assert set(got) == set(full) and all(np.array_equal(got[k], full[k]) for k in full)
