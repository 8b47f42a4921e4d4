"""Config checks against the machine and the launch, without importing paddle.

Owns: what the installed Paddle build can run (read from ``paddle/version/__init__.py``
as text, so a config error still comes back in a fraction of a second),
the launched world size (``PADDLE_TRAINERS_NUM``, set by
``paddle.distributed.launch``), and the keys that belong to other scripts
(DPO).  ``environment_problems`` adds its findings to the all-at-once
config report (exit 2) before any model or data is loaded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from functools import lru_cache
from typing import Dict, List

from ..adapters.methods import method_by_key, supporting
from .problems import Problem, tagged
from .schema import DPOArgument

#: Keys of PaddleNLP's DPO scripts (llm/alignment/dpo: DPOConfig, DPODataArgument), read by llm/run_dpo.py.
DPO_KEYS = frozenset(f.name for f in dataclasses.fields(DPOArgument))
DPO_HINT = (
    "Preference training (PaddleNLP's llm/alignment/dpo/run_dpo.py) is llm/run_dpo.py: "
    "python llm/run_dpo.py CONFIG.json (keys in docs/dpo.md)."
)

#: Devices this toolkit runs on; Paddle's other device names get a clear refusal.
SUPPORTED_DEVICES = ("cpu", "gpu")
OTHER_PADDLE_DEVICES = ("npu", "xpu", "mlu", "gcu", "intel_hpu", "dcu", "sdaa")


@lru_cache(maxsize=1)
def paddle_build() -> Dict[str, object]:
    """``{"installed": bool, "cuda": bool, "xpu": bool, "version": str}`` of the installed Paddle.

    Read from ``paddle/version/__init__.py`` (``cuda_version = 'False'`` on a CPU build) without importing paddle.
    """
    spec = importlib.util.find_spec("paddle")
    if spec is None or not spec.submodule_search_locations:
        return {"installed": False, "cuda": False, "xpu": False, "version": ""}
    path = os.path.join(list(spec.submodule_search_locations)[0], "version", "__init__.py")
    try:
        text = open(path, encoding="utf-8").read()
    except OSError:  # unusual layout: do not guess, let the runtime checks decide
        return {"installed": True, "cuda": True, "xpu": True, "version": "unknown"}

    def value(name: str) -> str:
        m = re.search(rf"^{name}\s*=\s*'([^']*)'", text, re.M)
        return m.group(1) if m else "False"

    return {
        "installed": True,
        "cuda": value("cuda_version") not in ("False", ""),
        "xpu": value("xpu_xre_version") not in ("False", ""),
        "version": value("full_version"),
    }


def world_size() -> int:
    """Processes of this launch (``paddle.distributed.launch`` sets PADDLE_TRAINERS_NUM; 1 otherwise)."""
    try:
        return max(1, int(os.environ.get("PADDLE_TRAINERS_NUM", "1")))
    except ValueError:
        return 1


PARALLEL_KEYS = ("tensor_parallel_degree", "pipeline_parallel_degree", "sep_parallel_degree", "context_parallel_degree")


def environment_problems(cfg, where: str) -> List[str]:
    """Device, precision and parallel-degree problems of ``cfg`` (a RunConfig) on this machine and launch."""
    t, p = cfg.training, []
    build = paddle_build()
    device = t.get("device", "gpu")
    cpu_only = build["installed"] and not build["cuda"]
    if device in OTHER_PADDLE_DEVICES:
        p.append(
            f"{where}: device={device!r}: paddlenlp_ext runs on {' and '.join(SUPPORTED_DEVICES)} (CUDA) only; "
            f"set device to cpu or gpu (PaddleNLP's own scripts serve {device})"
        )
    elif device not in SUPPORTED_DEVICES:
        p.append(f"{where}: device={device!r} is not a Paddle device; use cpu or gpu")
    elif device == "gpu" and "device" in cfg.explicit and cpu_only:
        p.append(
            Problem(
                f"{where}: device=gpu but the installed Paddle {build['version']} is a CPU build; install "
                "paddlepaddle-gpu (make setup PADDLE_PACKAGE=paddlepaddle-gpu) or set device to cpu",
                "device",
            )
        )
    if cpu_only or device == "cpu":
        if t.get("fp16"):
            p.append(
                Problem(
                    f"{where}: fp16=true needs a GPU (Paddle's CPU build has no fp16 kernels); set fp16 "
                    "false (bf16 with fp16_opt_level O1, or fp32, run on CPU)",
                    "gpu_fp16",
                )
            )
        if t.get("bf16") and t.get("fp16_opt_level", "O1") == "O2":
            p.append(
                Problem(
                    f"{where}: bf16=true with fp16_opt_level=O2 needs a GPU (bf16 weights have no CPU "
                    "matmul/optimizer kernels); on CPU set fp16_opt_level O1 (bf16 autocast, fp32 weights) "
                    "or bf16 false",
                    "gpu_bf16_o2",
                )
            )
    n = world_size()
    degrees = {k: int(t.get(k, 1) or 1) for k in PARALLEL_KEYS}
    product = 1
    for v in degrees.values():
        product *= max(v, 1)
    if product > 1 and n % product != 0:
        used = " x ".join(f"{k}={v}" for k, v in degrees.items() if v > 1)
        p.append(
            Problem(
                f"{where}: {used} needs a multiple of {product} processes but this run has {n}; launch with "
                f"python -m paddle.distributed.launch --nproc_per_node {product} (GPUs: --gpus 0,...,{product - 1}) "
                "llm/run_finetune.py CONFIG.json, or set the degree to 1",
                "launch",
            )
        )
    return p


def tensor_parallel_adapter_problems(t, m, methods, where: str) -> List[str]:
    """LoRA (rsLoRA, LoRA+), VeRA and QLoRA bases run tensor parallel, LoRA and VeRA sequence parallel too
    (paddlenlp_ext/parallel); the rest is refused."""
    tp = t.get("tensor_parallel_degree", 1)
    if tp <= 1 or not methods:
        return []
    p = []
    for key in methods:  # the method table says which methods have a tensor-parallel layer (adapters.methods)
        row = method_by_key(key)
        if not row.supports.tensor_parallel:
            p.append(
                f"{where}: tensor_parallel_degree={tp} with {key} adapters is not supported "
                f"({row.refusals.get('tensor_parallel', 'no tensor-parallel layer')}); use "
                f"{' or '.join(supporting('tensor_parallel'))}, or tensor_parallel_degree=1"
            )
    if m.pissa:
        p.append(
            f"{where}: tensor_parallel_degree={tp} with pissa=true is not supported (PiSSA's initialisation "
            "is an SVD of each whole weight); set pissa=false or tensor_parallel_degree=1"
        )
    if t.get("sequence_parallel", False) and m.weight_quantize_algo:
        p.append(
            f"{where}: sequence_parallel=true with weight_quantize_algo is not supported (the quantized "
            "tensor-parallel base communicates as a plain Column/RowParallelLinear); set "
            "sequence_parallel=false"
        )
    for key in ("fuse_attention_qkv", "fuse_attention_ffn"):
        if getattr(m, key):
            p.append(
                f"{where}: {key}=true with tensor_parallel_degree={tp} and {methods[0]} adapters is not "
                f"supported (a rank's shard of the fused projection interleaves its parts); set {key}=false"
            )
    return p


def pipeline_parallel_problems(t, m, d, methods, where: str, dpo: bool = False) -> List[str]:
    """Pipeline parallel runs full fine-tuning and LoRA (rsLoRA, LoRA+) / LoKr adapters on PaddleNLP's
    *ForCausalLMPipe (paddlenlp_ext/adapters/pp_stage.py, verified by simulation); the rest is refused,
    naming the key."""
    pp, vpp = int(t.get("pipeline_parallel_degree", 1) or 1), int(t.get("virtual_pp_degree", 1) or 1)
    p: List[str] = []
    if pp <= 1:
        if vpp > 1:
            p.append(f"{where}: virtual_pp_degree={vpp} needs pipeline_parallel_degree > 2")
        return p
    head = f"{where}: pipeline_parallel_degree={pp}"
    if dpo:
        return [
            Problem(
                f"{head} is not supported for DPO yet (the chosen/rejected log-probs are computed on the last "
                "stage only); use sharding or data parallel",
                "pipeline",
            )
        ]
    refused: List[str] = []  # methods / combinations PaddleNLP's pipeline runs but this toolkit does not
    if m.prefix_tuning:
        refused.append(
            f"{head} with prefix_tuning is not supported (the prefix key/values would have to travel "
            "between stages); use lora=true or pipeline_parallel_degree=1"
        )
    elif methods and not method_by_key(methods[0]).supports.pipeline_parallel:  # adapters.methods
        row = method_by_key(methods[0])
        refused.append(
            f"{head} with {row.key}=true is not supported "
            f"({row.refusals.get('pipeline_parallel', 'not verified on pipeline stages')}); "
            f"use {supporting('pipeline_parallel')[0]}=true or pipeline_parallel_degree=1"
        )
    if m.pissa:
        refused.append(f"{head} with pissa=true is not supported yet; set pissa=false or pipeline_parallel_degree=1")
    if m.neftune:
        refused.append(
            f"{head} with neftune=true is not supported (the noise needs each batch's example lengths, "
            "which the pipeline schedule does not pass to the first stage); set neftune=false"
        )
    if m.weight_quantize_algo:
        refused.append(
            f"{head} with weight_quantize_algo is not supported yet (quantized bases are built by the "
            "streaming loader, which does not build pipeline stages); remove weight_quantize_algo or set "
            "pipeline_parallel_degree=1"
        )
    tp = int(t.get("tensor_parallel_degree", 1) or 1)
    if tp > 1:
        refused.append(
            f"{head} with tensor_parallel_degree={tp} is not supported yet (each is verified alone); use one of them"
        )
    if d.eval_with_do_generation:
        refused.append(
            f"{head} with eval_with_do_generation=true is not supported (a pipeline stage cannot "
            "generate on its own); set eval_with_do_generation=false and run llm/predict/predictor.py "
            "on the saved model"
        )
    p += tagged(refused, "pipeline")
    if vpp > 1:
        if pp <= 2:
            p.append(
                f"{where}: virtual_pp_degree={vpp} needs pipeline_parallel_degree > 2 (Paddle's interleaved "
                f"schedule); got {pp}"
            )
        acc = int(t.get("gradient_accumulation_steps", 1) or 1)
        if acc < 2 * pp:
            p.append(
                f"{where}: virtual_pp_degree={vpp} needs gradient_accumulation_steps >= 2 x "
                f"pipeline_parallel_degree = {2 * pp} (Paddle's interleaved schedule); got {acc}"
            )
    return p
