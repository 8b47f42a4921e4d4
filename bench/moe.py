"""Benchmark: an MoE LoRA fine-tune vs the dense model of the same active parameters, and ours vs TRL + PEFT.

    .venv/bin/python -m bench.moe [--size 0.8b|0.5b|0.3b|tiny] [--steps 5] [--repeats 2] [--scratch DIR]
                                  [--toolkits ours,dense,trl] [--trl-python PY] [--json F]

Models (random weights, built once by transformers 4.55 in the Hugging Face layout, ``save_pretrained``):

* **MoE**: ``MixtralForCausalLM``, 8 experts top-2 (softmax, renormalised), hidden 1024, 16 heads, expert
  intermediate 1408, vocab 32000 (the Llama-2 SentencePiece tokenizer of the shared data); ``--size 0.8b``:
  20 layers, 0.84B parameters (0.33B active per token: the size the memory claims need); ``0.5b``:
  12 layers, 0.53B parameters (0.22B active per token); ``0.3b``: 6 layers, 0.30B (0.14B active);
  ``tiny``: hidden 64, 2 layers, 4 experts (a smoke run of this script).
* **dense, equal active parameters**: ``LlamaForCausalLM`` with the same attention, embeddings and layers
  and ``intermediate_size = top_k x expert intermediate`` (2816): per token it multiplies the same number
  of weights as the MoE's two experts (the router's 8 x 1024 aside).

Runs, each in its own process through ``bench/harness.py`` (peak RSS of the process tree, CPU% over the
step lines), interleaved (MoE ours, dense ours, MoE TRL; then again, ``--repeats`` times), on the same alpaca
{src, tgt} rows, loss on the answer only, LoRA r8 / alpha 16 on attention q/k/v/o and every expert's Linears
(Mixtral's ``w1/w2/w3``; the dense model's gate/up/down), never the router, lr 1e-4, batch 1 x accumulation
4, max_length 1024, fp32, ``--steps`` optimizer steps:

* **ours**: ``llm/run_finetune.py`` as a user runs it (``bench/cpu_setup.py``'s arguments; the MoE row's
  default LoRA targets are exactly those above), its CPU set-up;
* **TRL + PEFT**: ``SFTTrainer`` + PEFT LoRA on transformers' own ``MixtralForCausalLM`` (``bench/e2e_trl.py``,
  torch's default threads), in ``--trl-python`` (default: this interpreter, whose venv has torch 2.13,
  transformers, peft and trl 0.22).  Same work as ours, as in bench/e2e.py: no gradient checkpointing
  (TRL 0.22's ``SFTConfig`` turns it on by default; ours does not checkpoint) and ours' example order.

Printed: per run and per toolkit the supervised tokens/s, median step time (steps 2..N), peak RSS, CPU%
and final loss; then, from this one run, side by side: MoE step / dense step (ours; target <= 1.5x),
ours / TRL supervised tokens/s (target >= 1.5x) and ours / TRL peak RSS (target <= 1.0x), with the
machine's load average at the start and the end (the machine is shared: compare the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402
from bench.cpu_setup import ROOT, ensure_data, run_once  # noqa: E402
from bench.e2e import run_trl, trl_python  # noqa: E402

fmt = h.fmt


def moe_shape(hidden: int, heads: int, layers: int, experts: int, expert_intermediate: int) -> dict:
    """The bench MoE's shape (top-2 routing, vocab 32000, full multi-head attention):
    ``moe_shape(64, 4, 2, 4, 48)["num_key_value_heads"]`` -> ``4``."""
    shape = h.llama_shape(hidden, None, layers, heads, heads, vocab_size=32000, max_position_embeddings=2048)
    del shape["intermediate_size"]  # the MoE's is per expert; the dense twin's is top_k x that
    return dict(shape, experts=experts, top_k=2, expert_intermediate=expert_intermediate)


#: --size -> shape: the realistic sizes differ only in depth
SIZES = {name: moe_shape(1024, 16, layers, 8, 1408) for name, layers in (("0.8b", 20), ("0.5b", 12), ("0.3b", 6))}
SIZES["tiny"] = moe_shape(64, 4, 2, 4, 48)
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"]
TOOLKITS = ("ours", "dense", "trl")

#: run in a child process (torch): ``BUILD MOE_DIR DENSE_DIR SPM SHAPE_JSON`` -> both checkpoints + bench_build.json
BUILD = r"""
import json, os, shutil, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
moe_dir, dense_dir, spm, s = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
common = dict(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], num_hidden_layers=s["num_hidden_layers"],
              num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"],
              max_position_embeddings=s["max_position_embeddings"], rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
configs = {moe_dir: (MixtralConfig(intermediate_size=s["expert_intermediate"], num_local_experts=s["experts"],
                                   num_experts_per_tok=s["top_k"], sliding_window=None, **common), MixtralForCausalLM),
           dense_dir: (LlamaConfig(intermediate_size=s["top_k"] * s["expert_intermediate"], **common),
                       LlamaForCausalLM)}
info = {}
for out, (cfg, cls) in configs.items():
    torch.manual_seed(0)
    model = cls(cfg)
    model.save_pretrained(out, safe_serialization=True)
    shutil.copyfile(spm, os.path.join(out, "tokenizer.model"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "pad_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": True}, f, indent=2)
    total = sum(p.numel() for p in model.parameters())
    idle = 0  # the experts a token does not use: (E - k) experts per MoE layer
    if cls is MixtralForCausalLM:
        per_expert = sum(p.numel() for p in model.model.layers[0].block_sparse_moe.experts[0].parameters())
        idle = cfg.num_hidden_layers * (cfg.num_local_experts - cfg.num_experts_per_tok) * per_expert
    info[os.path.basename(out)] = {"params": total, "active": total - idle}
    with open(os.path.join(out, "bench_build.json"), "w") as f:
        json.dump(info[os.path.basename(out)], f)
    print(f"built {out}: {total:,} parameters, {total - idle:,} active per token", flush=True)
"""


def ensure_models(scratch: str, size: str, py: str) -> tuple:
    """(MoE dir, dense dir, {name: {params, active}}), built once with ``py`` (an interpreter with transformers)."""
    moe_dir, dense_dir = os.path.join(scratch, f"mixtral-{size}"), os.path.join(scratch, f"dense-{size}")
    if not all(os.path.isfile(os.path.join(d, "bench_build.json")) for d in (moe_dir, dense_dir)):
        h.require_shared(h.TOKENIZER_MODEL, what="bench/moe.py")
        env = h.clean_env(("PYTHONPATH",))
        r = h.run(
            [py, "-c", BUILD, moe_dir, dense_dir, h.TOKENIZER_MODEL, json.dumps(SIZES[size])],
            name="model build",
            env=env,
            mark=None,
        )
        print(r.output.strip(), flush=True)
    info = {}
    for d in (moe_dir, dense_dir):
        with open(os.path.join(d, "bench_build.json")) as f:
            info[os.path.basename(d)] = json.load(f)
    return moe_dir, dense_dir, info


def side_by_side(runs: list) -> list:
    """The ratios of one run's means: MoE / dense step (ours), ours / TRL supervised tok/s and peak RSS.

    >>> rs = [{"who": "ours", "step_s": 3.0, "sup_tok_s": 90.0, "peak_rss_gib": 3.0},
    ...       {"who": "dense", "step_s": 2.0, "sup_tok_s": 130.0, "peak_rss_gib": 2.0},
    ...       {"who": "trl", "step_s": 6.0, "sup_tok_s": 45.0, "peak_rss_gib": 4.0}]
    >>> [(name, round(v, 2), target, ok) for name, v, target, ok in side_by_side(rs)]
    [('MoE step / dense step (ours)', 1.5, '<= 1.5x', 'PASS'), ('ours / TRL supervised tok/s', 2.0, '>= 1.5x', 'PASS'), ('ours / TRL peak RSS', 0.75, '<= 1.0x', 'PASS')]
    """
    m = {
        who: {k: h.mean([r for r in runs if r["who"] == who], k) for k in ("step_s", "sup_tok_s", "peak_rss_gib")}
        for who in TOOLKITS
    }
    out = []
    for name, a, b, limit, at_least in (
        ("MoE step / dense step (ours)", m["ours"]["step_s"], m["dense"]["step_s"], 1.5, False),
        ("ours / TRL supervised tok/s", m["ours"]["sup_tok_s"], m["trl"]["sup_tok_s"], 1.5, True),
        ("ours / TRL peak RSS", m["ours"]["peak_rss_gib"], m["trl"]["peak_rss_gib"], 1.0, False),
    ):
        v = h.ratio(a, b)
        if v is not None:
            out.append((name, v, f"{'>=' if at_least else '<='} {limit}x", h.verdict(v, limit, at_least)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--toolkits",
        default=",".join(TOOLKITS),
        help="comma-separated, of ours (the MoE through our "
        "CLI), dense (the equal-active dense model through our CLI), trl (the MoE under TRL + PEFT)",
    )
    p.add_argument("--scratch", default=os.path.join(ROOT, "build", "bench_moe"))
    p.add_argument("--trl-python", default=sys.executable, help="an interpreter with torch, transformers, peft, trl")
    p.add_argument("--json", help="write the runs here")
    a = p.parse_args(argv)
    a.scratch = os.path.abspath(a.scratch)  # the TRL worker runs in its output directory
    who_all = [w for w in a.toolkits.split(",") if w]
    bad = [w for w in who_all if w not in TOOLKITS]
    if bad:
        p.error(f"unknown toolkit(s) {bad}: choose from {TOOLKITS}")
    h.require_shared(what="bench/moe.py")
    py, why = trl_python(a.scratch, a.trl_python)
    if py is None:
        sys.exit(f"error: --trl-python {a.trl_python}: {why} (it also builds the models)")
    load0 = os.getloadavg()
    moe_dir, dense_dir, info = ensure_models(a.scratch, a.size, py)
    data_dir = ensure_data(a.scratch)
    moe, dense = info[os.path.basename(moe_dir)], info[os.path.basename(dense_dir)]
    print(
        f"MoE {moe_dir}: {moe['params'] / 1e9:.3f}B parameters, {moe['active'] / 1e9:.3f}B active; dense "
        f"{dense_dir}: {dense['params'] / 1e9:.3f}B; data {data_dir}; {a.steps} steps of 1 x 4 at max_length "
        f"1024, LoRA r8/16, fp32; load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    runs = []
    for i in range(a.repeats):
        for who in who_all:
            t0 = time.time()
            out_dir = os.path.join(a.scratch, f"{who}_{a.size}_{i}")
            if who == "trl":
                # use_fast=False: the shared venv's protobuf cannot convert the SentencePiece model;
                # same_work: no gradient checkpointing (TRL 0.22's SFTConfig default is on) and ours' example order
                r = run_trl(
                    py,
                    moe_dir,
                    data_dir,
                    out_dir,
                    a.steps,
                    packing=False,
                    targets=MOE_TARGETS,
                    use_fast=False,
                    same_work=True,
                )
            else:
                r = run_once("on", moe_dir if who == "ours" else dense_dir, data_dir, out_dir, a.steps)
                r.pop("summary", None)
            r.update(who=who, repeat=i, load=os.getloadavg()[0])
            runs.append(r)
            print(
                f"  {who} #{i + 1}: {r['sup_tok_s']:.1f} supervised tok/s, step {r['step_s']:.2f} s, RSS "
                f"{r['peak_rss_gib']:.2f} GiB, CPU {fmt(r['cpu_pct'], '.0f')}%, loss {r['final_loss']:.4f} "
                f"({time.time() - t0:.0f} s, load {r['load']:.2f})",
                flush=True,
            )
    load1 = os.getloadavg()
    labels = {
        "ours": "ours, MoE (llm/run_finetune.py)",
        "dense": "ours, dense equal-active (llm/run_finetune.py)",
        "trl": "TRL + PEFT, MoE (SFTTrainer)",
    }
    rows = []
    for who in who_all:
        rs = [r for r in runs if r["who"] == who]
        rows.append(
            [
                labels[who],
                len(rs),
                f"{h.mean(rs, 'sup_tok_s'):.1f} (" + ", ".join(format(r["sup_tok_s"], ".1f") for r in rs) + ")",
                f"{h.mean(rs, 'step_s'):.2f} s",
                f"{h.mean(rs, 'peak_rss_gib'):.2f} GiB",
                f"{fmt(h.mean(rs, 'cpu_pct'), '.0f')}%",
                f"{h.mean(rs, 'final_loss'):.4f}",
            ]
        )
    print()
    print(h.table(["run", "runs", "supervised tok/s", "step time", "peak RSS", "CPU% in steps", "final loss"], rows))
    trl_work = sorted({r["work"] for r in runs if r["who"] == "trl" and r.get("work")})
    if trl_work:
        print(f"TRL + PEFT work: {'; '.join(trl_work)} (ours: no gradient checkpointing, the same order)")
    print()
    ratios = side_by_side(runs)
    print(
        h.table(["ratio (one run, means)", "value", "target", ""], [[n, f"{v:.2f}x", t, ok] for n, v, t, ok in ratios])
    )
    print(f"\nload average: {load0[0]:.2f} at the start, {load1[0]:.2f} at the end ({os.cpu_count()} CPUs, shared)")
    h.write_json(
        a.json,
        {
            "size": a.size,
            "models": info,
            "runs": runs,
            "ratios": ratios,
            "load": [load0, load1],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
