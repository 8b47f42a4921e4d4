"""The server (llm/predict/server.py -> paddlenlp_ext.serve) on rows our decoder builds: a transformers-saved
checkpoint (bf16, sharded, tokenizer.json; ``test_decoder_cli.save_row``) is planned and loaded by the server's
own loaders (predict/'s session, which registers the decoder), and a greedy completion request run by its
scheduler in process answers the tokens transformers 4.55's own ``generate`` gives for the same prompt ids."""

import asyncio

import pytest

from paddlenlp_ext.serve import models as serve_models
from paddlenlp_ext.serve.completions import parse_completion
from paddlenlp_ext.serve.protocol import Sampling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _complete(served, ids, max_tokens):
    """The events of one greedy completion request for prompt ``ids``, run by the scheduler's step."""
    from paddlenlp_ext.serve.engine import Job, Scheduler

    loop = asyncio.new_event_loop()
    req = parse_completion(
        {"model": "base", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0},
        ["base"],
        Sampling(),
    )
    job = Job(req, served, serve_models.prompt_ids(req, served), max_tokens, loop)
    Scheduler([served])._run([job])  # noqa: SLF001 -- the worker's step, run here synchronously
    loop.run_until_complete(asyncio.sleep(0.01))
    events = []
    while not job.queue.empty():
        events.append(job.queue.get_nowait())
    loop.close()
    return events


@pytest.mark.parametrize("model_type", ["gemma2", "glm4"])  # sandwich norms + soft-caps + tied; fused gate_up
def test_server_loads_a_decoder_row_and_answers_transformers_greedy_text(model_type, tmp_path):
    from paddlenlp_ext.predict.options import PredictOptions
    from test_decoder_cli import save_row

    base = save_row(model_type, str(tmp_path / "base"))
    models, problems = serve_models.plan_models(PredictOptions(model_name_or_path=base, max_length=64), "base", [])
    assert not problems, problems
    serve_models.load_models(models)
    served = models[0]
    tok = transformers.AutoTokenizer.from_pretrained(base)
    ids = tok("hello world, tell me").input_ids
    events = _complete(served, ids, 8)
    text = "".join(e[1] for e in events if e[0] == "delta")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        base, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    answer = gen[0, len(ids) :].tolist()
    eos = sorted({tok.eos_token_id, hf.generation_config.eos_token_id} - {None})
    answer = answer[: next((i for i, t in enumerate(answer) if t in eos), len(answer))]
    assert answer, "transformers ended at once: the comparison would be empty"
    assert text == tok.decode(answer, skip_special_tokens=True), (model_type, events[-1:])
