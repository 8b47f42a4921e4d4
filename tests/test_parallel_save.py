"""Saving under tensor parallel: every model-parallel rank joins the gather, one writes.

Fleet tensor parallel cannot run on CPU, so this checks the decision logic of
TrainerBoundary._save / FinetuneTrainer.join_weights_gather; the gather itself
(adapters) is checked by simulation in tests/test_tp_sim.py.
"""

from types import SimpleNamespace

import pytest

from paddlenlp_ext.training import trainer as trainer_mod


def bare_trainer(**args):
    t = object.__new__(trainer_mod.FinetuneTrainer)
    args.setdefault("pipeline_parallel_degree", 1)
    t.args = SimpleNamespace(output_dir="/out", **args)
    t.weights_io, t.adapter_config = None, None
    return t


@pytest.mark.parametrize("should_save,tp,model_state,expect", [
    (True, 1, True, "write"), (True, 2, True, "write"),
    (False, 2, True, "join"),  # another tensor-parallel rank of the writing replica: gathers, writes nothing
    (False, 1, True, None),  # data-parallel rank: nothing to gather
    (False, 2, False, None),  # a tensor-parallel rank of another data-parallel replica
    (False, (1, 2), True, "join"),  # a later pipeline stage of the writing replica: sends its adapters
    (False, (1, 2), False, None),  # a pipeline stage of another data-parallel replica
])  # fmt: skip
def test_who_writes_and_who_joins(should_save, tp, model_state, expect):
    tp, pp = tp if isinstance(tp, tuple) else (tp, 1)
    t = bare_trainer(
        should_save=should_save,
        tensor_parallel_degree=tp,
        pipeline_parallel_degree=pp,
        should_save_model_state=model_state,
    )
    calls = []
    t.owns_saving = lambda: True
    t.save_weights = lambda d: calls.append(("write", d))
    t.join_weights_gather = lambda d: calls.append(("join", d))
    t._save("/out/checkpoint-3")
    assert calls == ([(expect, "/out/checkpoint-3")] if expect else [])


class RecordingModel:
    def __init__(self):
        self.calls = []
        self.config = SimpleNamespace(save_pretrained=lambda d: None)

    def save_pretrained(self, d, **kw):
        self.calls.append(kw)


def test_joining_rank_gathers_without_writing(monkeypatch):
    t = bare_trainer(should_save=False, tensor_parallel_degree=2)
    t.model = RecordingModel()
    t.join_weights_gather("/out")
    assert t.model.calls == [
        dict(safe_serialization=True, max_shard_size="4GB", merge_tensor_parallel=True, is_main_process=False)
    ]
    seen = []
    monkeypatch.setattr(trainer_mod.adapter_api, "save_adapter", lambda m, c, d: seen.append((m, c, d)))
    t.adapter_config = "cfg"
    t.join_weights_gather("/out")
    assert seen == [(t.model, "cfg", "/out")]


def test_pipeline_full_fine_tuning_every_stage_writes_its_layers(monkeypatch):
    """Full fine-tuning under pipeline parallel: the first stage (writer) and a later stage (joining) both
    call save_stage_weights (each writes its layers; the collective gives the first stage the index)."""
    seen = []
    monkeypatch.setattr(trainer_mod, "save_stage_weights", lambda m, d: seen.append((m, d)))
    monkeypatch.setattr(trainer_mod.paddle, "save", lambda *a, **k: None)
    for should_save in (True, False):
        t = bare_trainer(should_save=should_save, tensor_parallel_degree=1, pipeline_parallel_degree=2)
        t.model, t.tokenizer = RecordingModel(), None
        (t._write_weights if should_save else t.join_weights_gather)("/out")
        assert seen[-1] == (t.model, "/out") and t.model.calls == []  # never the single-device save_pretrained
    assert len(seen) == 2


@pytest.mark.parametrize("tp", [1, 2])
def test_writer_merges_tensor_parallel_shards(tp, monkeypatch):
    t = bare_trainer(should_save=True, tensor_parallel_degree=tp)
    t.model, t.tokenizer = RecordingModel(), None
    monkeypatch.setattr(trainer_mod.paddle, "save", lambda *a, **k: None)
    t._write_weights("/out")
    assert t.model.calls[-1]["merge_tensor_parallel"] is (tp > 1)


def test_which_adapters_run_tensor_parallel():
    """LoRA/VeRA (and QLoRA bases) pass the config check under TP, LoRA/VeRA under sequence parallel too; PiSSA,
    LoKr, sequence parallel with a quantized base and fused projections are refused naming the key to change."""
    from paddlenlp_ext.config.environment import tensor_parallel_adapter_problems

    m = SimpleNamespace(pissa=False, fuse_attention_qkv=False, fuse_attention_ffn=False, weight_quantize_algo=None)
    tp2 = {"tensor_parallel_degree": 2}
    assert tensor_parallel_adapter_problems(tp2, m, ["lora"], "c.json") == []
    assert tensor_parallel_adapter_problems(tp2, m, ["vera"], "c.json") == []
    assert tensor_parallel_adapter_problems({"tensor_parallel_degree": 1}, m, ["lokr"], "c.json") == []
    assert "lokr" in tensor_parallel_adapter_problems(tp2, m, ["lokr"], "c.json")[0]
    assert (
        "pissa=false"
        in tensor_parallel_adapter_problems(tp2, SimpleNamespace(**{**vars(m), "pissa": True}), ["lora"], "c.json")[0]
    )
    sp2 = {**tp2, "sequence_parallel": True}
    assert tensor_parallel_adapter_problems(sp2, m, ["lora"], "c.json") == []  # tests/test_sp_sim.py
    quant = SimpleNamespace(**{**vars(m), "weight_quantize_algo": "nf4"})
    assert "sequence_parallel=false" in tensor_parallel_adapter_problems(sp2, quant, ["lora"], "c.json")[0]
    fused = SimpleNamespace(**{**vars(m), "fuse_attention_qkv": True})
    assert "fuse_attention_qkv=false" in tensor_parallel_adapter_problems(tp2, fused, ["lora"], "c.json")[0]
