"""The decoder's rows through the CLI: transformers-saved checkpoints fine-tuned by llm/run_finetune.py.

Every family-table row that the toolkit builds with our decoder (``Family.decoder``) gets a
directory as the hub ships one: transformers' ``save_pretrained`` of a random tiny model with the
row's non-default knobs (tests/test_decoder_parity.KNOBS: windows smaller than the sequence,
soft-caps, scalings, tied embeddings), bf16, sharded, plus a tokenizer.json-only tokenizer.
Then LoRA (unpacked, and packed: zero padding with FlashMask start rows), nf4 QLoRA (quantized while
streaming) and full fine-tuning train with a falling loss, and what the decoder does not run yet is refused at config time (exit 2, naming the key).
The selected rows' independent CLI calls run two at a time across rows (conftest.run_jobs: a tiny model's CLI
run is mostly start-up on one core) in a module fixture, on the first row's test; each row's test then reports
that row's failing runs with their output tails.
"""

import functools
import json
import os

import pytest

from conftest import ROOT, run_jobs, selected_params
from hf_tokenizers import build as build_tokenizer
from paddlenlp_ext.models.family_table import FAMILIES
from test_decoder_parity import LONGROPE
from test_hf_e2e import finetune, run  # the same 20-step LoRA run and CLI call as the Llama-family tests

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

#: the rows built with our decoder, and qwen3_moe, whose transformers-layout checkpoints train on the decoder
#: (family_table.layout_row; its PaddleNLP layout: tests/test_qwen3_moe.py)
DECODER_ROWS = [k for k, f in FAMILIES.items() if f.decoder or (f.hf_row is not None and f.hf_row.decoder)]
LORA_CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json")


def save_row(model_type, out_dir, dtype="bfloat16"):
    from test_decoder_parity import BASE, KNOBS  # the same knobs as the parity suite

    kw = {**BASE, **KNOBS.get(model_type, {}), "vocab_size": 704, "initializer_range": 0.2}
    kw["max_position_embeddings"] = 64 if model_type == "phi3" else 256  # phi3: longrope's long factors in use
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(out_dir, max_shard_size="200KB")
    build_tokenizer(out_dir, "llama3")
    return out_dir


def losses(out):
    with open(os.path.join(out, "trainer_state.json")) as f:
        return [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]


#: run name -> (CLI overrides, the method run_summary.json reports)
RUNS = {
    "lora": ((), "lora"),
    "packed": (("--zero_padding", "true", "--flash_mask", "true", "--use_flash_attention", "true"), "lora"),
    "nf4": (("--weight_quantize_algo", "nf4"), "lora+nf4"),
    "full": (("--lora", "false", "--learning_rate", "3e-3"), "full"),
}


@pytest.fixture(scope="module")
def row_base(tmp_path_factory):
    """A row's transformers-saved checkpoint (bf16), built on first use and shared by this module's tests (they
    only read it)."""
    root, built = tmp_path_factory.mktemp("rows"), {}

    def get(model_type):
        if model_type not in built:
            built[model_type] = save_row(model_type, str(root / model_type))
        return built[model_type]

    return get


def failed(failures):
    """run_jobs' failures as the assertion message: one entry per failing job ("<row> <run>"), its output tail."""
    return "\n".join(f"--- {name} ---\n{text}" for name, text in failures.items())


def _train_one(model_type, name, base, out):
    extra, method = RUNS[name]
    finetune(base, out, *extra)
    with open(os.path.join(out, "run_summary.json")) as f:
        summary = json.load(f)
    assert summary["method"] == method, (model_type, name, summary["method"])
    assert summary["quantization" if name == "nf4" else "load"]["layout"] == "transformers", (model_type, name)
    got = losses(out)
    assert len(got) == 20 and sum(got[-3:]) < 0.9 * sum(got[:3]), (model_type, name, got)


@pytest.fixture(scope="module")
def trained(request, row_base, tmp_path_factory):
    """{"<row> <run>": failure text} of the selected rows' four fine-tunes, all run at once two at a time (across
    rows, so a slow row's runs overlap the next row's) on the first row's test."""
    root = tmp_path_factory.mktemp("runs")
    test = "test_lora_packing_qlora_and_full_train_a_transformers_checkpoint"
    rows = [p["model_type"] for p in selected_params(request, test)]
    return run_jobs(
        {
            f"{model_type} {name}": functools.partial(
                _train_one, model_type, name, row_base(model_type), str(root / model_type / name)
            )
            for model_type in rows
            for name in RUNS
        }
    )


@pytest.mark.parametrize("model_type", DECODER_ROWS)
def test_lora_packing_qlora_and_full_train_a_transformers_checkpoint(trained, model_type):
    mine = {job: text for job, text in trained.items() if job.split()[0] == model_type}
    assert not mine, failed(mine)


def test_what_the_decoder_does_not_run_is_refused_at_config_time(row_base, tmp_path):
    base = row_base("mistral")  # a dense row (the MoE rows refuse tensor parallel)

    def tp_alone():
        # tensor parallel alone is accepted (tests/test_decoder_tp.py); what is left is the launch it needs
        r = finetune(base, str(tmp_path / "tp"), "--tensor_parallel_degree", "2", check=False)
        out = r.stdout + r.stderr
        assert (
            r.returncode == 2 and "1 problem found" in out and "paddle.distributed.launch --nproc_per_node 2" in out
        ), (r.returncode, out[-3000:])

    def tp_and_pp():
        # tensor x pipeline together is not
        r = finetune(
            base,
            str(tmp_path / "tp_pp"),
            "--tensor_parallel_degree",
            "2",
            "--pipeline_parallel_degree",
            "2",
            check=False,
        )
        out = r.stdout + r.stderr
        assert r.returncode == 2 and "use one of them" in out and "Traceback" not in out, (r.returncode, out[-3000:])

    failures = run_jobs({"tensor parallel alone": tp_alone, "tensor x pipeline": tp_and_pp})
    assert not failures, failed(failures)


PREDICT = os.path.join(ROOT, "llm", "predict", "predictor.py")


def _predict_one(model_type, base, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text('{"src": "hello world, tell me"}\n{"src": "abc"}\n', encoding="utf-8")
    out = tmp_path / "pred.json"
    run(
        [
            PREDICT,
            "--model_name_or_path",
            base,
            "--data_file",
            prompts,
            "--output_file",
            out,
            "--decode_strategy",
            "greedy_search",
            "--src_length",
            "48",
            "--max_length",
            "64",
            "--device",
            "cpu",
        ]
    )
    tok = transformers.AutoTokenizer.from_pretrained(base)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        base, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 2, (model_type, rows)
    # the predictor ends an answer at the tokenizer's eos or generation_config.json's (predict.session.eos_token_ids)
    eos = sorted({tok.eos_token_id, hf.generation_config.eos_token_id} - {None})
    for r in rows:
        ids = tok(r["src"], return_tensors="pt").input_ids
        with torch.no_grad():
            if model_type in LONGROPE:  # transformers' generate is off at the longrope switch (test_decoder_parity)
                seq = ids[0].tolist()
                while len(seq) < 64 and (len(seq) == ids.shape[1] or seq[-1] not in eos):
                    seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
                gen = torch.tensor([seq])
            else:
                gen = hf.generate(
                    ids, max_new_tokens=64 - ids.shape[1], do_sample=False, eos_token_id=eos, pad_token_id=0
                )
        answer = gen[0, ids.shape[1] :].tolist()
        answer = answer[: next((i for i, t in enumerate(answer) if t in eos), len(answer))]  # up to, not incl., EOS
        expected = tok.decode(answer, skip_special_tokens=True)
        assert r["output"] == expected, (model_type, r["src"], r["output"], expected)


@pytest.fixture(scope="module")
def predicted(request, row_base, tmp_path_factory):
    """{row: failure text} of the selected rows' predictor checks, all run at once two at a time."""
    root = tmp_path_factory.mktemp("predict")
    test = "test_predictor_greedy_text_equals_transformers_generate"
    rows = [p["model_type"] for p in selected_params(request, test)]
    jobs = {}
    for model_type in rows:
        (root / model_type).mkdir()
        jobs[model_type] = functools.partial(_predict_one, model_type, row_base(model_type), root / model_type)
    if rows:
        transformers.AutoTokenizer.from_pretrained(row_base(rows[0]))  # its imports done once, not by two threads
    return run_jobs(jobs)


@pytest.mark.parametrize("model_type", DECODER_ROWS)
def test_predictor_greedy_text_equals_transformers_generate(predicted, model_type):
    """llm/predict/predictor.py (greedy) on the row's transformers-saved directory writes the text transformers'
    own generate gives for the same prompt ids (tokenized by transformers' AutoTokenizer)."""
    assert model_type not in predicted, predicted.get(model_type)
