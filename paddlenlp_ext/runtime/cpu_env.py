"""CPU math set-up before Paddle loads: MKL/OpenMP threads and MKL's code path (docs/cpu.md).

Every ``llm/`` entry script calls :func:`setup_cpu` first thing, before anything imports
paddle, because the MKL and OpenMP runtimes inside Paddle's CPU build read their environment
once, when they start:

* ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``: Paddle sets ``OMP_NUM_THREADS=1`` when it is unset,
  so its MKL matmuls and oneDNN / OpenMP kernels use one core whatever the machine has
  (``FLAGS_paddle_num_threads`` is not read by a oneDNN build's training path).  We set both to
  the CPUs this process may use: its affinity, capped by the cgroup CPU quota (v2 ``cpu.max``,
  v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), divided among the local ranks of a
  ``paddle.distributed.launch`` (``PADDLE_LOCAL_SIZE``), at least 1.
* ``MKL_DEBUG_CPU_TYPE=5``: the MKL Paddle bundles (``paddle/libs/libmklml_intel.so``, MKL
  2019.0.5; MKL-ML was never released after it) picks its generic SSE code on CPUs whose vendor
  is not Intel; this variable, which MKL honours up to 2020.0, makes it take its AVX2 path.  Set
  only on a non-Intel x86 CPU with AVX2 and FMA, and only when that MKL is the one Paddle loads.

A variable the user set is never overwritten: a thread variable set by the user leaves both
thread variables to the user, a code-path variable (``MKL_DEBUG_CPU_TYPE`` or
``MKL_ENABLE_INSTRUCTIONS``) leaves the code path to the user.  ``PADDLENLP_EXT_CPU_SETUP=0``
turns the whole set-up off.  Nothing here imports paddle or touches a GPU setting.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, MutableMapping, Optional, Tuple

#: the switch: "0" (or false/no/off) turns the set-up off
SWITCH = "PADDLENLP_EXT_CPU_SETUP"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
CODE_PATH_VARS = ("MKL_DEBUG_CPU_TYPE", "MKL_ENABLE_INSTRUCTIONS")
#: MKL_DEBUG_CPU_TYPE's value for the AVX2 code path
MKL_AVX2_PATH = "5"
#: the MKL library of Paddle's CPU wheels (MKL-ML, whose last release, 2019.0.5, honours the variable)
MKLML_LIBRARY = "libmklml_intel.so"
SHORT_VENDOR = {
    "AuthenticAMD": "AMD",
    "HygonGenuine": "Hygon",
    "CentaurHauls": "Centaur",
    "Shanghai": "Zhaoxin",
    "GenuineIntel": "Intel",
}

logger = logging.getLogger("paddlenlp_ext.cli.cpu_env")  # its name before the move to runtime/: logging set-ups name it


@dataclass(frozen=True)
class CpuFacts:
    """What the set-up decides from (read by :func:`gather_facts`, faked in tests)."""

    affinity: int  # CPUs this process may run on (os.sched_getaffinity)
    quota: Optional[float] = None  # cgroup CPU quota in CPUs; None: no quota
    local_ranks: int = 1  # processes of a launch on this machine
    vendor: str = ""  # /proc/cpuinfo vendor_id ("" when unknown, e.g. not x86)
    flags: FrozenSet[str] = frozenset()  # /proc/cpuinfo flags
    mkl_library: Optional[str] = None  # Paddle's bundled MKL-ML library, None when absent


@dataclass(frozen=True)
class CpuDecision:
    """The variables to set (``set_env``), the user's that were kept (``user_env``) and the one-line text."""

    enabled: bool
    threads: Optional[int] = None  # None: left to the user (or the set-up is off)
    set_env: Dict[str, str] = field(default_factory=dict)
    user_env: Dict[str, str] = field(default_factory=dict)
    text: str = ""

    def as_dict(self) -> dict:
        return {
            "enabled": self.enabled,
            "threads": self.threads,
            "set": dict(self.set_env),
            "user": dict(self.user_env),
            "text": self.text,
        }


# -- reading the machine (pure parsers first) -----------------------------------------------
def parse_cpuinfo(text: str) -> Tuple[str, FrozenSet[str]]:
    """The first processor's vendor and flags.

    ``"vendor_id\\t: AuthenticAMD\\nflags\\t\\t: fpu avx2 fma\\n"`` -> ``("AuthenticAMD", {"fpu", "avx2", "fma"})``.
    """
    vendor, flags = "", frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep:
            continue
        if key == "vendor_id" and not vendor:
            vendor = value.strip()  # Zhaoxin's id is "  Shanghai  "
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if vendor and flags:
            break
    return vendor, flags


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:  # absent or unreadable: that limit does not apply
        return None


def _ancestors(root: str, rel: str):
    """``root/a/b``, ``root/a``, ``root``: the cgroup of the process and its parents that exist here."""
    parts = [p for p in rel.strip("/").split("/") if p]
    for n in range(len(parts), -1, -1):
        d = os.path.join(root, *parts[:n])
        if os.path.isdir(d):
            yield d


def cgroup_cpu_quota(proc_cgroup: str, root: str = "/sys/fs/cgroup") -> Optional[float]:
    """The tightest CPU quota, in CPUs, over the process's cgroup and its parents; None without one.

    cgroup v2 ``cpu.max`` ``"150000 100000"`` -> 1.5 (``"max 100000"``: no quota); cgroup v1
    ``cpu.cfs_quota_us`` 200000 over ``cpu.cfs_period_us`` 100000 -> 2.0 (-1: no quota).
    ``proc_cgroup`` is /proc/self/cgroup's text (``"0::/user.slice"``, ``"4:cpu,cpuacct:/docker/x"``).
    """
    quotas = []
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2 unified hierarchy
            for d in _ancestors(root, rel):
                fields = (_read(os.path.join(d, "cpu.max")) or "").split()
                if len(fields) == 2 and fields[0] != "max":
                    quotas.append(_ratio(fields[0], fields[1]))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's mount
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu", controllers):
                for d in _ancestors(os.path.join(root, mount), rel):
                    quota = (_read(os.path.join(d, "cpu.cfs_quota_us")) or "").strip()
                    period = (_read(os.path.join(d, "cpu.cfs_period_us")) or "").strip()
                    if quota and period and not quota.startswith("-"):
                        quotas.append(_ratio(quota, period))
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def _ratio(quota: str, period: str) -> Optional[float]:
    try:
        q, p = int(quota), int(period)
    except ValueError:  # a file we do not understand: no limit from it
        return None
    return q / p if q > 0 and p > 0 else None


def local_ranks(env) -> int:
    """Processes of a launch on this machine: ``PADDLE_LOCAL_SIZE`` (``paddle.distributed.launch``),
    else ``PADDLE_TRAINERS_NUM`` / ``PADDLE_NNODES`` (the older launcher), else 1.

    ``{"PADDLE_LOCAL_SIZE": "2"}`` -> 2; ``{"PADDLE_TRAINERS_NUM": "8", "PADDLE_NNODES": "2"}`` -> 4; ``{}`` -> 1.
    """

    def number(name):
        try:
            return max(int(env.get(name, "")), 1)
        except ValueError:
            return None

    local = number("PADDLE_LOCAL_SIZE")
    if local is not None:
        return local
    trainers = number("PADDLE_TRAINERS_NUM")
    if trainers is None:
        return 1
    return max(math.ceil(trainers / (number("PADDLE_NNODES") or 1)), 1)


def paddle_mkl_library() -> Optional[str]:
    """Path of the MKL-ML library in the installed paddle's ``libs/`` (found without importing paddle)."""
    spec = importlib.util.find_spec("paddle")
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(base, "libs", MKLML_LIBRARY)
        if os.path.exists(path):
            return path
    return None


def gather_facts(env) -> CpuFacts:
    """The facts of this process and machine (Linux files; elsewhere, what Python can tell)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    vendor, flags = parse_cpuinfo(_read("/proc/cpuinfo") or "")
    return CpuFacts(
        affinity=affinity,
        quota=cgroup_cpu_quota(_read("/proc/self/cgroup") or ""),
        local_ranks=local_ranks(env),
        vendor=vendor,
        flags=flags,
        mkl_library=paddle_mkl_library(),
    )


# -- deciding ---------------------------------------------------------------------------------
def switched_off(env) -> bool:
    return str(env.get(SWITCH, "1")).strip().lower() in ("0", "false", "no", "off")


def thread_count(facts: CpuFacts) -> Tuple[int, str]:
    """Threads per process and why: ``CpuFacts(affinity=8, quota=2.0)`` -> ``(2, "cgroup quota 2")``;
    with ``local_ranks=2`` and 2 CPUs -> ``(1, "2 CPUs / 2 local ranks")``.  A fractional quota
    rounds up (1.5 CPUs -> 2 threads: two threads can use the 1.5, one cannot)."""
    cpus, why = facts.affinity, f"{facts.affinity} CPUs"
    if facts.quota is not None and math.ceil(facts.quota - 1e-9) < cpus:
        cpus, why = max(math.ceil(facts.quota - 1e-9), 1), f"cgroup quota {facts.quota:g}"
    elif facts.quota is not None:
        why += f", cgroup quota {facts.quota:g}"
    if facts.local_ranks > 1:
        return max(cpus // facts.local_ranks, 1), f"{why} / {facts.local_ranks} local ranks"
    return max(cpus, 1), why


def mkl_code_path(facts: CpuFacts) -> Tuple[Optional[str], str]:
    """``(MKL_DEBUG_CPU_TYPE value or None, why)``: ``"5"`` on a non-Intel x86 CPU with AVX2 and FMA
    when Paddle's MKL-ML is present; ``CpuFacts(1, vendor="AuthenticAMD", flags={"avx2", "fma"},
    mkl_library="...")`` -> ``("5", "AMD CPU")``; an Intel CPU -> ``(None, "Intel CPU")``."""
    vendor = SHORT_VENDOR.get(facts.vendor, facts.vendor.strip() or "unknown")
    if facts.mkl_library is None:
        return None, "no MKL-ML in paddle/libs"
    if not facts.vendor or facts.vendor == "GenuineIntel":
        return None, f"{vendor} CPU"
    if not {"avx2", "fma"} <= facts.flags:
        return None, f"{vendor} without AVX2/FMA"
    return MKL_AVX2_PATH, f"{vendor} CPU" + (" with AVX-512" if "avx512f" in facts.flags else "")


def decide(facts: CpuFacts, env) -> CpuDecision:
    """What to set, given the machine's facts and the environment (the user's settings win)."""
    set_env: Dict[str, str] = {}
    user = {k: env[k] for k in THREAD_VARS + CODE_PATH_VARS if k in env}
    parts = []
    user_threads = [k for k in THREAD_VARS if k in env]
    threads = None
    if user_threads:
        parts.append("threads as set: " + ", ".join(f"{k}={env[k]}" for k in user_threads))
    else:
        threads, why = thread_count(facts)
        set_env.update({k: str(threads) for k in THREAD_VARS})
        parts.append(f"{threads} thread{'s' if threads != 1 else ''} ({why})")
    user_path = [k for k in CODE_PATH_VARS if k in env]
    if user_path:
        parts.append(", ".join(f"{k}={env[k]}" for k in user_path) + " as set")
    else:
        value, why = mkl_code_path(facts)
        if value is not None:
            set_env["MKL_DEBUG_CPU_TYPE"] = value
            # the variable's name is in docs/cpu.md: the line avoids "DEBUG", which reads as log chatter
            parts.append(f"MKL AVX2 code path ({why})")
        else:
            parts.append(f"MKL's own code path ({why})")
    return CpuDecision(enabled=True, threads=threads, set_env=set_env, user_env=user, text="cpu: " + ", ".join(parts))


# -- applying -------------------------------------------------------------------------------
_current: Optional[CpuDecision] = None


def setup_cpu(env: Optional[MutableMapping[str, str]] = None, facts: Optional[CpuFacts] = None) -> CpuDecision:
    """Decide and set the CPU math variables in ``env`` (``os.environ``), unless switched off.

    Call it before paddle is imported (the entry scripts' first statement after their path set-up);
    called later, the variables are still set and the decision says Paddle was already loaded.
    """
    global _current
    env = os.environ if env is None else env
    if switched_off(env):
        user = {k: env[k] for k in THREAD_VARS + CODE_PATH_VARS if k in env}
        decision = CpuDecision(enabled=False, user_env=user, text=f"cpu: set-up off ({SWITCH}={env[SWITCH]})")
    else:
        decision = decide(facts or gather_facts(env), env)
        for key, value in decision.set_env.items():
            env.setdefault(key, value)
        if env is os.environ and "paddle" in sys.modules:
            decision = CpuDecision(
                decision.enabled,
                decision.threads,
                decision.set_env,
                decision.user_env,
                decision.text + " (paddle was already loaded: may not apply)",
            )
    if env is os.environ:
        _current = decision
    logger.info(decision.text)
    return decision


def current() -> Optional[CpuDecision]:
    """The decision :func:`setup_cpu` made in this process (None when no entry script ran it)."""
    return _current
