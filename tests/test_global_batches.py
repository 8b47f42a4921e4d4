"""One global order and one normalization (data/global_batches.py): unit level.

The end-to-end proof (data parallel, sharding stage 1 and accumulation reproduce one
process's losses and weights) is tests/test_parallel_e2e.py.
"""

import doctest

import numpy as np
import pytest

from paddlenlp_ext.data import global_batches as gb

LAYOUTS = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4)]  # per_device, accumulation, ranks


def test_doctests():
    assert doctest.testmod(gb, verbose=False).failed == 0


def consumed(dataset, per_device, accumulation, ranks, epoch=0, drop_last=False):
    """Per global step: the multiset of examples and the N each index carries, over all ranks."""
    samplers = [
        gb.GlobalBatchSampler(dataset, per_device, accumulation, ranks, r, seed=7, drop_last=drop_last)
        for r in range(ranks)
    ]
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == len(samplers[0])
    steps = []
    for step in range(len(per_rank[0]) // accumulation):
        ids, ns = [], set()
        for r in range(ranks):
            for micro in per_rank[r][step * accumulation : (step + 1) * accumulation]:
                assert len(micro) == per_device
                ids += [int(i) for i in micro]
                ns |= {i.global_label_tokens for i in micro}
        assert len(ns) == 1  # every index of a global batch carries the same N
        steps.append((sorted(ids), ns.pop()))
    return steps


def toy(n=11, seed=0):
    rng = np.random.RandomState(seed)
    return [
        {"labels": [-100] * int(rng.randint(0, 4)) + list(rng.randint(1, 9, size=int(rng.randint(1, 6))))}
        for _ in range(n)
    ]


@pytest.mark.parametrize("drop_last", [False, True])
def test_global_batches_do_not_depend_on_ranks_or_accumulation(drop_last):
    data = toy()
    counts = gb.label_token_counts(data)
    reference = consumed(data, 4, 1, 1, drop_last=drop_last)
    for layout in LAYOUTS[1:]:
        assert consumed(data, *layout, drop_last=drop_last) == reference, layout
    for ids, n in reference:
        assert n == counts[ids].sum()
    assert len(reference) == (11 // 4 if drop_last else 3)


def test_epochs_reshuffle_and_cover_every_example():
    data = toy(12)
    e0, e1 = consumed(data, 2, 2, 1, epoch=0), consumed(data, 2, 2, 1, epoch=1)
    assert e0 != e1
    for steps in (e0, e1):
        assert sorted(i for ids, _ in steps for i in ids) == list(range(12))


def test_view_adds_n_only_for_tagged_indices_and_forwards_attributes():
    class DS(list):
        epoch = None

        def set_epoch(self, e):
            self.epoch = e

    view = gb.GlobalTokensView(DS([{"labels": [1, 2]}, {"labels": [3]}]))
    assert view[1] == {"labels": [3]}
    assert view[gb.TaggedIndex(0, 17)] == {"labels": [1, 2], gb.GLOBAL_TOKENS_KEY: 17}
    view.set_epoch(3)
    assert view.dataset.epoch == 3 and len(view) == 2


def test_scaled_micro_losses_give_the_single_process_gradient():
    """The trainer's scaling (sum of token losses x ranks x accumulation / N), then PaddleNLP's division
    by accumulation and data parallel's mean over ranks, gives (sum over the global batch) / N."""
    data = toy(16, seed=3)
    rng = np.random.RandomState(1)
    token_loss = [rng.rand(len(d["labels"])) * (np.asarray(d["labels"]) != -100) for d in data]

    def step_values(per_device, accumulation, ranks):
        out = []
        samplers = [
            list(gb.GlobalBatchSampler(data, per_device, accumulation, ranks, r, seed=1, drop_last=True))
            for r in range(ranks)
        ]
        for step in range(len(samplers[0]) // accumulation):
            rank_totals = []
            for r in range(ranks):
                total = 0.0
                for micro in samplers[r][step * accumulation : (step + 1) * accumulation]:
                    n = micro[0].global_label_tokens
                    scaled = sum(token_loss[int(i)].sum() for i in micro) * ranks * accumulation / n
                    total += scaled / accumulation  # PaddleNLP's training_step
                rank_totals.append(total)
            out.append(np.mean(rank_totals))  # data parallel averages gradients over ranks
        return out

    reference = step_values(4, 1, 1)
    for layout in LAYOUTS[1:]:
        np.testing.assert_allclose(step_values(*layout), reference, rtol=1e-12, err_msg=str(layout))
    # PaddleNLP's normalization (each rank's own token mean, then the mean over ranks) differs:
    # the test would catch a trainer that kept it
    samplers = [list(gb.GlobalBatchSampler(data, 2, 1, 2, r, seed=1, drop_last=True)) for r in range(2)]
    mean_of_means = [
        np.mean(
            [
                sum(token_loss[int(i)].sum() for i in samplers[r][k])
                / sum((np.asarray(data[int(i)]["labels"]) != -100).sum() for i in samplers[r][k])
                for r in range(2)
            ]
        )
        for k in range(len(samplers[0]))
    ]
    assert not np.allclose(mean_of_means, reference, rtol=1e-3)


def test_too_few_examples_for_one_global_batch_with_drop_last():
    with pytest.raises(ValueError, match="dataloader_drop_last"):
        gb.global_batches(3, 4, seed=0, epoch=0, drop_last=True)
    assert gb.global_batches(3, 4, seed=0, epoch=0, drop_last=False) == [[2, 1, 0, 2]]  # padded by wrapping


def test_tagged_indices_survive_pickling_to_dataloader_workers():
    import pickle

    for n in (17, (5, 7)):
        t = pickle.loads(pickle.dumps(gb.TaggedIndex(3, n)))
        assert isinstance(t, gb.TaggedIndex) and int(t) == 3 and t.global_label_tokens == n
