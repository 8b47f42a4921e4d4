"""The machine-limit side of the benchmarks: the FLOP counter (bench/flops.py), the peak measurement
(bench/peak.py), the data statistics (bench/limits.py) and the regression guard (bench/guard.py and
``bench/e2e.py --quick``'s comparison).  Not the speed itself: these check the counting and the logic.
"""

import doctest
import json
import os
import types

import pytest

from bench import e2e, e2e_runs, flops, guard, harness, limits, peak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_026B = dict(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16
)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("mod", [flops, peak, limits, guard], ids=lambda m: m.__name__)
def test_docstring_examples(mod):
    assert doctest.testmod(mod).failed == 0


def test_flop_count_of_the_worked_example():
    """The module docstring's 0.26B example, part by part."""
    f = flops.flops_per_token(LLAMA_026B, 32000, context=100, lora_rank=8)
    assert f["frozen"] == 4 * 205_520_896 - 3 * 2 * 1024 * 1024 == 815_792_128
    assert f["lm_head"] == 4 * 1024 * 32000
    assert f["lora"] == 6 * 2_523_136 - 3 * 2 * 8 * 1024
    assert f["attention"] == 12 * 1024 * 100 * 16
    assert f["total"] == 981_614_592
    full = flops.flops_per_token(LLAMA_026B, 32000, context=100)
    # full training is the familiar 6 x the matmul weights per token, plus attention
    assert full["total"] == 6 * (205_520_896 + 1024 * 32000) + 12 * 1024 * 100 * 16


def test_causal_context_is_per_document():
    # one packed row of documents 3 and 1 attends as the two documents alone, not as a row of 4
    assert flops.causal_context([3, 1]) == pytest.approx((1 + 2 + 3 + 1) / 4)
    assert flops.causal_context([4]) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert flops.causal_context([]) == 0.0


def test_flop_count_matches_torchs_flop_counter_on_a_lora_llama():
    """Against the other side's own counter: torch's FlopCounterMode over the forward and backward of a
    transformers Llama with a PEFT LoRA (eager attention, one sequence).  torch counts every matmul it runs;
    eager attention computes the full L x L scores, so the causal attention term is swapped for the dense
    one (12 * hidden * L per token and layer) before comparing.  Grouped-query k/v (2 of 4 heads) included."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, max_position_embeddings=64, **TINY)
    model = transformers.LlamaForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=list(flops.DECODER_LINEARS))
    )
    length = 12
    ids = torch.randint(0, 100, (1, length))
    with FlopCounterMode(display=False) as counter:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    ours = flops.flops_per_token(TINY, 100, context=flops.causal_context([length]), lora_rank=2)
    dense_attention = 12 * TINY["hidden_size"] * length * TINY["num_hidden_layers"]
    # transformers computes the rotary angles as a matmul, [head_dim / 2, 1] x [1, L], once per forward:
    # not a training FLOP of the model's weights or attention, and not in our count
    rotary = 2 * (TINY["hidden_size"] // TINY["num_attention_heads"] // 2) * length
    expected = (ours["total"] - ours["attention"] + dense_attention) * length + rotary
    assert counter.get_total_flops() == expected


def test_flops_per_supervised_token_and_achieved():
    stats = {"context": 100, "supervised_fraction": 0.5}
    per = limits.flops_per_supervised_token(LLAMA_026B, 32000, stats, 8)
    assert per == pytest.approx(2 * 981_614_592)
    a = flops.achieved(50.0, per, 200e9)
    assert a["gflops"] == pytest.approx(50 * per / 1e9) and a["of_peak"] == pytest.approx(50 * per / 200e9)
    assert flops.achieved(None, per, 200e9) == {"gflops": None, "of_peak": None}
    assert flops.achieved(50.0, per, None)["of_peak"] is None
    assert flops.achieved(0.01, None, 200e9) == {"gflops": None, "of_peak": None}  # DPO: not counted


def test_data_stats_count_the_tokenized_rows(tmp_path):
    import sentencepiece

    spm = next(
        (
            p
            for p in (harness.TOKENIZER_MODEL, os.path.join(harness.TINY_MODEL, "sentencepiece.bpe.model"))
            if os.path.isfile(p)
        ),
        None,
    )
    if spm is None:
        pytest.skip("no SentencePiece model: neither the shared Llama-2 tokenizer nor build/tiny-llama's")

    rows = [{"src": "Name a colour.", "tgt": "Blue."}, {"src": "Count to three.", "tgt": "One, two, three."}]
    path = tmp_path / "train.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sp = sentencepiece.SentencePieceProcessor(model_file=spm)
    lengths = [2 + len(sp.encode(r["src"])) + len(sp.encode(r["tgt"])) for r in rows]
    supervised = sum(1 + len(sp.encode(r["tgt"])) for r in rows)
    s = limits.data_stats(str(path), spm, 1024)
    assert s["examples"] == 2 and s["mean_length"] == pytest.approx(sum(lengths) / 2)
    assert s["context"] == pytest.approx(flops.causal_context(lengths))
    assert s["supervised_fraction"] == pytest.approx(supervised / sum(lengths))


def test_the_peak_measurement_runs_and_writes_its_figures(tmp_path, capsys):
    """A small real run (tiny shapes) through the harness: the JSON e2e reads has every figure."""
    out = tmp_path / "peak.json"
    got = limits.measure_peak(str(out), TINY, 100, "--tokens", 64, "--square", 256, "--repeats", 1, "--copy-mib", 4)
    assert got == json.loads(out.read_text())
    assert "ISA" in capsys.readouterr().out  # the CPU line is passed on
    assert got["cpu"]["isa"] in ("avx512", "avx2", "baseline") and got["cpu"]["model"]
    assert [m["label"].split(" [")[0] for m in got["matmul"]] == [
        "q/k/v/o",
        "up/gate",
        "down",
        "LM head",
        "LoRA A r8",
        "square",
    ]
    assert got["peak_gflops"] == peak.peak_of(got["matmul"]) > 0
    assert got["copy"]["numpy_gbs"] > 0 and got["copy"]["paddle_gbs"] > 0
    assert int(got["threads"]) >= 1 and got["matmul"][-1]["gflops_cpu"] > 0  # the square's, per CPU time


# ------------------------------------------------------------------ the regression guard

HEADER = "| " + " | ".join(guard.COLUMNS) + " |\n|---|---|---|---|---|---|---|---|\n"


def doc(*rows):
    return f"# x\n\n{guard.BEGIN}\n{HEADER}" + "".join(r + "\n" for r in rows) + f"{guard.END}\nafter\n"


def test_the_docs_guard_table_parses():
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        guard.parse_baselines(f.read())


def test_the_last_row_of_an_isa_and_case_is_the_baseline():
    text = doc(
        "| avx512 | lora | 80.0 | 2.50 | d1 | c1 | quiet | x |",
        "| avx2 | lora | 50.0 | 2.60 | d1 | c1 | q | x |",
        "| avx512 | lora | 90.0 | 2.40 | d2 | c2 | quiet | x |",
    )
    b = guard.parse_baselines(text)
    assert b[("avx512", "lora")]["sup_tok_s"] == 90.0 and b[("avx512", "lora")]["line"] == 8
    assert b[("avx2", "lora")]["sup_tok_s"] == 50.0
    rows = guard.record_rows({"packed": {"sup_tok_s": 70.0, "peak_rss_gib": 3.0}}, "avx512", "d3", "c3", "l", "cmd")
    again = guard.parse_baselines(guard.append_rows(text, rows))
    assert again[("avx512", "packed")]["sup_tok_s"] == 70.0 and again[("avx512", "lora")]["sup_tok_s"] == 90.0
    assert guard.append_rows(text, rows).endswith(f"{guard.END}\nafter\n")


@pytest.mark.parametrize(
    "text, message",
    [
        ("no table here", "want exactly one"),
        (
            f"{guard.BEGIN}\n| isa | case |\n|---|---|\n{guard.END}\n",
            ":2: the guard's table must start with the header",
        ),
        (doc("| avx512 | lora | 80.0 | 2.50 |"), ":6: 4 cells, want 8"),
        (
            doc("| avx512 | lora | fast | 2.50 | d | c | l | x |"),
            ":6: supervised tok/s and peak RSS GiB must be numbers",
        ),
    ],
)
def test_a_malformed_table_is_named_by_line(text, message):
    with pytest.raises(guard.GuardTableError, match=message):
        guard.parse_baselines(text, "docs/benchmarks.md")


def test_compare_flags_slower_and_heavier_beyond_the_tolerance_only():
    base = {
        ("avx512", "lora"): {"sup_tok_s": 100.0, "peak_rss_gib": 2.0},
        ("avx512", "packed"): {"sup_tok_s": 80.0, "peak_rss_gib": 3.0},
    }
    now = {"lora": {"sup_tok_s": 90.0, "peak_rss_gib": 2.5}, "packed": {"sup_tok_s": 60.0, "peak_rss_gib": 3.0}}
    v = {x["case"]: x for x in guard.compare(now, base, "avx512", 0.15)}
    assert v["lora"]["flags"] == ["more memory"]  # 0.90x speed is within 15%; 1.25x memory is not
    assert v["packed"]["flags"] == ["slower"]  # 0.75x
    other = guard.compare(now, base, "avx2", 0.15)  # another ISA's figures are never compared with
    assert all(x["recorded"] is None and not x["flags"] for x in other)
    assert "nothing recorded for avx2" in guard.report(other, "avx2", 0.15)
    assert "| lora | 90.0 | 100.0 (" in guard.report(list(v.values()), "avx512", 0.15)


def _quick(tmp_path, monkeypatch, text, runs, isa="avx512", **flags):
    """e2e's --quick comparison over ``runs`` with docs/benchmarks.md = ``text``; (exit code, the docs after)."""
    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir(exist_ok=True)
    docs.write_text(text)
    monkeypatch.setattr(e2e, "ROOT", str(tmp_path))
    a = types.SimpleNamespace(**{"tolerance": 0.15, "record": False, "fail_on_slowdown": False, **flags})
    return e2e.quick_guard(a, runs, {"isa": isa, "model": "AMD EPYC"}), docs.read_text()


RECORDED = doc(
    "| avx512 | lora | 80.0 | 2.50 | d1 | c1 | quiet | x |", "| avx512 | packed | 80.0 | 3.00 | d1 | c1 | q | x |"
)
SLOWER = [
    {"case": "lora", "sup_tok_s": 60.0, "peak_rss_gib": 2.5},
    {"case": "packed", "sup_tok_s": 79.0, "peak_rss_gib": 3.0},
]


def test_quick_guard_exits_1_on_a_slowdown_only_when_asked(tmp_path, monkeypatch, capsys):
    rc, _ = _quick(tmp_path, monkeypatch, RECORDED, SLOWER)
    out = capsys.readouterr().out
    assert rc == 0 and "| lora | 60.0 | 80.0 (d1, c1) | 0.75x |" in out and "slower" in out
    assert "| packed | 79.0 | 80.0 (d1, c1) | 0.99x | 3.00 GiB | 3.00 GiB | 1.00x | ok |" in out
    assert _quick(tmp_path, monkeypatch, RECORDED, SLOWER, fail_on_slowdown=True)[0] == 1
    assert _quick(tmp_path, monkeypatch, RECORDED, SLOWER[1:], fail_on_slowdown=True)[0] == 0


def test_quick_guard_records_and_refuses_a_broken_table(tmp_path, monkeypatch, capsys):
    rc, after = _quick(tmp_path, monkeypatch, doc(), SLOWER[:1], isa="avx2", record=True, fail_on_slowdown=True)
    assert rc == 0  # nothing recorded for the ISA: reported, never flagged
    assert "nothing recorded for avx2" in capsys.readouterr().out
    assert guard.parse_baselines(after)[("avx2", "lora")]["sup_tok_s"] == 60.0
    rc, _ = _quick(tmp_path, monkeypatch, "no table", SLOWER)
    assert rc == 2 and "want exactly one" in capsys.readouterr().err


def test_guard_flags_go_with_quick(capsys):
    with pytest.raises(SystemExit) as e:
        e2e.main(["--record"])
    assert e.value.code == 2 and "go with --quick" in capsys.readouterr().err


def test_e2e_puts_each_toolkit_against_the_peak(tmp_path, capsys):
    """machine_limit (a recorded peak, the data's statistics) -> the GFLOP/s column of e2e's table."""
    spm = os.path.join(harness.TINY_MODEL, "sentencepiece.bpe.model")
    if not os.path.isfile(spm):
        pytest.skip("no build/tiny-llama tokenizer")
    (tmp_path / "llama-0.25b").mkdir()
    (tmp_path / "llama-0.25b" / "sentencepiece.bpe.model").write_bytes(open(spm, "rb").read())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.json").write_text(json.dumps({"src": "Name a colour.", "tgt": "Blue."}) + "\n")
    cpu = {"model": "AMD EPYC", "vendor": "AuthenticAMD", "flags": ["avx2", "avx512f"], "isa": "avx512"}
    (tmp_path / "peak.json").write_text(json.dumps({"cpu": cpu, "peak_gflops": 200.0, "date": "d"}))
    a = types.SimpleNamespace(
        model="0.25b", peak_json=str(tmp_path / "peak.json"), no_peak=False, scratch=str(tmp_path)
    )
    limit = e2e.machine_limit(a, {"vocab": 32000}, str(tmp_path / "data"))
    assert "ISA avx512" in capsys.readouterr().out and limit["peak_flops"] == 200e9
    per = limit["per_sup_token"]["lora"]
    assert per == limits.flops_per_supervised_token(e2e.SHAPES["0.25b"], 32000, limit["stats"], e2e.RANK)
    assert "dpo" not in limit["per_sup_token"] and per == limit["per_sup_token"]["packed"]
    runs = []
    for toolkit, tok_s in (("ours", 100.0), ("TRL + PEFT", 50.0)):
        r = {
            "toolkit": toolkit,
            "detail": "d",
            "case": "lora",
            "sup_tok_s": tok_s,
            "step_s": 1.0,
            "peak_rss_gib": 2.0,
            "cpu_pct": 190.0,
            "final_loss": 1.0,
            "padding": None,
            **flops.achieved(tok_s, per, limit["peak_flops"]),
        }
        runs.append(r)
    text = "\n".join(e2e.table(runs, "lora"))
    assert f"| {100 * per / 1e9:.1f} ({100 * per / 200e9:.0%}) |" in text
    assert "| ours / TRL + PEFT |  | 2.00x |  |" in text
    assert "GFLOP per supervised token" in e2e.limit_lines(limit, runs)


@pytest.mark.parametrize("extra", [["--model", "0.8b"], ["--model", "ernie"], ["--steps", "5"], ["--cases", "lora"]])
def test_quick_refuses_settings_it_would_override(extra, capsys):
    with pytest.raises(SystemExit) as e:
        e2e.main(["--quick", *extra])
    assert e.value.code == 2 and f"drop {extra[0]}" in capsys.readouterr().err


def test_flop_count_matches_torchs_flop_counter_on_an_ernie_shaped_lora_model():
    """As the Llama test above, on transformers' own ``Ernie4_5ForCausalLM`` (``bench.e2e --model ernie``'s
    architecture): head_dim 32 x 4 heads = 128 != hidden 64, so q/o and the attention term are 128 wide; k/v
    2 x 32; tied input / output embeddings (the LM head is the frozen embedding matrix)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    if not hasattr(transformers, "Ernie4_5ForCausalLM"):
        pytest.skip("transformers without ERNIE 4.5")
    from torch.utils.flop_counter import FlopCounterMode

    shape = dict(TINY, head_dim=32)
    torch.manual_seed(0)
    cfg = transformers.Ernie4_5Config(vocab_size=100, max_position_embeddings=64, tie_word_embeddings=True, **shape)
    model = transformers.Ernie4_5ForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=list(flops.DECODER_LINEARS))
    )
    length = 12
    ids = torch.randint(0, 100, (1, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    ours = flops.flops_per_token(shape, 100, context=flops.causal_context([length]), lora_rank=2)
    width = shape["num_attention_heads"] * shape["head_dim"]
    assert ours["attention"] == 12 * width * flops.causal_context([length]) * shape["num_hidden_layers"]
    dense_attention = 12 * width * length * shape["num_hidden_layers"]
    rotary = 2 * (shape["head_dim"] // 2) * length  # the rotary angles' [head_dim / 2, 1] x [1, L] matmul
    assert counter.get_total_flops() == (ours["total"] - ours["attention"] + dense_attention) * length + rotary


def test_model_spm_reads_either_layouts_tokenizer(tmp_path):
    assert limits.model_spm(str(tmp_path)) is None
    (tmp_path / "tokenizer.model").write_bytes(b"x")  # transformers' name (bench/ernie_shape.py's checkpoint)
    assert limits.model_spm(str(tmp_path)) == str(tmp_path / "tokenizer.model")
    (tmp_path / "sentencepiece.bpe.model").write_bytes(b"x")  # PaddleNLP's Llama
    assert limits.model_spm(str(tmp_path)) == str(tmp_path / "sentencepiece.bpe.model")


def test_trl_does_ours_work_unpacked_in_ours_order_and_without_checkpointing():
    """bench/e2e.py's TRL spec: no gradient checkpointing (TRL 0.22 turns it on by default, ours runs without),
    and unpacked the examples in ours' order (bench/moe.py asks the same); without ``same_work`` TRL's own defaults."""
    spec = e2e_runs.trl_spec("/m", "/d", "/o", 5, packing=False, use_fast=False, same_work=True)
    assert spec["gradient_checkpointing"] is False and spec["order_seed"] == e2e.SEED and spec["use_fast"] is False
    packed = e2e_runs.trl_spec("/m", "/d", "/o", 5, packing=True, same_work=True)
    assert packed["gradient_checkpointing"] is False and "order_seed" not in packed  # TRL packs in its own order
    plain = e2e_runs.trl_spec("/m", "/d", "/o", 5, packing=False)
    assert "gradient_checkpointing" not in plain and "order_seed" not in plain


def test_the_trl_order_is_ours_order():
    """bench/e2e_trl.py's order_seed against ours' own sampler order (batch 1 x accumulation 4, one process)."""
    from bench import e2e_trl
    from paddlenlp_ext.data.global_batches import global_batches

    n = 949
    ours = [i for batch in global_batches(n, 4, e2e.SEED, 0, drop_last=False) for i in batch][:n]
    assert e2e_trl.ours_order(n, e2e.SEED) == ours


def test_model_ernie_runs_ours_and_trl_on_one_checkpoint_without_paddlenlp(tmp_path, monkeypatch, capsys):
    """``--model ernie``'s wiring, with the model build and the runs stubbed: the transformers-layout checkpoint
    goes to both sides as it is, TRL gets the same-work spec and the slow tokenizer, PaddleNLP is skipped with
    the reason, and the table puts ours against TRL."""
    calls = {}
    monkeypatch.setattr(
        e2e, "ensure_ernie", lambda d: calls.setdefault("built", d) and {"params": 360748032, "vocab": 103424}
    )
    monkeypatch.setattr(e2e, "ensure_data", lambda scratch: str(tmp_path / "data"))
    monkeypatch.setattr(e2e, "trl_python", lambda scratch, given: (given, None))
    monkeypatch.setattr(e2e, "hf_copy", lambda *a: pytest.fail("the ERNIE checkpoint needs no copy"))

    def run(tok_s, **extra):
        return {
            "sup_tok_s": tok_s,
            "step_s": 1.0,
            "peak_rss_gib": 2.0,
            "cpu_pct": 190.0,
            "final_loss": 1.0,
            "padding": None,
            "tokens": 100,
            "supervised_tokens": 90,
            **extra,
        }

    monkeypatch.setattr(
        e2e,
        "run_once",
        lambda setting, model_dir, *a, **k: calls.setdefault("ours", model_dir) and run(20.0, summary={}),
    )
    monkeypatch.setattr(
        e2e,
        "run_trl",
        lambda py, hf_dir, *a, **k: (
            calls.setdefault("trl", (py, hf_dir, k))
            and run(10.0, toolkit="TRL + PEFT", detail="2 torch threads", work="w")
        ),
    )
    (tmp_path / "llm").mkdir()
    for f in ("run_finetune.py", "utils/argument.py", "utils/data.py"):
        os.makedirs(os.path.dirname(tmp_path / "llm" / f), exist_ok=True)
        (tmp_path / "llm" / f).write_text("")
    assert (
        e2e.main(
            [
                "--model",
                "ernie",
                "--cases",
                "lora",
                "--steps",
                "2",
                "--repeats",
                "1",
                "--no-peak",
                "--scratch",
                str(tmp_path),
                "--paddlenlp-llm",
                str(tmp_path / "llm"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    model_dir = str(tmp_path / "ernie-0.36b")
    assert calls["built"] == calls["ours"] == model_dir
    py, hf_dir, kwargs = calls["trl"]
    assert py == e2e.sys.executable and hf_dir == model_dir and kwargs["use_fast"] is False and kwargs["same_work"]
    assert "PaddleNLP column skipped: PaddleNLP 3.0.0b4 has no ERNIE 4.5 model" in out
    assert "| ours / TRL + PEFT |  | 2.00x |" in out and "no gradient checkpointing on either side" in out


def test_bench_moe_runs_trl_with_ours_work(tmp_path, monkeypatch, capsys):
    """bench/moe.py asks TRL + PEFT for ours' work (same_work: no gradient checkpointing, ours' order), as
    bench/e2e.py does, and its table says what TRL ran; the runs themselves are stubbed (the bench's numbers are
    docs/benchmarks.md's)."""
    from bench import moe

    calls = []

    def fake_trl(py, model, data, out, steps, **kw):
        calls.append(kw)
        return dict(
            sup_tok_s=1.0,
            step_s=2.0,
            peak_rss_gib=1.0,
            cpu_pct=50.0,
            final_loss=1.0,
            work="gradient checkpointing off, unpacked, order ours",
        )

    def fake_ours(setting, model, data, out, steps):
        return dict(sup_tok_s=3.0, step_s=1.0, peak_rss_gib=0.5, cpu_pct=90.0, final_loss=1.0)

    info = {"mixtral-tiny": {"params": 2, "active": 1}, "dense-tiny": {"params": 1, "active": 1}}
    monkeypatch.setattr(moe.h, "require_shared", lambda *a, **k: None)
    monkeypatch.setattr(moe, "trl_python", lambda scratch, py: (py, None))
    monkeypatch.setattr(moe, "ensure_models", lambda s, size, py: (s + "/mixtral-tiny", s + "/dense-tiny", info))
    monkeypatch.setattr(moe, "ensure_data", lambda s: s)
    monkeypatch.setattr(moe, "run_trl", fake_trl)
    monkeypatch.setattr(moe, "run_once", fake_ours)
    assert moe.main(["--size", "tiny", "--repeats", "1", "--scratch", str(tmp_path)]) == 0
    assert calls and all(kw["same_work"] is True and kw["packing"] is False for kw in calls)
    out = capsys.readouterr().out
    assert "TRL + PEFT work: gradient checkpointing off, unpacked, order ours" in out
