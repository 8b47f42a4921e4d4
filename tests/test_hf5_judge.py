"""Checkpoints saved by transformers 5.x (and 4.x) against the transformers that wrote them.

transformers 5.24 (its own venv, tests/hf5_judge.py) builds and saves each random checkpoint with
its own config spelling (``rope_parameters``, ``layer_types``, ``dtype``) and computes the reference
logits and greedy tokens; the same models saved by the project's transformers 4.55 (old spelling)
are judged by 4.55 in-process.  Our model must match within 1e-4 (fp32) with 20 identical greedy
tokens from the predictor's generation code; the HF export of each must load in both versions to
our logits.
"""

import os

import numpy as np
import paddle
import pytest

from hf5_judge import judge
from hf_models import TINY, save_hf_model
from paddlenlp_ext.models.loading import load_model_streaming
from paddlenlp_ext.models.model_config import load_model_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = np.array([[1, 17, 250, 3, 99, 42, 7, 300, 12, 5, 64, 128], [2, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 319]])  # [2, 12]
EOS, PROMPT, NEW = 319, [1, 17, 250, 3, 99, 42], 20

#: case -> (family, 5.x config kwargs, the same model in 4.x kwargs)
CASES = {
    "llama": (
        "llama",
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        dict(
            tie=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "qwen2": (
        "qwen2",
        dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        dict(tie=True, rope_theta=1e6),
    ),
    "qwen3": ("qwen3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), dict(rope_theta=1e6)),
    "mistral": (
        "mistral",
        dict(
            sliding_window=128,
            layer_types=["sliding_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        dict(sliding_window=128, rope_theta=1e6),
    ),
    "qwen2_window": (
        "qwen2",
        dict(
            use_sliding_window=True,
            sliding_window=128,
            max_window_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        dict(tie=True, use_sliding_window=True, sliding_window=128, max_window_layers=1, rope_theta=1e6),
    ),
}
NAMES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}


def ours(d):
    from paddlenlp_ext.models.registration import register_qwen3

    register_qwen3()
    return load_model_streaming(d, load_model_config(d, dtype="float32"), "float32", None, max_seq_len=64)[0]


def our_logits(model):
    model.eval()
    with paddle.no_grad():
        out = model(input_ids=paddle.to_tensor(IDS))
    return (out[0] if isinstance(out, tuple) else out.logits).astype("float32").numpy()


def our_greedy(model):
    from paddlenlp_ext.predict.generate import generate_batch
    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.predict.prompts import Prompt

    opts = PredictOptions(model_name_or_path="unused", decode_strategy="greedy_search", max_length=64)
    return generate_batch(model, [Prompt(PROMPT, NEW)], opts, [EOS], 0)[0]


def run_hf5(model_dirs, work):
    """{name: (logits, judge result)} of transformers 5.x for each {name: model_dir}, in one judge process."""
    np.save(os.path.join(work, "ids.npy"), IDS)
    names = list(model_dirs)
    jobs = [
        [
            "run",
            dict(
                model_dir=model_dirs[n],
                ids=os.path.join(work, "ids.npy"),
                logits_out=os.path.join(work, f"logits_{i}.npy"),
                prompt=PROMPT,
                max_new_tokens=NEW,
                eos=EOS,
            ),
        ]
        for i, n in enumerate(names)
    ]
    out = {}
    for i, (n, res) in enumerate(zip(names, judge("batch", work, jobs=jobs))):
        greedy = res["greedy"]
        res["greedy"] = greedy[: greedy.index(EOS)] if EOS in greedy else greedy
        out[n] = (np.load(os.path.join(work, f"logits_{i}.npy")), res)
    return out


def run_hf4(model_dir):
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor(IDS)).logits.numpy()
        out = ref.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    greedy = out[0, len(PROMPT) :].tolist()
    return logits, (greedy[: greedy.index(EOS)] if EOS in greedy else greedy)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hf5")


@pytest.fixture(scope="module")
def hf5_dirs(work):
    """case -> a checkpoint saved by transformers 5.x with its own config spelling."""
    out = {case: str(work / f"hf5_{case}") for case in CASES}
    jobs = [
        [
            "save",
            dict(
                config_class=f"{NAMES[f]}Config",
                model_class=f"{NAMES[f]}ForCausalLM",
                config={**TINY, **kw5},
                out_dir=out[case],
            ),
        ]
        for case, (f, kw5, _) in CASES.items()
    ]
    out["llama_bf16"] = str(work / "hf5_llama_bf16")  # bf16, sharded: 5.x's index and dtype keys
    jobs.append(["save", dict(jobs[0][1], out_dir=out["llama_bf16"], dtype="bfloat16", max_shard_size="60KB")])
    judge("batch", str(work), jobs=jobs)
    return out


@pytest.fixture(scope="module")
def hf4_dirs(work):
    """case -> the same kind of model saved by the project's transformers 4.55 (old spelling)."""
    out = {}
    for case, (family, _, kw4) in CASES.items():
        kw4 = dict(kw4)
        tie = kw4.pop("tie", None)
        out[case] = save_hf_model(str(work / f"hf4_{case}"), family, tie=tie, **kw4)
    return out


@pytest.fixture(scope="module")
def exported(hf5_dirs, work):
    """case -> the HF export of the 5.x checkpoint (export_hf_model)."""
    from paddlenlp_ext.export import export_hf_model

    return {
        case: export_hf_model(hf5_dirs[case], str(work / f"export_{case}"), log=lambda *a: None).output_dir
        for case in ("llama", "qwen2", "qwen3", "mistral")
    }


@pytest.fixture(scope="module")
def merged(hf5_dirs, work):
    """A LoRA adapter (random non-zero B) on the 5.x llama, merged by the verified streaming merge into
    PaddleNLP's layout, and that merged model exported; (our adapter model's logits, merged dir, export dir)."""
    from paddlenlp_ext.adapters import apply_adapters, iter_adapter_layers, save_adapter
    from paddlenlp_ext.adapters.config import adapter_config_from_args
    from paddlenlp_ext.export import export_hf_model
    from paddlenlp_ext.merge import merge_adapter_checkpoint

    base = hf5_dirs["llama"]
    model = ours(base)
    cfg = adapter_config_from_args({"model_type": "llama", "lora": True, "lora_rank": 4})
    apply_adapters(model, cfg)
    rng = np.random.default_rng(0)
    for _, layer in iter_adapter_layers(model):
        for t in layer.adapter_state_dict().values():
            t.set_value(paddle.to_tensor(rng.normal(0, 0.1, size=t.shape).astype(np.float32)))
    adapter = str(work / "adapter")
    save_adapter(model, cfg, adapter)
    want = our_logits(model)
    out = str(work / "merged")
    res = merge_adapter_checkpoint(base, adapter, out, verify=True, device="cpu", log=lambda *a: None)
    assert not res.verify_failed
    return want, out, export_hf_model(out, str(work / "merged_export"), log=lambda *a: None).output_dir


@pytest.fixture(scope="module")
def hf5(hf5_dirs, hf4_dirs, exported, merged, work):
    """transformers 5.x's logits and greedy tokens on every directory above, in one judge process."""
    dirs = {
        **{("5", c): d for c, d in hf5_dirs.items()},
        **{("4", c): d for c, d in hf4_dirs.items()},
        **{("export", c): d for c, d in exported.items()},
        ("merged_export", "llama"): merged[2],
    }
    keys = list(dirs)
    res = run_hf5({str(i): dirs[k] for i, k in enumerate(keys)}, str(work))
    return {k: res[str(i)] for i, k in enumerate(keys)}


@pytest.mark.parametrize("case", list(CASES) + ["llama_bf16"])
def test_checkpoint_saved_by_transformers5_matches_transformers5(hf5_dirs, hf5, case):
    import json

    d = hf5_dirs[case]
    raw = json.load(open(os.path.join(d, "config.json")))
    assert raw["transformers_version"].startswith("5.") and "rope_parameters" in raw and "rope_theta" not in raw
    assert raw["dtype"] == ("bfloat16" if case == "llama_bf16" else "float32") and "torch_dtype" not in raw
    if case == "llama_bf16":
        assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) >= 2
    model = ours(d)
    want, res = hf5[("5", case)]
    np.testing.assert_allclose(our_logits(model), want, atol=1e-4, rtol=0)
    got = our_greedy(model)
    assert len(got) == NEW and got == res["greedy"]
    if case == "mistral":  # 5.x reads a mistral config with layer_types as ministral: per-layer windows
        assert res["class"] == "MinistralForCausalLM" and res["layer_types"] == ["sliding_attention"] * 2
    theta = float(raw["rope_parameters"]["rope_theta"])
    assert float(model.config.rope_theta) == theta != 10000.0


def test_paddlenlp_alone_misreads_the_5x_config(hf5_dirs, hf5):
    """The check above can fail: PaddleNLP's AutoConfig on its own runs llama at theta 10000, no scaling."""
    from paddlenlp.transformers import AutoConfig

    d = hf5_dirs["llama"]
    wrong = load_model_streaming(d, AutoConfig.from_pretrained(d, dtype="float32"), "float32", None, max_seq_len=64)[0]
    assert np.abs(our_logits(wrong) - hf5[("5", "llama")][0]).max() > 1e-2


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_saved_by_transformers4_matches_4_and_5(hf4_dirs, hf5, case):
    d = hf4_dirs[case]
    model = ours(d)
    want4, greedy4 = run_hf4(d)
    ours_logits = our_logits(model)
    np.testing.assert_allclose(ours_logits, want4, atol=1e-4, rtol=0)
    got = our_greedy(model)
    assert len(got) == NEW and got == greedy4
    np.testing.assert_allclose(ours_logits, hf5[("4", case)][0], atol=1e-4, rtol=0)  # 5.x reads the old spelling


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "mistral"])
def test_hf_export_of_a_5x_checkpoint_loads_in_4_and_5(hf5_dirs, exported, hf5, case):
    import json

    want = our_logits(ours(hf5_dirs[case]))
    out = exported[case]
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"] != 10000.0
    np.testing.assert_allclose(hf5[("export", case)][0], want, atol=1e-4, rtol=0)
    got4, _ = run_hf4(out)
    np.testing.assert_allclose(got4, want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(our_logits(ours(out)), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("style", ["qwen2", "llama3"])
def test_tokenizer_saved_by_transformers5_encodes_as_5x(style, tmp_path):
    """5.x writes tokenizer_config.json with ``tokenizer_class: TokenizersBackend`` (generic fast class),
    no special_tokens_map.json and ``extra_special_tokens`` as a list."""
    import json

    from hf_tokenizers import CHINESE, build
    from paddlenlp_ext.models.tokenizer import load_tokenizer

    src, dst = str(tmp_path / "t4"), str(tmp_path / "t5")
    build(src, style)
    texts = ["hello <|x1|> world<|x2|>", "type#shirt*color#red <|x2|>"] + CHINESE
    res = judge("tokenizer", str(tmp_path), src=src, dst=dst, extra=["<|x1|>", "<|x2|>"], texts=texts)
    cfg = json.load(open(os.path.join(dst, "tokenizer_config.json")))
    assert cfg["extra_special_tokens"] == ["<|x1|>", "<|x2|>"]
    tok = load_tokenizer(dst)
    assert [tok(t)["input_ids"] for t in texts] == res["ids"]
    assert [tok.decode(i, skip_special_tokens=True) for i in res["ids"]] == res["decoded"]
    assert {"<|x1|>", "<|x2|>"} <= set(tok.all_special_tokens)


def test_merged_and_saved_paddlenlp_checkpoints_keep_the_rope(hf5_dirs, merged, hf5, tmp_path):
    """The merge of a 5.x base and a PaddleNLP save_pretrained (what full fine-tuning writes) carry
    the RoPE in the spelling PaddleNLP's own loader reads: its from_pretrained alone gets our logits."""
    import json

    from paddlenlp.transformers import AutoModelForCausalLM

    want, merged_dir, exported_dir = merged
    cfg = json.load(open(os.path.join(merged_dir, "config.json")))
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert "rope_parameters" not in cfg
    alone = AutoModelForCausalLM.from_pretrained(merged_dir, dtype="float32")
    np.testing.assert_allclose(our_logits(alone), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(hf5[("merged_export", "llama")][0], want, atol=1e-4, rtol=0)

    model = ours(hf5_dirs["llama"])
    base_logits = our_logits(model)
    model.save_pretrained(str(tmp_path / "saved"))
    saved = json.load(open(tmp_path / "saved" / "config.json"))
    assert saved["rope_theta"] == 500000.0 and saved["rope_scaling"]["factor"] == 8.0
    assert "rope_parameters" not in saved
    alone = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype="float32")
    np.testing.assert_allclose(our_logits(alone), base_logits, atol=1e-5, rtol=0)
