"""Shared by the bit-identical speed-patch tests (test_rotary.py, test_dense_attention.py): a tiny
LoRA model and its loss + LoRA gradients, which a patch must leave unchanged to the bit."""

import contextlib

import numpy as np
import paddle


def lora_model(model_dir):
    """The tiny model (fp32, seed 0) with LoRA r=4 applied and every B = 0.01, in train mode
    (B != 0 so that A's gradient is not trivially 0)."""
    from paddlenlp.transformers import AutoModelForCausalLM

    from paddlenlp_ext.adapters.api import apply_adapters
    from paddlenlp_ext.adapters.config import AdapterConfig

    paddle.seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    apply_adapters(model, AdapterConfig(method="lora", r=4, alpha=8))
    for name, p in model.named_parameters():
        if name.endswith("lora_B"):
            p.set_value(paddle.full(p.shape, 0.01, p.dtype))
    model.train()
    return model


def random_batch(rows, length, prompt):
    """Fixed random ids [rows, length] (seed 0) and labels with the first ``prompt`` columns ignored."""
    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 200, (rows, length)))
    labels = ids.clone()
    labels[:, :prompt] = -100
    return {"input_ids": ids, "labels": labels}


def loss_and_lora_grads(model, inputs, forward_context=None):
    """(loss, {trainable name: gradient}) of one global-token-loss step; ``forward_context`` wraps the forward."""
    from paddlenlp_ext.training.loss import global_token_loss

    with forward_context or contextlib.nullcontext():
        loss = global_token_loss(model, inputs, 16, 1, 1)
    loss.backward()
    return float(loss), {n: p.grad.numpy() for n, p in model.named_parameters() if not p.stop_gradient}
