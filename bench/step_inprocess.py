"""Benchmark: one training micro-step in-process, PaddleNLP's ops vs ours.

    .venv/bin/python -m bench.step_inprocess MODEL_DIR [--seq 1024] [--repeats 3] [--packed] [--decoder]

Loads MODEL_DIR (a PaddleNLP Llama, e.g. ``bench/cpu_setup.py``'s, or a 4-layer copy), puts LoRA
r8 on every decoder linear, and times forward + backward of our SFT loss
(``training.loss.global_token_loss``) on one row of ``--seq`` random tokens (``--packed``: four
examples packed in the row, with PaddleNLP's dense block-diagonal mask), alternating **stock**
(PaddleNLP's ``apply_rotary_pos_emb``, ``scaled_dot_product_attention`` and RMSNorm) and **ours**
(``integrations.rotary`` + ``integrations.dense_attention`` + ``integrations.rms_norm``, as
``training/run.py`` installs them).  It prints the median times and the largest relative difference of
the loss and of the LoRA gradients (rotary and attention are bit-identical; the RMSNorm is within 1e-6).

``--decoder``: **stock** becomes PaddleNLP's class *with* those three patches (how Llama trained before it
moved onto our decoder) and **ours** the decoder (``models.loading.load_model_streaming``, as
``llm/run_finetune.py`` builds it): the same weights, the same step.  Run it under the CLI's CPU set-up
(``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` = cores, ``MKL_DEBUG_CPU_TYPE=5`` on AMD: ``runtime/cpu_env.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import numpy as np
import paddle

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--packed", action="store_true")
    p.add_argument("--decoder", action="store_true", help="PaddleNLP's class with our patches vs our decoder")
    a = p.parse_args(argv)
    from paddlenlp.transformers import AutoModelForCausalLM

    from paddlenlp_ext.adapters.api import apply_adapters
    from paddlenlp_ext.adapters.config import AdapterConfig
    from paddlenlp_ext.integrations.dense_attention import fast_dense_attention
    from paddlenlp_ext.integrations.rms_norm import fast_rms_norm
    from paddlenlp_ext.integrations.rotary import fast_rotary
    from paddlenlp_ext.training.loss import global_token_loss

    def build(ours):
        paddle.seed(0)
        if ours and a.decoder:  # the decoder, built as the CLI builds it
            from paddlenlp_ext.models.loading import decoder_class_for, load_model_streaming

            lm_class, config = decoder_class_for(AutoConfig.from_pretrained(a.model_dir))
            model = load_model_streaming(a.model_dir, config, "float32", model_class=lm_class)[0]
        else:
            with contextlib.ExitStack() as stack:
                if ours or a.decoder:  # the attention function is bound when the layers are built
                    stack.enter_context(fast_dense_attention())
                model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype="float32")
        paddle.seed(0)  # the same LoRA A on both sides, however many random numbers the build drew
        apply_adapters(model, AdapterConfig(method="lora", r=8, alpha=16))
        model.train()
        return model

    s = a.seq
    from paddlenlp.transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(a.model_dir).vocab_size
    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, vocab, (1, s)))
    labels = ids.clone()
    labels[:, : s // 4] = -100
    inputs = {"input_ids": ids, "labels": labels}
    if a.packed:  # four examples: block-diagonal causal keep-mask [1, 1, s, s], positions restart
        cuts = [0, s // 8, s // 2, (3 * s) // 4, s]
        keep = np.zeros([1, 1, s, s], dtype=bool)
        pos = np.zeros([1, s], dtype="int64")
        for lo, hi in zip(cuts, cuts[1:]):
            keep[0, 0, lo:hi, lo:hi] = np.tril(np.ones([hi - lo, hi - lo], dtype=bool))
            pos[0, lo:hi] = np.arange(hi - lo)
        inputs.update(attention_mask=paddle.to_tensor(keep), position_ids=paddle.to_tensor(pos))
    else:
        inputs["attention_mask"] = paddle.ones([1, s], dtype="int64")
    models = {"stock": build(False), "ours": build(True)}

    def step(model):
        model.clear_gradients()
        loss = global_token_loss(model, dict(inputs), int((labels != -100).sum()), 1, 1)
        loss.backward()
        return float(loss), {n: q.grad.numpy() for n, q in model.named_parameters() if not q.stop_gradient}

    @contextlib.contextmanager
    def patches(name):
        with contextlib.ExitStack() as stack:
            if (name == "ours") != a.decoder:  # the patches: ours, or with --decoder the PaddleNLP side
                stack.enter_context(fast_rotary())
                stack.enter_context(fast_rms_norm())
            yield

    times, results = h.interleave(
        {name: (lambda m=m: step(m)) for name, m in models.items()}, a.repeats, context=patches
    )
    for name in times:
        print(
            f"{name}: forward+backward {statistics.median(times[name]):.3f} s (median of {a.repeats}: "
            f"{', '.join(f'{t:.3f}' for t in times[name])})"
        )
    print(f"ours / stock: {statistics.median(times['ours']) / statistics.median(times['stock']):.2f}x time")
    (l0, g0), (l1, g1) = results["stock"], results["ours"]
    worst = max(float(np.abs(g1[n] - g0[n]).max() / max(np.abs(g0[n]).max(), 1e-30)) for n in g0)
    print(
        f"loss {l0:.6f} vs {l1:.6f} (relative difference {abs(l1 - l0) / abs(l0):.1e}); {len(g0)} LoRA gradients: "
        f"largest difference {worst:.1e} of the gradient's largest entry"
    )
    assert abs(l1 - l0) <= 1e-5 * abs(l0) and worst <= 1e-3, "ours drifted from PaddleNLP's step"
    return 0


if __name__ == "__main__":
    sys.exit(main())
