"""Routed-expert biases of ernie4_5_moe (``use_bias``) and deepseek_v2 (``mlp_bias``) follow the checkpoint.

transformers 4.55 gives every routed expert's Linears a bias with those keys true; 5.x's fused experts have none
(both keep the shared experts' biases).  The loader (models/loading.py ``_routed_expert_bias``) reads which one
saved a checkpoint from its tensor names.  Judged by transformers 4.55 itself: a checkpoint it saved, with every
routed-expert bias removed, gives our logits equal to its model with those biases zeroed (what 5.x computes; the
5.x-saved checkpoints themselves: tests/test_decoder_hf5.py), also after our save and HF export; one bias removed
is refused naming it.
"""

import numpy as np
import paddle
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_decoder_parity import BASE, KNOBS, load_ours, randomize  # noqa: E402

ROWS = ["ernie4_5_moe", "deepseek_v2"]
IDS = [[1, 17, 25, 3, 99, 42, 7, 30], [2, 9, 8, 7, 6, 5, 4, 3]]  # [2, 8]


def _routed_bias(name):
    return ".experts." in name and name.endswith(".bias")


def _saved(model_type, tmp_path):
    """(transformers 4.55 model, its directory, its state dict) at random weights, routed biases non-zero."""
    config = transformers.AutoConfig.for_model(
        model_type,
        **{
            **BASE,
            **KNOBS[model_type],
            "num_hidden_layers": 2,
            **({"moe_layer_start_index": 1} if model_type == "ernie4_5_moe" else {}),
        },
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomize(hf)
    hf.save_pretrained(str(tmp_path))
    return hf, str(tmp_path), safetensors_torch.load_file(str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("model_type", ROWS)
def test_a_checkpoint_without_routed_expert_biases_builds_experts_without_them(model_type, tmp_path):
    hf, path, sd = _saved(model_type, tmp_path)
    dropped = [k for k in sd if _routed_bias(k)]
    assert dropped and any("shared_experts" in k and k.endswith(".bias") for k in sd)
    safetensors_torch.save_file(
        {k: v for k, v in sd.items() if k not in dropped}, f"{path}/model.safetensors", metadata={"format": "pt"}
    )
    ours = load_ours(path, model_type)
    names = [n for n, _ in ours.named_parameters()]
    assert not [n for n in names if _routed_bias(n)]  # routed experts: no bias parameter at all
    assert [n for n in names if "shared_experts" in n and n.endswith(".bias")]  # the shared experts keep theirs
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if _routed_bias(name):
                p.zero_()
        want = hf(torch.tensor(IDS)).logits.numpy()
    with paddle.no_grad():
        got = ours(input_ids=paddle.to_tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # saved here (routed_expert_bias: false in config.json) and exported, it reads back in transformers 4.55 (which
    # zero-initialises the biases it does not find) and in our loader to the same logits
    from paddlenlp_ext.export.hf_model import export_hf_model

    ours.save_pretrained(str(tmp_path / "ours"))
    export_hf_model(str(tmp_path / "ours"), str(tmp_path / "hf"), log=lambda *a: None)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.tensor(IDS)).logits.numpy(), want, atol=1e-4, rtol=0)
    with paddle.no_grad():
        again = load_ours(str(tmp_path / "hf"), model_type)(input_ids=paddle.to_tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(again, want, atol=1e-4, rtol=0)


def test_a_checkpoint_missing_one_routed_expert_bias_is_refused_naming_it(tmp_path):
    from paddlenlp_ext.models.checkpoint import CheckpointError

    _, path, sd = _saved("ernie4_5_moe", tmp_path)
    gone = next(k for k in sd if _routed_bias(k))
    safetensors_torch.save_file(
        {k: v for k, v in sd.items() if k != gone}, f"{path}/model.safetensors", metadata={"format": "pt"}
    )
    with pytest.raises(CheckpointError, match="missing from the checkpoint") as e:
        load_ours(path, "ernie4_5_moe")
    assert gone.split("layers.")[1] in str(e.value)
