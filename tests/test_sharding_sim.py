"""Sharding stage 2 / 3 by simulation of the partitioned optimizer step (GPU-only to run).

k replicas of the tiny model, each with the optimizer OUR trainer builds
(FinetuneTrainer.create_optimizer: LoRA+ per-parameter rates, PaddleNLP's
weight-decay rule, global-norm clip), are stepped as stage 2 (Paddle's own
partition: each parameter stepped by its owner, then broadcast) and stage 3
(Paddle's own slice parameters, "slice@" + name, then all-gathered), each rank
on its part of the global batch with our global-token loss.  They must match
one process stepping the whole global batch.  Negative controls: PaddleNLP's
own optimizer (no slice-aware weight decay) and a per-rank-mean loss differ.
"""

import numpy as np
import paddle
import pytest

from conftest import DATA_DIR

STEPS = 3
GLOBAL_BATCH = 4


def build(tmp_path, tiny_model_dir, method, paddlenlp_optimizer=False):
    """(model, optimizer) exactly as the trainer builds them; identical for every call with the same method."""
    from paddlenlp.trainer import Trainer
    from paddlenlp.transformers import AutoModelForCausalLM, AutoTokenizer

    from paddlenlp_ext.adapters import AdapterConfig, apply_adapters
    from paddlenlp_ext.data.collate import PaddingCollator
    from paddlenlp_ext.training.training_args import TrainingArguments
    from paddlenlp_ext.training.trainer import FinetuneTrainer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = None
    if method == "lora":
        paddle.seed(7)  # the same A init in every replica
        cfg = AdapterConfig(method="lora", r=4, alpha=8, lora_plus_scale=4.0)
        apply_adapters(model, cfg)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        learning_rate=2e-3,
        max_steps=STEPS,
        warmup_steps=1,
        per_device_train_batch_size=GLOBAL_BATCH,
        report_to="none",
        lr_scheduler_type="linear",
        weight_decay=0.5,
        max_grad_norm=0.05,
    )
    trainer = FinetuneTrainer(
        model=model,
        args=args,
        train_dataset=[],
        tokenizer=tok,
        data_collator=PaddingCollator(tok.pad_token_id),
        adapter_config=cfg,
    )
    trainer.create_scheduler(num_training_steps=STEPS)
    if paddlenlp_optimizer:
        Trainer.create_optimizer(trainer, trainer.lr_scheduler)  # PaddleNLP's, without our override
    else:
        trainer.create_optimizer(trainer.lr_scheduler)
    return model, trainer.optimizer


@pytest.fixture(scope="module")
def features(tiny_model_dir):
    from paddlenlp.transformers import AutoTokenizer

    from paddlenlp_ext.data.reader import read_examples
    from paddlenlp_ext.data.tokenize import tokenize_examples

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    feats, _ = tokenize_examples(read_examples([f"{DATA_DIR}/dev.json"]), tok, 64, 128, False)
    assert len(feats) >= STEPS * GLOBAL_BATCH
    return feats, tok.pad_token_id


def micro_batches(features, ranks):
    """batches[step][rank]: each rank's rows of the step's global batch, padded on their own, with N."""
    from paddlenlp_ext.data.collate import PaddingCollator

    feats, pad = features
    collate = PaddingCollator(pad)
    out = []
    for step in range(STEPS):
        rows = feats[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        n = sum(sum(1 for t in f["labels"] if t != -100) for f in rows)
        per = GLOBAL_BATCH // ranks
        out.append(
            [
                ({k: paddle.to_tensor(v) for k, v in collate(rows[r * per : (r + 1) * per]).items()}, n)
                for r in range(ranks)
            ]
        )
    return out


def loss_fn(ranks, own_mean=False):
    """Our global-token loss; ``own_mean``: each rank's mean over its own label tokens (PaddleNLP's criterion)."""
    from paddlenlp_ext.training.loss import global_token_loss

    def run(model, batch):
        inputs, n = batch
        inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "labels", "attention_mask", "position_ids")}
        if own_mean:
            return global_token_loss(model, inputs, int((inputs["labels"] != -100).sum()), ranks=1, accumulation=1)
        return global_token_loss(model, inputs, n, ranks=ranks, accumulation=1)

    return run


def trainable(model):
    return {n: p.numpy().copy() for n, p in model.named_parameters() if not p.stop_gradient}


def single_process(tmp_path, tiny_model_dir, method, features):
    from paddlenlp_ext.parallel.sharding_sim import simulate_sharded_training

    model, opt = build(tmp_path, tiny_model_dir, method)
    losses = []
    for step in micro_batches(features, 1):
        loss = loss_fn(1)(model, step[0])
        loss.backward()
        opt.step()
        opt.clear_grad()
        opt._learning_rate.step()
        losses.append(float(loss))
    assert simulate_sharded_training  # imported: the module loads without a GPU
    return losses, trainable(model)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir, features):
    return {m: single_process(tmp_path_factory.mktemp(m), tiny_model_dir, m, features) for m in ("lora", "full")}


def sharded(tmp_path, tiny_model_dir, method, features, stage, ranks, paddlenlp_optimizer=False, own_mean=False):
    from paddlenlp_ext.parallel.sharding_sim import simulate_sharded_training

    built = [build(tmp_path / f"r{r}", tiny_model_dir, method, paddlenlp_optimizer) for r in range(ranks)]
    models, opts = [b[0] for b in built], [b[1] for b in built]
    losses = simulate_sharded_training(models, opts, micro_batches(features, ranks), loss_fn(ranks, own_mean), stage)
    weights = [trainable(m) for m in models]
    for other in weights[1:]:  # the replicas end identical (broadcast / all-gather)
        for n in weights[0]:
            np.testing.assert_array_equal(other[n], weights[0][n])
    return losses, weights[0]


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float(np.abs(a[n] - b[n]).max()) for n in a)


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("stage,ranks", [(2, 2), (3, 2), (3, 4), (2, 4)])
def test_partitioned_step_reproduces_one_process(tmp_path, tiny_model_dir, features, reference, method, stage, ranks):
    ref_losses, ref_weights = reference[method]
    losses, weights = sharded(tmp_path, tiny_model_dir, method, features, stage, ranks)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_diff(weights, ref_weights) < 1e-5
    # the run moved the weights well beyond that tolerance (the comparison can fail)
    model, _ = build(tmp_path / "init", tiny_model_dir, method)
    assert max_diff(trainable(model), ref_weights) > 1e-3


def test_stage2_partition_is_paddles_greedy_rule():
    """Each parameter goes to the rank with the fewest trainable elements so far (frozen ones count 0)."""
    from paddlenlp_ext.integrations.sharding import stage2_partition

    ps = [paddle.create_parameter([n], "float32") for n in (10, 3, 7, 2, 5)]
    ps[1].trainable = False
    owned = stage2_partition(ps, 2)
    assert [[p.shape[0] for p in group] for group in owned] == [[10], [3, 7, 2, 5]]


def test_paddlenlp_weight_decay_is_lost_under_stage3(tmp_path, tiny_model_dir, features, reference):
    """Negative control for the fix: PaddleNLP's rule asks by name, and stage 3 renames to "slice@" + name."""
    ref_losses, ref_weights = reference["full"]
    _, stage2 = sharded(tmp_path / "s2", tiny_model_dir, "full", features, 2, 2, paddlenlp_optimizer=True)
    assert max_diff(stage2, ref_weights) < 1e-5  # stage 2 keeps the names: PaddleNLP's rule works there
    _, stage3 = sharded(tmp_path / "s3", tiny_model_dir, "full", features, 3, 2, paddlenlp_optimizer=True)
    assert max_diff(stage3, ref_weights) > 1e-4


def test_per_rank_mean_loss_differs(tmp_path, tiny_model_dir, features, reference):
    """Negative control: each rank's mean over its own tokens (PaddleNLP's criterion) weights the ranks' tokens
    unequally when they hold different numbers of label tokens."""
    ref_losses, ref_weights = reference["lora"]
    for step in micro_batches(features, 2):
        counts = [int((inputs["labels"] != -100).sum()) for inputs, _ in step]
        assert counts[0] != counts[1]
    losses, weights = sharded(tmp_path, tiny_model_dir, "lora", features, 2, 2, own_mean=True)
    assert abs(losses[0] - ref_losses[0]) > 1e-4 * ref_losses[0]
    assert max_diff(weights, ref_weights) > 1e-4


def test_slice_aware_decay_answers_for_slices():
    from paddlenlp_ext.integrations.sharding import slice_aware_decay

    opt = paddle.optimizer.AdamW(
        parameters=[paddle.create_parameter([2], "float32")], apply_decay_param_fun=lambda name: name in {"w"}
    )
    slice_aware_decay(opt)
    slice_aware_decay(opt)  # idempotent
    decide = opt._apply_decay_param_fun
    assert decide("w") and decide("slice@w") and not decide("slice@norm") and not decide("norm")
    plain = paddle.optimizer.AdamW(parameters=[paddle.create_parameter([2], "float32")])
    assert slice_aware_decay(plain)._apply_decay_param_fun is None
