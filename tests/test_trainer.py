"""The Trainer we build: LoRA+ learning rates on the optimizer it creates, and log history."""

import numpy as np
import paddle
import pytest

from conftest import DATA_DIR


def build_trainer(tmp_path, tiny_model_dir, lora_plus_scale, warmup_steps=0, max_steps=10):
    from paddlenlp.transformers import AutoModelForCausalLM, AutoTokenizer

    from paddlenlp_ext.adapters import AdapterConfig, apply_adapters
    from paddlenlp_ext.data.collate import PaddingCollator
    from paddlenlp_ext.data.reader import read_examples
    from paddlenlp_ext.data.tokenize import tokenize_examples
    from paddlenlp_ext.training.training_args import TrainingArguments
    from paddlenlp_ext.training.trainer import FinetuneTrainer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = AdapterConfig(method="lora", r=4, alpha=8, lora_plus_scale=lora_plus_scale)
    apply_adapters(model, cfg)
    feats, _ = tokenize_examples(read_examples([f"{DATA_DIR}/dev.json"]), tok, 64, 128, False)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        learning_rate=1e-3,
        warmup_steps=warmup_steps,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        report_to="none",
        lr_scheduler_type="linear",
        weight_decay=0.0,
    )
    return FinetuneTrainer(
        model=model,
        args=args,
        train_dataset=feats,
        tokenizer=tok,
        data_collator=PaddingCollator(tok.pad_token_id),
        adapter_config=cfg,
    ), feats


@pytest.mark.parametrize("warmup", [0, 4])
def test_lora_plus_rates_on_trainer_optimizer(tmp_path, tiny_model_dir, warmup):
    """First AdamW step: |delta| = lr_t x multiplier for every param with a non-zero grad
    (Adam's bias-corrected m/sqrt(v) is sign(g) at step 1). B starts at 0, so only B has a grad."""
    trainer, feats = build_trainer(tmp_path, tiny_model_dir, lora_plus_scale=16.0, warmup_steps=warmup)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    opt, sched = trainer.optimizer, trainer.lr_scheduler
    lr_t = float(opt.get_lr())
    expected_lr = 1e-3 * (1 if warmup == 0 else 0.0)  # linear warmup starts at 0
    assert lr_t == pytest.approx(expected_lr)
    if warmup:
        sched.step()  # move into warmup so lr_t > 0
        lr_t = float(opt.get_lr())
        assert lr_t == pytest.approx(1e-3 / warmup)
    named = {n: p for n, p in trainer.model.named_parameters() if not p.stop_gradient}
    before = {n: p.numpy().copy() for n, p in named.items()}
    batch = trainer.data_collator(feats[:4])
    batch = {k: paddle.to_tensor(v) for k, v in batch.items()}
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    opt.step()
    checked = 0
    for n, p in named.items():
        g = p.grad.numpy() if p.grad is not None else np.zeros_like(before[n])
        moved = np.abs(p.numpy() - before[n])
        nz = np.abs(g) > 1e-6
        if n.endswith("lora_B"):
            assert nz.any()
            np.testing.assert_allclose(moved[nz], 16.0 * lr_t, rtol=2e-2)
            checked += 1
        elif n.endswith("lora_A"):
            assert not nz.any() and moved.max() == 0.0  # B = 0 at init: A gets no gradient yet
    assert checked == 14


def test_log_history_kept_in_trainer_state(tmp_path, tiny_model_dir):
    trainer, _ = build_trainer(tmp_path, tiny_model_dir, lora_plus_scale=1.0, max_steps=4)
    trainer.args.logging_steps = 1
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4


def test_o2_amp_leaves_quantized_bases_in_float32(tiny_model_dir):
    """PaddleNLP's Trainer decorates with excluded_layers = [...] + self._decorate_exclude_layers(model):
    ours must name every QuantizedLinear, whose fp32 scales / code book O2 would otherwise cast."""
    from paddlenlp.transformers import AutoModelForCausalLM

    from paddlenlp_ext.models.quantize import quantize_model
    from paddlenlp_ext.quant import QuantizedLinear
    from paddlenlp_ext.training.trainer import FinetuneTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    quantize_model(model, "nf4", block_size=16)
    trainer = object.__new__(FinetuneTrainer)  # the hook reads nothing of the trainer's state
    excluded = trainer._decorate_exclude_layers(model)
    quantized = [l for l in model.sublayers() if isinstance(l, QuantizedLinear)]
    assert len(quantized) == 14 and {id(l) for l in excluded} == {id(l) for l in quantized}
