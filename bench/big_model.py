"""Build (once) the ~0.84B-parameter random-weight Llama and the Alpaca data used by the QLoRA memory benchmark.

    .venv/bin/python -m bench.big_model [--model_dir build/llama-0.8b] [--data_dir build/alpaca_en_demo]

Model: PaddleNLP ``LlamaConfig(hidden 2048, intermediate 5504, 14 layers, 16 heads / 16 kv heads,
vocab 32000)`` = 839,444,480 parameters (3.36 GB in fp32).  The parameter names and shapes come from
the model built under ``no_init_weights()`` + ``paddle.LazyGuard()`` (no memory allocated); the values
(normal(0, 0.02); RMSNorm weights 1.0) are generated tensor by tensor and written with
``safetensors.numpy.save_file`` into shards of at most 1 GB (``model-0000i-of-0000N.safetensors``) +
``model.safetensors.index.json`` + config.json, so the build never holds more than one shard.
Tokenizer: the real Llama-2 SentencePiece model from ``../shared/data/llama2_tokenizer.model``.
A marker file ``bench_build.json`` (build time, parameter count) makes later calls no-ops.

Data: ``../shared/data/alpaca_en_demo.json`` (a JSON list of {instruction, input, output}) becomes
``train.json`` / ``dev.json`` JSON lines {"src": instruction [+ "\\n" + input], "tgt": output}.

Exit code 2 when the shared data (``../shared/data``) is missing.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402

ROOT, SHARED, TOKENIZER_MODEL, ALPACA = h.ROOT, h.SHARED, h.TOKENIZER_MODEL, h.ALPACA
MARKER = "bench_build.json"
SHARD_LIMIT = 10**9  # bytes, PaddleNLP's "1GB"
MIN_SHARDS = 4
DEV_EXAMPLES = 50
MODEL_SHAPE = h.llama_shape(2048, 5504, 14, 16, 16, vocab_size=32000, max_position_embeddings=2048)


def llama_config():
    from paddlenlp.transformers import LlamaConfig

    return LlamaConfig(architectures=["LlamaForCausalLM"], **MODEL_SHAPE)


def lazy_shapes(cfg):
    """{state_dict name: shape} of LlamaForCausalLM(cfg), without allocating any parameter."""
    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM
    from paddlenlp.transformers.model_utils import no_init_weights

    with no_init_weights(), paddle.LazyGuard():
        model = AutoModelForCausalLM.from_config(cfg, dtype="float32")
    return {n: tuple(int(d) for d in p.shape) for n, p in model.state_dict().items()}


def plan_shards(shapes, limit=SHARD_LIMIT, min_shards=MIN_SHARDS):
    """Split names (state-dict order) into consecutive groups of at most ``limit`` bytes (fp32),
    with at least ``min_shards`` groups."""
    total = sum(4 * int(np.prod(s)) for s in shapes.values())
    limit = min(limit, -(-total // min_shards))
    groups, cur, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = 4 * int(np.prod(shape))
        if cur and size + nbytes > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    groups.append(cur)
    return groups, total


def random_tensor(rng, name, shape):
    if len(shape) == 1 and "norm" in name:  # RMSNorm weights: ones, as a real init
        return np.ones(shape, dtype=np.float32)
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= 0.02
    return out


def write_shards(model_dir, shapes, seed=0):
    from safetensors.numpy import save_file

    groups, total = plan_shards(shapes)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: random_tensor(rng, n, shapes[n]) for n in names}
        save_file(tensors, os.path.join(model_dir, fname), metadata={"format": "np"})
        del tensors
        weight_map.update({n: fname for n in names})
        print(f"  wrote {fname} ({len(names)} tensors)", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return len(groups), total


def write_tokenizer(model_dir):
    from paddlenlp.transformers import AutoTokenizer, LlamaTokenizer

    LlamaTokenizer(vocab_file=TOKENIZER_MODEL).save_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("Describe a process of making crepes.")["input_ids"]
    text = tok.decode(ids, skip_special_tokens=True)
    if tok.vocab_size != MODEL_SHAPE["vocab_size"] or text.strip() != "Describe a process of making crepes.":
        raise RuntimeError(f"tokenizer round trip failed: vocab {tok.vocab_size}, decoded {text!r}")


VERIFY_LOAD = r"""
import json, sys
from paddlenlp.transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype="float32")
names = set(m.state_dict())
index = set(json.load(open(sys.argv[1] + "/model.safetensors.index.json"))["weight_map"])
assert names == index, (sorted(names - index)[:5], sorted(index - names)[:5])
w = m.state_dict()["llama.layers.0.self_attn.q_proj.weight"]
assert 0.015 < float(w.std()) < 0.025, float(w.std())
print("verified: from_pretrained loads", len(names), "tensors")
"""


def verify_load(model_dir):
    """from_pretrained in a subprocess (about 3.4 GB, 15-30 s): every name loads, values are ours."""
    r = h.run([sys.executable, "-c", VERIFY_LOAD, model_dir], name="from_pretrained check", mark=None)
    print("  " + r.output.strip().splitlines()[-1], flush=True)


def build_model(model_dir, seed=0, verify=True):
    t0 = time.time()
    os.makedirs(model_dir, exist_ok=True)
    cfg = llama_config()
    shapes = lazy_shapes(cfg)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    print(f"building {model_dir}: {n_params:,} parameters", flush=True)
    n_shards, total = write_shards(model_dir, shapes, seed)
    cfg.save_pretrained(model_dir)
    write_tokenizer(model_dir)
    write_seconds = time.time() - t0
    if verify:
        verify_load(model_dir)
    info = dict(
        params=n_params,
        shards=n_shards,
        total_bytes=total,
        write_seconds=round(write_seconds, 1),
        build_seconds=round(time.time() - t0, 1),
        seed=seed,
    )
    with open(os.path.join(model_dir, MARKER), "w") as f:
        json.dump(info, f, indent=2)
    return info


def write_data(data_dir, n_dev=DEV_EXAMPLES, source=None):
    """Alpaca list (``source``, default ALPACA) -> train.json / dev.json JSON lines of {src, tgt};
    returns (n_train, n_dev)."""
    with open(source or ALPACA, encoding="utf-8") as f:
        items = json.load(f)
    rows = []
    for it in items:
        src = it["instruction"] + ("\n" + it["input"] if it.get("input") else "")
        if src.strip() and it.get("output", "").strip():
            rows.append({"src": src, "tgt": it["output"]})
    os.makedirs(data_dir, exist_ok=True)
    for name, part in (("train.json", rows[:-n_dev]), ("dev.json", rows[-n_dev:])):
        with open(os.path.join(data_dir, name), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
    return len(rows) - n_dev, n_dev


def ensure(model_dir, data_dir, verify=True):
    """Build what is missing; returns (model build info, whether it was built now)."""
    h.require_shared()
    if not os.path.isfile(os.path.join(data_dir, "train.json")):
        n_train, n_dev = write_data(data_dir)
        print(f"wrote {data_dir}: {n_train} train / {n_dev} dev examples", flush=True)
    marker = os.path.join(model_dir, MARKER)
    if os.path.isfile(marker):
        with open(marker) as f:
            return json.load(f), False
    return build_model(model_dir, verify=verify), True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", default=os.path.join(ROOT, "build", "llama-0.8b"))
    p.add_argument("--data_dir", default=os.path.join(ROOT, "build", "alpaca_en_demo"))
    p.add_argument("--no-verify", action="store_true", help="skip the from_pretrained check")
    p.add_argument("--info-json", help="write the build info (and whether it was built now) here")
    a = p.parse_args(argv)
    info, built = ensure(a.model_dir, a.data_dir, verify=not a.no_verify)
    print(f"model {'built' if built else 'cached'}: {json.dumps(info)}", flush=True)
    if a.info_json:
        with open(a.info_json, "w") as f:
            json.dump({**info, "built_now": built}, f)


if __name__ == "__main__":
    main()
