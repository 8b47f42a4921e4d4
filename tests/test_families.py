"""The model-family table (paddlenlp_ext/models/family_table.py): its facts and the config-time refusals.

The targets are checked against tiny models built with PaddleNLP's own classes; the refusals through
``load_config`` (and one through the CLI: exit 2, nothing loaded, no traceback).
"""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import DATA_DIR, ROOT
from family_models import TINY_FAMILIES

from paddlenlp_ext.config.parse import ConfigError, load_config
from paddlenlp_ext.models.family_table import FAMILIES, UNLISTED_ENV, feature_problem, hf_layout_problem, row
from paddlenlp_ext.models.targets import NEVER_TARGET_PARTS, decoder_linear_targets

#: the causal-LM model_types of PaddleNLP 3.0.0b4 (paddlenlp.transformers.*ForCausalLM, the encoder-only ones aside)
PADDLENLP_DECODERS = {
    "bloom",
    "chatglm",
    "chatglm_v2",
    "codegen",
    "deepseek_v2",
    "deepseek_v3",
    "gpt",
    "gptj",
    "gemma",
    "jamba",
    "llama",
    "mamba",
    "mistral",
    "mixtral",
    "opt",
    "qwen",
    "qwen2",
    "qwen2_moe",
    "rw",
    "yuan",
}


def test_every_paddlenlp_decoder_family_has_a_row():
    decoder_rows = {k for k, f in FAMILIES.items() if f.decoder}  # our decoder's rows (models/decoder)
    assert decoder_rows == {
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "glm4",
        "ernie4_5",
        "olmo2",
        "smollm3",
        "mixtral",
        "qwen2_moe",
        "ernie4_5_moe",
        "deepseek_v2",
        "deepseek_v3",
        "gpt_oss",
    }  # the last six: MoE rows (docs/moe.md)
    # + our own families, and gpt_oss (not a PaddleNLP family)
    assert PADDLENLP_DECODERS | {"qwen3", "qwen3_moe"} | decoder_rows == set(FAMILIES)
    trainable = {k for k, f in FAMILIES.items() if f.refused is None}
    assert (
        trainable
        == {"llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma", "chatglm_v2", "qwen", "gpt", "opt", "codegen"}
        | decoder_rows
    )
    for f in FAMILIES.values():  # a packing family must be able to express the packed mask and positions
        if f.supports("packing"):
            assert "position_ids" in f.masks and ("dense" in f.masks or "startend" in f.masks), f.model_type
        if f.supports("flash_mask"):
            assert "startend" in f.masks, f.model_type
        if f.shifts_labels:  # our labels are already shifted: such a family never packs (no positions either)
            assert not f.supports("packing") and not f.supports("dpo"), f.model_type


@pytest.mark.parametrize(
    "family, n",
    [
        ("mistral", 14),
        ("gemma", 14),
        ("chatglm_v2", 8),
        ("qwen", 10),
        ("bloom", 8),
        ("gpt", 12),
        ("opt", 12),
        ("codegen", 8),
    ],
)
def test_targets_match_every_decoder_linear_and_nothing_else(family, n):
    import paddle
    import paddlenlp.transformers as T

    config_cls, model_cls, sizes = TINY_FAMILIES[family]
    model = getattr(T, model_cls)(getattr(T, config_cls)(vocab_size=64, **{**sizes, "num_hidden_layers": 2}))
    linears = [name for name, layer in model.named_sublayers() if isinstance(layer, paddle.nn.Linear)]
    hit = [
        name
        for name in linears
        if any(re.fullmatch(p, name) for p in decoder_linear_targets(family))
        and not any(part in name for part in NEVER_TARGET_PARTS)
    ]
    assert len(hit) == n, (hit, linears)
    assert all(re.search(r"\.(layers|h)\.\d+\.", name) for name in hit)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_every_decoder_linear_gets_a_gradient_unless_the_family_is_refused(family):
    """A backward through PaddleNLP's forward reaches every target Linear's weight; bloom's does not (refused)."""
    import numpy as np
    import paddle
    import paddlenlp.transformers as T

    config_cls, model_cls, sizes = TINY_FAMILIES[family]
    paddle.seed(0)
    model = getattr(T, model_cls)(getattr(T, config_cls)(vocab_size=64, **{"initializer_range": 0.2, **sizes}))
    ids = paddle.to_tensor(np.random.RandomState(0).randint(3, 60, (1, 8)))
    (model(input_ids=ids, return_dict=True).logits ** 2).mean().backward()  # [1, 8, 64] -> []
    targets = decoder_linear_targets(family)
    zero = [
        n
        for n, layer in model.named_sublayers()
        if isinstance(layer, paddle.nn.Linear)
        and any(re.fullmatch(p, n) for p in targets)
        and float(layer.weight.grad.abs().max()) == 0.0
    ]
    if family == "bloom":
        assert len(zero) == 8 and row("bloom").refused  # every block weight: the reason bloom is refused
    else:
        assert zero == []


def model_dir(tmp_path, model_type, **extra):
    d = tmp_path / f"m_{model_type}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": model_type, **extra}), encoding="utf-8")
    return str(d)


def load(tmp_path, model_type, *overrides, mode="sft"):
    args = [
        "--model_name_or_path",
        model_dir(tmp_path, model_type),
        "--output_dir",
        str(tmp_path / "out"),
        *map(str, overrides),
    ]
    if mode == "sft":
        args = ["--dataset_name_or_path", DATA_DIR, "--do_train", "true", *args]
    return load_config(None, args, mode=mode)


def problems(tmp_path, model_type, *overrides, mode="sft"):
    try:
        load(tmp_path, model_type, *overrides, mode=mode)
    except ConfigError as e:
        return e.problems
    return []


@pytest.mark.parametrize("family", ["mistral", "gemma", "chatglm_v2", "qwen", "gpt"])
def test_dense_families_take_lora_full_qlora_packing(tmp_path, family):
    assert problems(tmp_path, family, "--lora", "true", "--zero_padding", "true") == []
    assert problems(tmp_path, family, "--zero_padding", "true") == []  # full fine-tuning
    assert problems(tmp_path, family, "--lora", "true", "--weight_quantize_algo", "nf4") == []


@pytest.mark.parametrize(
    "family, overrides, needles",
    [
        (
            "qwen",
            ["--use_flash_attention", "true", "--flash_mask", "true"],
            ["qwen models do not take FlashMask start rows", "set flash_mask=false"],
        ),
        (
            "chatglm_v2",
            ["--use_flash_attention", "true"],
            [
                "with use_flash_attention=true chatglm_v2 models ignore the attention mask",
                "set use_flash_attention=false",
            ],
        ),
        (
            "opt",
            ["--use_flash_attention", "true"],
            ["opt models: use_flash_attention", "set use_flash_attention=false"],
        ),
        (
            "opt",
            ["--lora", "true", "--zero_padding", "true"],
            ["opt models build their own causal mask", "set zero_padding=false"],
        ),
        ("gpt", ["--lora", "true", "--tensor_parallel_degree", "2"], ["gpt models", "set tensor_parallel_degree=1"]),
        ("bloom", ["--lora", "true"], ["bloom blocks pass no gradient to their weights"]),
        ("chatglm_v2", ["--pipeline_parallel_degree", "2"], ["chatglm_v2 models", "set pipeline_parallel_degree=1"]),
        (
            "qwen3_moe",
            ["--pipeline_parallel_degree", "2"],
            ["qwen3_moe checkpoints in PaddleNLP's layout (models/qwen3) have no pipeline model", "--format hf"],
        ),
        (
            "codegen",
            ["--lora", "true", "--zero_padding", "true"],
            ["codegen models take no position_ids", "set zero_padding=false"],
        ),
        ("yuan", [], ["yuan builds its own attention mask from eod_token"]),
        ("jamba", [], ["MoE code on Paddle 3.3", "its MoE routing"]),
        ("gptj", [], ["Auto classes cannot build gptj"]),
        ("chatglm", [], ["prefix-LM"]),
        ("falcon", [], ["model_type 'falcon' is not in the model-family table", UNLISTED_ENV]),
    ],
)
def test_refused_at_config_time_naming_family_and_key(tmp_path, family, overrides, needles):
    found = problems(tmp_path, family, *overrides)
    text = "\n".join(map(str, found))
    assert all(n in text for n in needles), text
    assert family in text


def test_a_refused_family_is_one_problem_not_one_per_feature(tmp_path):
    found = problems(tmp_path, "jamba", "--lora", "true", "--zero_padding", "true", "--weight_quantize_algo", "nf4")
    assert len([p for p in found if "jamba" in str(p)]) == 1


def test_unlisted_model_type_needs_the_explicit_opt_in(tmp_path, monkeypatch):
    assert problems(tmp_path, "falcon", "--lora", "true")
    monkeypatch.setenv(UNLISTED_ENV, "1")
    assert problems(tmp_path, "falcon", "--lora", "true") == []
    # the generic row refuses what it cannot know: FlashMask, QLoRA, TP, PP
    text = "\n".join(map(str, problems(tmp_path, "falcon", "--lora", "true", "--weight_quantize_algo", "nf4")))
    assert "model_type 'falcon' (not in the table)" in text and "remove weight_quantize_algo" in text


def test_config_without_model_type_is_refused(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ConfigError, match="has no model_type"):
        load_config(
            None,
            [
                "--model_name_or_path",
                str(d),
                "--dataset_name_or_path",
                DATA_DIR,
                "--do_train",
                "true",
                "--output_dir",
                str(tmp_path / "o"),
            ],
        )


def test_dpo_is_refused_on_families_not_verified_for_it(tmp_path):
    assert feature_problem("llama", "dpo") is None and feature_problem("mistral", "dpo") is None
    assert "gpt models apply dropout in training" in feature_problem("gpt", "dpo")
    assert "preference training (llm/run_dpo.py) is not verified" in feature_problem("opt", "dpo")
    dpo = tmp_path / "dpo"
    dpo.mkdir()
    row_json = json.dumps({"src": ["q"], "tgt": [], "response": ["a", "b"], "sort": [1, 0]})
    (dpo / "train.jsonl").write_text(row_json + "\n")
    text = "\n".join(map(str, problems(tmp_path, "opt", "--train_dataset_path", str(dpo / "train.jsonl"), mode="dpo")))
    assert "opt models: preference training" in text


def test_hf_layout_flag_is_set_for_the_families_the_loader_reads():
    # transformers' layout is what the decoder rows load from (qwen3_moe's: its hf_row, family_table.layout_row)
    decoder_rows = {k for k, f in FAMILIES.items() if f.decoder or (f.hf_row is not None and f.hf_row.decoder)}
    assert {k for k, f in FAMILIES.items() if f.hf_layout} == {"llama", "qwen2", "qwen3"} | decoder_rows
    assert hf_layout_problem("qwen2") is None and hf_layout_problem("gemma") is None
    assert "convert_from_torch=True" in hf_layout_problem("qwen")


def test_table_drives_targets_dropout_pipeline_and_planner(tmp_path):
    from paddlenlp_ext.models.dropout import dropout_problem
    from paddlenlp_ext.planner.shapes import PlanError, read_model_shape
    from paddlenlp_ext.training.model_build import PIPELINE_CLASSES, decoder_pipeline_row

    assert decoder_linear_targets("qwen") == list(row("qwen").targets)
    # no family trains on PaddleNLP's *ForCausalLMPipe any more: llama, qwen2 and qwen3 run as the decoder's stages
    assert PIPELINE_CLASSES == {}
    assert all(decoder_pipeline_row(k) and feature_problem(k, "pp") is None for k in ("llama", "qwen2", "qwen3"))
    assert dropout_problem("qwen2", "attention_probs_dropout_prob", 0.1, flash=False) is None
    assert dropout_problem("qwen", "hidden_dropout_prob", 0.1, flash=False)  # no such field verified: refused
    assert dropout_problem("gpt", "hidden_dropout_prob", 0.1, flash=False) is None  # GPT reads it itself
    # gemma: explicit head_dim (q width heads x head_dim, not hidden_size)
    gemma = read_model_shape(
        model_dir(
            tmp_path,
            "gemma",
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=512,
            tie_word_embeddings=True,
        )
    )
    assert (
        ("self_attn.q_proj", 64, 128) in gemma.layer_linears()
        and ("self_attn.o_proj", 128, 64) in gemma.layer_linears()
        and ("self_attn.k_proj", 64, 32) in gemma.layer_linears()
    )
    qwen3 = read_model_shape(
        model_dir(
            tmp_path,
            "qwen3",
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=512,
        )
    )
    assert qwen3.layer_other_params == 2 * 64 + 2 * 32  # two RMSNorms + q/k norms of head_dim
    with pytest.raises(PlanError, match="Llama-layout families"):
        read_model_shape(
            model_dir(
                tmp_path,
                "gpt",
                hidden_size=64,
                intermediate_size=176,
                num_hidden_layers=2,
                num_attention_heads=4,
                vocab_size=512,
            )
        )


def test_cli_refusal_exits_2_before_loading(tmp_path):
    d = model_dir(tmp_path, "jamba")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "llm", "run_finetune.py"),
            os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json"),
            "--model_name_or_path",
            d,
            "--output_dir",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "nothing was loaded" in r.stderr and "jamba" in r.stderr and "model_name_or_path" in r.stderr


def test_docs_models_md_is_current():
    """docs/models.md's table is the family table's (regenerate: python llm/tools/models_doc.py)."""
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "llm", "tools", "models_doc.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


def test_predictor_refuses_a_refused_family(tmp_path):
    from paddlenlp_ext.predict.options import PredictOptions, check_options

    prompts = tmp_path / "p.json"
    prompts.write_text('{"src": "hi"}\n', encoding="utf-8")
    _, found, _ = check_options(PredictOptions(model_dir(tmp_path, "jamba"), data_file=str(prompts)))
    assert any("jamba" in p and "MoE" in p for p in found), found
    _, found, _ = check_options(PredictOptions(model_dir(tmp_path, "mistral"), data_file=str(prompts)))
    assert not any("mistral" in p for p in found), found


def test_hf_layout_checkpoint_of_a_family_the_loader_does_not_read_is_refused(tmp_path):
    """qwen (v1) in transformers layout (model.layers.N... names) is refused before loading; its PaddleNLP layout is not."""
    import numpy as np
    from safetensors.numpy import save_file

    def write(d, prefix):
        save_file(
            {
                f"{prefix}.layers.0.self_attn.q_proj.weight": np.zeros((4, 4), "float32"),
                f"{prefix}.embed_tokens.weight": np.zeros((8, 4), "float32"),
            },
            str(d / "model.safetensors"),
        )

    hf = tmp_path / "m_qwen"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen"}), encoding="utf-8")
    write(hf, "model")
    text = "\n".join(map(str, problems(tmp_path, "qwen", "--lora", "true")))
    assert (
        "qwen: Hugging Face (transformers-layout) checkpoints are read for deepseek_v2, deepseek_v3, ernie4_5, "
        "ernie4_5_moe, gemma, gemma2"
    ) in text
    assert "gpt_oss, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, smollm3 only" in text
    write(hf, "qwen")
    assert problems(tmp_path, "qwen", "--lora", "true") == []


def test_codegen_never_gets_our_shifted_labels():
    """codegen's forward shifts labels again; the run's eval loss is computed from its logits instead."""
    import numpy as np
    import paddle
    import paddle.nn.functional as F
    import paddlenlp.transformers as T

    from paddlenlp_ext.training.loss import shifts_labels_itself, token_mean_loss

    config_cls, model_cls, sizes = TINY_FAMILIES["codegen"]
    paddle.seed(0)
    model = getattr(T, model_cls)(getattr(T, config_cls)(vocab_size=64, **sizes))
    model.eval()
    ids = paddle.to_tensor(np.random.RandomState(0).randint(3, 60, (2, 7)))
    labels = paddle.concat([ids[:, 1:], paddle.full([2, 1], -100, dtype=ids.dtype)], axis=1)  # position i -> t+1
    loss, _ = token_mean_loss(model, {"input_ids": ids, "labels": labels})
    logits = model(input_ids=ids, return_dict=True).logits  # [2, 7, 64]
    ref = F.cross_entropy(logits[:, :-1].reshape([-1, 64]), labels[:, :-1].reshape([-1, 1]))  # 12 tokens
    assert abs(float(loss) - float(ref)) < 1e-5
    own = model(input_ids=ids, labels=labels, return_dict=True).loss  # its own shift: predicts t+2
    assert abs(float(own) - float(ref)) > 1e-2
    assert shifts_labels_itself(model)


def test_qwen3_moe_targets_attention_and_experts_never_the_router():
    """The router's logits pick the experts: it is neither adapted nor quantized."""
    import re

    from paddlenlp_ext.models.targets import decoder_linear_targets

    names = [
        "qwen3_moe.layers.0.self_attn.q_proj",
        "qwen3_moe.layers.0.self_attn.o_proj",
        "qwen3_moe.layers.1.mlp.experts.3.down_proj",
        "qwen3_moe.layers.0.mlp.gate_proj",
        "qwen3_moe.layers.1.mlp.gate",
        "qwen3_moe.layers.0.self_attn.q_norm",
        "lm_head",
    ]
    hit = [n for n in names if any(re.fullmatch(p, n) for p in decoder_linear_targets("qwen3_moe"))]
    assert hit == names[:4]


def test_lora_on_gpt_oss_fused_experts_is_refused_naming_the_key(tmp_path):
    """gpt_oss' experts are 3-D parameters (no Linear to wrap): a lora_target_modules pattern reaching them is
    refused at config time; attention patterns are not."""
    found = problems(
        tmp_path, "gpt_oss", "--lora", "true", "--lora_target_modules", ".*self_attn.q_proj,.*mlp.experts.*"
    )
    text = "\n".join(map(str, found))
    assert "lora_target_modules" in text and "'.*mlp.experts.*'" in text and "fused experts" in text, text
    assert "q_proj'" not in text
    assert problems(tmp_path, "gpt_oss", "--lora", "true", "--lora_target_modules", ".*self_attn.q_proj") == []
    assert problems(tmp_path, "gpt_oss", "--lora", "true") == []
