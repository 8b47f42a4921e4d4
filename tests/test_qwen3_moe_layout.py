"""qwen3_moe by checkpoint layout: transformers' layout trains on the decoder's MoE row, PaddleNLP's on models/qwen3.

``family_table.layout_row`` picks the row (``Family.hf_row``); the config checks, the streaming loader (hence
training, the predictor, the merge's verification) and the HF export read it.  Judged here, fast, on tiny models:
the config-time answers differ by layout (the aux loss is taken on transformers' layout, refused on PaddleNLP's,
naming the key); the loader builds the decoder for transformers' layout and models/qwen3 for PaddleNLP's, each
with transformers' logits; a decoder MoE model is never split into body + lm_head (which would drop its aux loss).
"""

import numpy as np
import paddle
import pytest

from conftest import ROOT
from paddlenlp_ext.config.parse import ConfigError, load_config
from paddlenlp_ext.models.family_table import feature_problem, layout_row

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

KW = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=128,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=2,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)
IDS = np.array([[1, 17, 50, 3, 99, 42, 7, 100, 12, 5], [5, 9, 8, 7, 6, 5, 4, 3, 2, 1]])  # [2, 10]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """(transformers' Qwen3MoeForCausalLM at random weights, the directory its save_pretrained wrote)."""
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**KW)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp("qwen3_moe_hf"))
    hf.save_pretrained(path)
    return hf, path


def _problems(path, *overrides):
    try:
        load_config(
            f"{ROOT}/llm/config/tiny/lora_argument.json",
            ["--model_name_or_path", path, "--output_dir", f"{path}/out", *map(str, overrides)],
        )
    except ConfigError as e:
        return e.problems
    return []


def test_the_row_follows_the_layout():
    assert not layout_row("qwen3_moe").decoder and layout_row("qwen3_moe", hf_layout=True).decoder
    assert layout_row("qwen3_moe", hf_layout=True).arch == layout_row("qwen3_moe").arch  # one architecture row
    assert "PaddleNLP layout" in feature_problem("qwen3_moe", "predict")
    assert feature_problem("qwen3_moe", "predict", hf_layout=True) is None
    assert feature_problem("qwen3_moe", "merge", hf_layout=True) is None


def test_config_time_answers_differ_by_layout(hf_dir, tiny_qwen3_moe_dir):
    _, path = hf_dir
    assert _problems(path, "--router_aux_loss_coef", "0.01", "--freeze_router", "true") == []
    got = _problems(tiny_qwen3_moe_dir, "--router_aux_loss_coef", "0.01")
    assert len(got) == 1 and "router_aux_loss_coef=0.01" in got[0] and "models/qwen3" in got[0], got


def test_loader_builds_the_decoder_for_transformers_layout_and_qwen3_for_paddlenlp(hf_dir, tiny_qwen3_moe_dir):
    from paddlenlp.transformers import AutoConfig

    from paddlenlp_ext.models.registration import register_qwen3
    from paddlenlp_ext.models.decoder.modeling import DecoderForCausalLM
    from paddlenlp_ext.models.heads import split_lm_head
    from paddlenlp_ext.models.loading import load_model_streaming
    from paddlenlp_ext.models.qwen3 import Qwen3MoeForCausalLM

    register_qwen3()
    hf, path = hf_dir
    ours, stats = load_model_streaming(path, AutoConfig.from_pretrained(path), "float32")
    assert isinstance(ours, DecoderForCausalLM) and stats["layout"] == "transformers"
    assert split_lm_head(ours) is None  # its forward adds the aux loss: never body + lm_head apart
    ours.eval()
    with paddle.no_grad():
        got = ours(input_ids=paddle.to_tensor(IDS)).logits.numpy()
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    paddle_layout, stats = load_model_streaming(
        tiny_qwen3_moe_dir, AutoConfig.from_pretrained(tiny_qwen3_moe_dir), "float32"
    )
    assert type(paddle_layout) is Qwen3MoeForCausalLM and stats["layout"] == "paddlenlp"
    assert split_lm_head(paddle_layout) is not None  # unchanged: models/qwen3 has no aux loss to drop


def test_paddlenlp_layout_checkpoint_exports_to_transformers(tiny_qwen3_moe_dir, tmp_path):
    """models/qwen3's own checkpoint -> llm/tools/export.py --format hf's function -> transformers gives its logits
    (the way from PaddleNLP's layout onto the decoder's row: the export is in transformers' layout)."""
    from paddlenlp.transformers import AutoModelForCausalLM

    from paddlenlp_ext.export import export_hf_model
    from paddlenlp_ext.models.registration import register_qwen3

    register_qwen3()
    export_hf_model(tiny_qwen3_moe_dir, str(tmp_path / "hf"), log=lambda *a: None)
    ours = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype="float32")
    ours.eval()
    with paddle.no_grad():
        got = ours(paddle.to_tensor(IDS))[0].numpy()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        np.testing.assert_allclose(got, theirs(torch.tensor(IDS)).logits.numpy(), atol=1e-4, rtol=0)
    # the refusals' advice: the export takes the aux loss (it trains on the decoder's row), the original does not
    assert _problems(str(tmp_path / "hf"), "--router_aux_loss_coef", "0.01") == []
    assert "llm/tools/export.py --format hf" in _problems(tiny_qwen3_moe_dir, "--router_aux_loss_coef", "0.01")[0]


def test_paddlenlp_layout_with_a_window_loads_on_the_decoder(tmp_path):
    """What a full fine-tune or a merge of a transformers qwen3_moe with a window saves (PaddleNLP's layout, config
    use_sliding_window: true) is a config models/qwen3 refuses: it loads on the decoder's row, window honoured."""
    from paddlenlp.transformers import AutoConfig

    from paddlenlp_ext.models.registration import register_qwen3
    from paddlenlp_ext.models.decoder.modeling import DecoderForCausalLM
    from paddlenlp_ext.models.loading import load_model_streaming
    from paddlenlp_ext.models.qwen3.support import unsupported_settings

    register_qwen3()
    torch.manual_seed(1)
    hf = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**KW, use_sliding_window=True, sliding_window=4)
    ).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path / "hf"))
    ours, _ = load_model_streaming(str(tmp_path / "hf"), AutoConfig.from_pretrained(str(tmp_path / "hf")), "float32")
    ours.save_pretrained(str(tmp_path / "paddle"))  # PaddleNLP's names and [in, out] Linears
    config = AutoConfig.from_pretrained(str(tmp_path / "paddle"))
    assert unsupported_settings(config)  # models/qwen3 would refuse it
    again, stats = load_model_streaming(str(tmp_path / "paddle"), config, "float32")
    assert isinstance(again, DecoderForCausalLM) and stats["layout"] == "paddlenlp"
    again.eval()
    with paddle.no_grad():
        got = again(input_ids=paddle.to_tensor(IDS)).logits.numpy()
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits.numpy()
        full = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**KW)).eval()  # no window
        full.load_state_dict(hf.state_dict())
        unwindowed = full(torch.tensor(IDS)).logits.numpy()
    assert np.abs(want - unwindowed).max() > 1e-3  # the window matters on these 10 tokens
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
