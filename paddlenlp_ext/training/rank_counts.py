"""Counters summed over data-parallel ranks, and the eval token accuracy built on them (the trainers' and
run summaries' counts of tokens, pairs and prompts)."""

import paddle


class TokenAccuracy:
    """Next-token accuracy over label positions, accumulated batch by batch.

    As PaddleNLP's SFT ``compute_metrics`` (argmax of the logits == label where label != -100),
    but only two integers are kept, not the predictions of the whole eval set.  Summed over
    data-parallel ranks.  Worked example: logits argmax [[3, 7, 1]] with labels
    [[-100, 7, 2]] -> 1 correct of 2 label positions -> 0.5.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.correct, self.total = 0, 0

    def update(self, logits, labels):
        # logits [batch, seq, vocab] -> predictions [batch, seq]; labels [batch, seq]
        with paddle.no_grad():
            preds = paddle.argmax(logits, axis=-1).astype(labels.dtype)
            mask = labels != -100
            self.correct += int(paddle.logical_and(preds == labels, mask).astype("int64").sum())
            self.total += int(mask.astype("int64").sum())

    def compute(self):
        correct, total = sum_over_ranks([self.correct, self.total])
        return correct / total if total else None


def _data_replicas() -> int:
    """Processes that see the same batches: the tensor- and pipeline-parallel ranks of one data rank."""
    from paddle.distributed import fleet

    try:
        hcg = fleet.get_hybrid_communicate_group()
    except (AssertionError, AttributeError):  # fleet not initialized: plain data parallel
        return 1
    if hcg is None:
        return 1
    data = hcg.get_data_parallel_world_size() * hcg.get_sharding_parallel_world_size()
    return max(1, paddle.distributed.get_world_size() // max(1, data))


def sum_over_ranks(counts):
    """Integer counters summed over data-parallel (and sharding) ranks (unchanged in a single process).

    All ranks take part in the all-reduce; the tensor- and pipeline-parallel ranks of one data rank
    counted the same batches, so the sum is divided by their number."""
    if paddle.distributed.get_world_size() > 1:
        t = paddle.to_tensor(counts, dtype="int64")
        paddle.distributed.all_reduce(t)
        replicas = _data_replicas()
        counts = [int(x) // replicas for x in t.numpy()]
    return list(counts)


def finish_together() -> None:
    """Every process of a multi-process run waits here for the others before it exits.

    The main process writes the summary, loss.png and the final model after the last step while
    the others are done: without this barrier they exit first, and a gloo connection closed under
    a still-running peer can abort it at exit (SIGABRT after a complete run, seen on CPU data
    parallel).  No-op in a single process or when the parallel environment is not set up.
    """
    from paddle.distributed import is_initialized

    if paddle.distributed.get_world_size() > 1 and is_initialized():
        paddle.distributed.barrier()
