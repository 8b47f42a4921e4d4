"""Runs inside the transformers 5.x judge venv (tests/hf5_judge.py): never imports paddle or paddlenlp_ext.

    python hf5_worker.py COMMAND request.json result.json

* ``save``: build a random ``<Family>ForCausalLM`` (``config_class`` / ``model_class``, or the Auto
  classes of ``model_type``) from ``config`` (transformers 5.x's own keyword arguments:
  ``rope_parameters``, ``layer_types``, ...) with seed ``seed`` (``weights_std``: norms
  1 + 0.3 N(0, 1), the rest weights_std N(0, 1)) and ``save_pretrained`` it to ``out_dir``
  (safetensors, as 5.x writes them; ``dtype`` and ``max_shard_size`` optional).
* ``tokenizer``: re-save a tokenizer as 5.x does; its ids and decodings of ``texts``.
* ``batch``: ``{"jobs": [[command, args], ...]}`` -> the list of their results (torch and
  transformers are imported once).
* ``run``: load ``model_dir`` with ``AutoModelForCausalLM`` as a user would (``attn_implementation``
  optional), write the fp32 logits of ``ids`` (an .npy of int64 [B, L]) to ``logits_out`` and return ``greedy`` (``max_new_tokens`` tokens
  of ``model.generate(do_sample=False)`` after ``prompt``), plus what 5.x read from config.json.
"""

import json
import sys

import numpy as np
import torch
import transformers


def save(a):
    torch.manual_seed(a.get("seed", 0))
    if a.get("model_type"):  # transformers' Auto classes pick the classes of a model_type
        config = transformers.AutoConfig.for_model(a["model_type"], **a["config"])
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = getattr(transformers, a["model_class"])(getattr(transformers, a["config_class"])(**a["config"]))
    if a.get("weights_std"):  # weights large enough that every knob moves the logits (tests/test_decoder_parity)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else a["weights_std"] * torch.randn_like(p))
    model = model.to(getattr(torch, a.get("dtype", "float32")))
    model.save_pretrained(a["out_dir"], **({"max_shard_size": a["max_shard_size"]} if a.get("max_shard_size") else {}))
    return {"version": transformers.__version__}


def run(a):
    kw = {"attn_implementation": a["attn_implementation"]} if a.get("attn_implementation") else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(a["model_dir"], dtype=torch.float32, **kw).eval()
    ids = torch.tensor(np.load(a["ids"]))
    with torch.no_grad():
        np.save(a["logits_out"], model(ids).logits.numpy())
        prompt = torch.tensor([a["prompt"]])
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=a["max_new_tokens"],
            eos_token_id=a["eos"],
            pad_token_id=0,
        )
    c = model.config
    return {
        "version": transformers.__version__,
        "class": type(model).__name__,
        "greedy": out[0, prompt.shape[1] :].tolist(),
        "rope_parameters": getattr(c, "rope_parameters", None),
        "layer_types": getattr(c, "layer_types", None),
        "sliding_window": getattr(c, "sliding_window", None),
    }


def tokenizer(a):
    """Re-save the tokenizer of ``src`` as 5.x does (with ``extra`` additional special tokens) to ``dst``;
    the ids and the special-token-free decoding of ``texts``."""
    tok = transformers.AutoTokenizer.from_pretrained(a["src"])
    if a.get("extra"):
        tok.add_special_tokens({"additional_special_tokens": a["extra"]})
    tok.save_pretrained(a["dst"])
    tok = transformers.AutoTokenizer.from_pretrained(a["dst"])
    ids = [tok(t)["input_ids"] for t in a["texts"]]
    return {"class": type(tok).__name__, "ids": ids, "decoded": [tok.decode(i, skip_special_tokens=True) for i in ids]}


if __name__ == "__main__":
    command, req, res = sys.argv[1:4]
    with open(req) as f:
        args = json.load(f)
    commands = {"save": save, "run": run, "tokenizer": tokenizer}
    if command == "batch":  # one interpreter start for many jobs: [[command, args], ...]
        result = [commands[c](a) for c, a in args["jobs"]]
    else:
        result = commands[command](args)
    with open(res, "w") as f:
        json.dump(result, f, default=str)
