"""The adapter method table (paddlenlp_ext/adapters/methods.py), and the worked example of
docs/contributing.md ("Add a PEFT method"): LoRA-FA, LoRA with a frozen A, added by this file alone --
its layer class below and one ``register_method`` call -- then configured from flat keys, trained a few
steps on the tiny model (hidden 64, 2 layers), merged by the streaming merge (verified against base +
adapter) and exported to PEFT, where ``peft.PeftModel`` gives our logits.
"""

import dataclasses

import numpy as np
import paddle
import pytest

from paddlenlp_ext.adapters import apply_adapters, count_parameters, iter_adapter_layers, save_adapter
from paddlenlp_ext.adapters.config import AdapterConfig, AdapterConfigError, adapter_config_from_args
from paddlenlp_ext.adapters.lora import LoRALinear
from paddlenlp_ext.adapters.methods import (
    TABLE,
    AdapterMethod,
    Supports,
    load_object,
    lora_shapes,
    register_method,
    unregister_method,
)


# ------------------------------------------------------------------------- the new method's module
class FrozenALoRALinear(LoRALinear):
    """LoRA-FA (Zhang et al., 2023, arXiv:2308.03303): A keeps its random init, only B trains."""

    method = "lora_fa"

    def __init__(self, base_layer, config, *, init_weights=True, shared=None):
        super().__init__(base_layer, config, init_weights=init_weights, shared=shared)
        self.lora_A.stop_gradient = True  # saved (it is random), never trained


# ------------------------------------------------------------------------- its row (one call)
LORA_FA = AdapterMethod(
    name="lora_fa",
    title="LoRA-FA",
    key="lora_fa",
    layer=f"{__name__}:FrozenALoRALinear",
    from_args=lambda a: dict(r=a.get("lora_rank", 8), alpha=a.get("lora_alpha"), dropout=a.get("lora_dropout", 0.0)),
    saved_shapes=lora_shapes,  # lora_A [in, r], lora_B [r, out], as LoRA
    frozen=("lora_A",),
    peft_export="paddlenlp_ext.export.peft_adapter:LORA",  # LoRA-shaped: PEFT loads it as a LoRA
    supports=Supports(peft_export=True),
)


@pytest.fixture
def lora_fa():
    register_method(LORA_FA)
    try:
        yield LORA_FA
    finally:
        unregister_method("lora_fa")  # the table is global: later tests see the built-in methods only


IDS = np.array([[1, 17, 250, 3, 99, 42, 7, 300, 12, 5, 64, 128], [2, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 311]])  # [2, 12]


def _logits(model):
    out = model(input_ids=paddle.to_tensor(IDS))
    return out[0] if isinstance(out, tuple) else out.logits  # [2, 12, vocab]


def _loss(model):
    logits = _logits(model)
    return paddle.nn.functional.cross_entropy(logits[:, :-1].astype("float32"), paddle.to_tensor(IDS[:, 1:, None]))


def test_the_toy_method_trains_merges_and_exports_to_peft(lora_fa, tiny_model_dir, tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from paddlenlp.transformers import AutoConfig

    from paddlenlp_ext.export import export_hf_model, export_peft_adapter
    from paddlenlp_ext.merge import merge_adapter_checkpoint
    from paddlenlp_ext.models.loading import load_model_streaming
    from paddlenlp_ext.adapters.tp_layers import parallel_layer_class
    from paddlenlp_ext.planner.params import adapter_params

    quiet = dict(log=lambda *a: None)
    # flat keys -> config, through the row; another method's option is refused, not ignored
    cfg = adapter_config_from_args({"lora_fa": True, "lora_rank": 4, "model_type": "llama"})
    assert (cfg.method, cfg.r, cfg.alpha, cfg.scaling) == ("lora_fa", 4, 8.0, 2.0)
    with pytest.raises(AdapterConfigError, match="rslora=True only applies to method='lora', not 'lora_fa'"):
        AdapterConfig(method="lora_fa", r=4, rslora=True)
    with pytest.raises(NotImplementedError, match="LoRA-FA is not supported with tensor parallelism"):
        parallel_layer_class(cfg)

    paddle.seed(0)
    model = load_model_streaming(
        tiny_model_dir, AutoConfig.from_pretrained(tiny_model_dir, dtype="float32"), "float32", None, max_seq_len=64
    )[0]
    info = apply_adapters(model, cfg)
    layers = iter_adapter_layers(model)
    assert info["method"] == "lora_fa" and all(isinstance(layer, FrozenALoRALinear) for _, layer in layers)
    # the planner's count (the row's saved shapes minus its frozen A) is what the model trains
    planned = sum(adapter_params(cfg, layer.in_features, layer.out_features) for _, layer in layers)
    assert count_parameters(model)[0] == planned == sum(4 * layer.out_features for _, layer in layers)

    a0 = {n: layer.lora_A.numpy().copy() for n, layer in layers}
    opt = paddle.optimizer.AdamW(1e-2, parameters=[p for p in model.parameters() if not p.stop_gradient])
    model.train()
    before = float(_loss(model))
    for _ in range(4):
        loss = _loss(model)
        loss.backward()
        opt.step()
        opt.clear_grad()
    model.eval()
    with paddle.no_grad():
        assert float(_loss(model)) < before
        want = _logits(model).astype("float32").numpy()
    for n, layer in layers:
        np.testing.assert_array_equal(layer.lora_A.numpy(), a0[n])  # A frozen
        assert np.abs(layer.lora_B.numpy()).max() > 0  # B trained (it starts at 0)

    adir = str(tmp_path / "adapter")
    save_adapter(model, cfg, adir)
    assert AdapterConfig.load(adir).method == "lora_fa"
    # the streaming merge (compute_delta through the row's layer class), verified against base + adapter
    res = merge_adapter_checkpoint(
        tiny_model_dir, adir, str(tmp_path / "merged"), device="cpu", num_probes=1, probe_length=8, **quiet
    )
    assert res.exit_code == 0

    # PEFT export by the LoRA mapping; peft's own code loads it and gives our logits
    peft_cfg = export_peft_adapter(adir, str(tmp_path / "peft"), **quiet)
    assert (peft_cfg["peft_type"], peft_cfg["r"], peft_cfg["lora_alpha"]) == ("LORA", 4, 8.0)
    hf_dir = export_hf_model(tiny_model_dir, str(tmp_path / "hf"), **quiet).output_dir
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(TABLE))
def test_every_row_is_complete(name):
    """Each built-in row's dotted paths import, and its supports agree with what it names."""
    row = TABLE[name]
    assert load_object(row.layer).method == name
    for variant, path in row.variants.items():
        assert load_object(path).method in (name, variant)
    assert (row.tp_layer is not None) == row.supports.tensor_parallel
    if row.tp_layer is not None:
        assert issubclass(load_object(row.tp_layer), load_object(row.layer))
    assert (row.peft_export is not None) == row.supports.peft_export
    if row.peft_export is not None:
        assert load_object(row.peft_export).peft_type
    for feature, supported in dataclasses.asdict(row.supports).items():  # every refusal says why
        assert supported or feature in row.refusals, f"{name}: {feature} unsupported without a reason"
    assert set(row.option_defaults()) <= {f for f in AdapterConfig.__dataclass_fields__}


def test_registering_a_taken_name_or_key_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_method(TABLE["lora"])
