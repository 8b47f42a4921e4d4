"""The architecture rules of docs/architecture.md, checked on the source.

- no module of paddlenlp_ext over 500 lines; none of paddlenlp_ext/, llm/ or bench/ over 500 lines once
  ``ruff format`` has re-flowed it either;
- private PaddleNLP/Paddle access only under paddlenlp_ext/integrations/;
- no broad ``except`` that swallows (it must re-raise);
- what may import what (config never imports paddle; data never touches models, adapters or training;
  adapters know nothing of training; kernels and quant know nothing of PaddleNLP);
- no import cycle between packages, counting every import statement wherever it stands (the layering).
"""

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import ROOT

PKG = os.path.join(ROOT, "paddlenlp_ext")
MAX_LINES = 500

# `paddle._C_ops`, `paddlenlp.trainer._x`, `from paddle import _C_ops`, `from paddle._x import y`,
# library source reading, private Trainer overrides, private nn.Layer state.
PRIVATE = [
    (re.compile(r"\b(?:paddle|paddlenlp)(?:\.\w+)*\._[A-Za-z]\w*"), "private attribute of a paddle/paddlenlp module"),
    (re.compile(r"^\s*from\s+(?:paddle|paddlenlp)[\w.]*\s+import\s+.*\b_[A-Za-z]", re.M), "private name imported"),
    (re.compile(r"^\s*from\s+(?:paddle|paddlenlp)[\w.]*\._\w+", re.M), "private module imported"),
    (re.compile(r"\binspect\.getsource\b|\bast\.parse\b"), "reading library source"),
    (
        re.compile(
            r"^\s*def\s+_(?:save|save_checkpoint|load_from_checkpoint|inner_training_loop|maybe_log_save_evaluate)\(",
            re.M,
        ),
        "override of a private Trainer method",
    ),
    (
        re.compile(r"\._(?:sub_layers|parameters|buffers|forward_pre_hooks|forward_post_hooks)\b"),
        "private nn.Layer state",
    ),
]

# package -> top-level names it must never import (anywhere in the file)
IMPORT_RULES = {
    "config": {"paddle", "paddlenlp", "paddlenlp_ext.training", "paddlenlp_ext.quant", "paddlenlp_ext.kernels"},
    "data": {
        "paddlenlp_ext.models",
        "paddlenlp_ext.adapters",
        "paddlenlp_ext.training",
        "paddlenlp_ext.quant",
        "paddlenlp_ext.merge",
    },
    "adapters": {"paddlenlp_ext.training", "paddlenlp_ext.data", "paddlenlp_ext.merge", "paddlenlp.trainer"},
    "kernels": {"paddlenlp", "paddlenlp_ext.training", "paddlenlp_ext.adapters", "paddlenlp_ext.data"},
    "quant": {
        "paddlenlp_ext.training",
        "paddlenlp_ext.adapters",
        "paddlenlp_ext.data",
        "paddlenlp.trainer",
        "paddlenlp_ext.models",
    },
    # the process set-up before paddle loads: the standard library only
    "runtime": {"paddle", "paddlenlp", "paddlenlp_ext"},
    "merge": {"paddlenlp_ext.training", "paddlenlp.trainer"},
    "export": {"paddlenlp_ext.training", "paddlenlp_ext.data", "paddlenlp_ext.dpo", "paddlenlp.trainer"},
    "predict": {"paddlenlp_ext.training", "paddlenlp_ext.dpo", "paddlenlp_ext.merge", "paddlenlp.trainer"},
    "planner": {"paddle", "paddlenlp_ext.training", "paddlenlp_ext.data", "paddlenlp_ext.adapters"},
    # parallel is the low layer of parallelism: what builds on models, quant or adapters lives there
    # (adapters.tp_layers, quant.parallel_linear, models.decoder.expert_parallel)
    "parallel": {
        "paddlenlp_ext.training",
        "paddlenlp_ext.data",
        "paddlenlp_ext.merge",
        "paddlenlp.trainer",
        "paddlenlp_ext.adapters",
        "paddlenlp_ext.quant",
        "paddlenlp_ext.models",
    },
    "serve": {
        "paddlenlp_ext.training",
        "paddlenlp_ext.dpo",
        "paddlenlp_ext.merge",
        "paddlenlp_ext.adapters",
        "paddlenlp.trainer",
    },
    # the rollout engine is model-agnostic decoding: trainers and the server may use it, it uses none of them
    "generation": {
        "paddlenlp_ext.training",
        "paddlenlp_ext.dpo",
        "paddlenlp_ext.merge",
        "paddlenlp_ext.serve",
        "paddlenlp_ext.predict",
        "paddlenlp_ext.grpo",
        "paddlenlp_ext.ppo",
        "paddlenlp.trainer",
    },
    "kto": {"paddlenlp_ext.merge", "paddlenlp_ext.predict", "paddlenlp_ext.serve", "paddlenlp_ext.export"},
    "grpo": {"paddlenlp_ext.merge", "paddlenlp_ext.predict", "paddlenlp_ext.serve", "paddlenlp_ext.export"},
    "reward": {"paddlenlp_ext.merge", "paddlenlp_ext.predict", "paddlenlp_ext.serve", "paddlenlp_ext.export"},
}


# package -> modules it may import although IMPORT_RULES forbids their package (pure code shared on purpose)
IMPORT_ALLOWED = {
    "grpo": {"paddlenlp_ext.serve.tools"},  # multi-turn rollouts parse tool calls with the server's parser
    "planner": {"paddlenlp_ext.adapters.methods"},  # the paddle-free method table sizes each method's adapters
}


def modules():
    for dirpath, _, files in os.walk(PKG):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, PKG), path


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def imported_names(tree, modname):
    """Absolute dotted names a module imports (relative imports resolved against modname)."""
    pkg_parts = modname.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            yield name
            for a in node.names:
                yield f"{name}.{a.name}"


# (module, enclosing function) -> why a broad handler that does not re-raise is right there.
BROAD_EXCEPT_ALLOWED = {
    (
        "merge/verify.py",
        "run_verification",
    ): "the merge is complete; any failure of the verification run is recorded in merge_info.json and "
    "MERGE_VERIFY_FAILED and the run exits 3 (the output is marked, not deleted)",
    (
        "merge/writer.py",
        "_drain",
    ): "writer thread: the exception is stored and re-raised in the caller by the next write()/close()",
    (
        "grpo/tool_worker.py",
        "run_call",
    ): "the tool process: a tool's exception is its call's result (an error message the model reads), as TRL does",
    (
        "serve/engine.py",
        "_main",
    ): "generation thread: a failure to load the models is stored and reported (or re-raised) by the main thread",
    (
        "serve/engine.py",
        "_run",
    ): "generation thread: a failed batch answers each of its requests with a 500 error and the server goes on",
}


def enclosing_functions(tree):
    """ExceptHandler node id -> name of the innermost function around it."""
    out = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ExceptHandler):
                    out[id(node)] = fn.name  # inner functions are visited later and overwrite
    return out


def swallowing_handlers(tree, rel=None):
    """Broad handlers (bare, Exception, BaseException) with no raise in their body (lines)."""
    where = enclosing_functions(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.ExceptHandler):
            continue
        if (rel, where.get(id(node))) in BROAD_EXCEPT_ALLOWED:
            continue
        names = []
        for t in ([node.type] if not isinstance(node.type, ast.Tuple) else node.type.elts) if node.type else []:
            names.append(getattr(t, "id", getattr(t, "attr", "")))
        broad = node.type is None or {"Exception", "BaseException"} & set(names)
        if broad and not any(isinstance(n, ast.Raise) for b in node.body for n in ast.walk(b)):
            yield node.lineno


@pytest.mark.parametrize("rel,path", list(modules()), ids=lambda x: x if isinstance(x, str) else "")
def test_module_rules(rel, path):
    text = read(path)
    n = text.count("\n")
    assert n <= MAX_LINES, f"{rel} has {n} lines (limit {MAX_LINES}): split it by job"
    if not rel.startswith("integrations" + os.sep):
        for pattern, what in PRIVATE:
            m = pattern.search(text)
            assert m is None, (
                f"{rel}:{text[: m.start()].count(chr(10)) + 1}: {what} ({m.group(0).strip()!r}); "
                "move it to paddlenlp_ext/integrations/"
            )
    tree = ast.parse(text, filename=path)
    lines = list(swallowing_handlers(tree, rel.replace(os.sep, "/")))
    assert not lines, f"{rel}: broad except that does not re-raise at lines {lines}; catch the expected exception"
    package = rel.split(os.sep)[0]
    forbidden = IMPORT_RULES.get(package, set())
    modname = "paddlenlp_ext." + rel[:-3].replace(os.sep, ".")
    allowed = IMPORT_ALLOWED.get(package, set())
    bad = sorted(
        {
            n
            for n in imported_names(tree, modname)
            for f in forbidden
            if (n == f or n.startswith(f + ".")) and not any(n == a or n.startswith(a + ".") for a in allowed)
        }
    )
    assert not bad, f"{rel} imports {bad}, which docs/architecture.md forbids for {package}/"


def test_the_rules_catch_what_they_are_for(tmp_path):
    """The scanners themselves: each finds its violation in a sample."""
    sample = "from paddle import _C_ops\nx = paddle.base._private\ndef _save(self):\n    pass\n"
    assert all(p.search(sample) for p, what in PRIVATE[:2]) and PRIVATE[4][0].search(sample)
    tree = ast.parse("try:\n    f()\nexcept Exception:\n    pass\ntry:\n    g()\nexcept Exception:\n    raise\n")
    assert list(swallowing_handlers(tree)) == [3]
    tree = ast.parse("from ..training import run\nimport paddle.nn\n")
    assert {"paddlenlp_ext.training.run", "paddle.nn"} <= set(imported_names(tree, "paddlenlp_ext.data.x"))


def module_import_graph():
    """{module: the paddlenlp_ext modules it imports anywhere in its file} (a package's name is its __init__)."""

    def name(rel):
        m = "paddlenlp_ext." + rel[:-3].replace(os.sep, ".")
        return m[: -len(".__init__")] if m.endswith(".__init__") else m

    found = {rel: name(rel) for rel, _ in modules()}
    known = set(found.values())

    def resolve(n):  # "paddlenlp_ext.adapters.api.save_adapter" -> "paddlenlp_ext.adapters.api"
        while n and n not in known:
            n = n.rpartition(".")[0]
        return n

    graph = {}
    for rel, path in modules():
        names = imported_names(ast.parse(read(path)), "paddlenlp_ext." + rel[:-3].replace(os.sep, "."))
        graph[found[rel]] = {resolve(n) for n in names} - {found[rel], "", "paddlenlp_ext"}
    return graph


def package_of(module):
    """``paddlenlp_ext.adapters.api`` -> ``adapters``; a top-level module is its own node (``paddlenlp_ext.lazy``
    -> ``lazy``), and so is the package's own ``__init__`` (``paddlenlp_ext``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph):
    """{package: {package it imports: [(module, module it imports), ...]}} from :func:`module_import_graph`'s
    shape; imports inside a package are left out."""
    out = {}
    for a in sorted(graph):
        for b in sorted(graph[a]):
            pa, pb = package_of(a), package_of(b)
            if pa != pb:
                out.setdefault(pa, {}).setdefault(pb, []).append((a, b))
    return out


def package_cycles(graph):
    """The strongly connected components of the package graph with more than one package, each as
    (sorted packages, the module edges between them): every import of one by another, wherever it stands.

    Tarjan's algorithm: ``{"x.a.m": {"x.b.m"}, "x.b.m": {"x.c.m"}, "x.c.m": {"x.a.m"}}`` -> one component,
    ``["a", "b", "c"]`` with its three edges; an acyclic graph -> ``[]``.
    """
    packages = package_graph(graph)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in packages.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                members = set(component)
                edges = [e for p in sorted(members) for q, es in sorted(packages.get(p, {}).items()) if q in members
                         for e in es]  # fmt: skip
                found.append((sorted(component), edges))

    for v in sorted(packages):
        if v not in index:
            visit(v)
    return sorted(found)


def describe_cycles(cycles):
    lines = []
    for members, edges in cycles:
        lines.append(f"packages {members} import each other, through {len(edges)} module imports:")
        lines += [f"  {a} -> {b}" for a, b in edges]
    return "\n".join(lines)


def test_no_import_cycle_between_packages():
    """The packages form layers (docs/architecture.md draws them bottom to top): counting every import, at the
    top of a module or inside a function, no package reaches one that reaches back.  A cycle is reported with
    its packages and the module imports that close it; move the code to the layer that owns it, or pass what a
    lower layer needs in from the caller (no importlib or string imports: those would hide the edge)."""
    cycles = package_cycles(module_import_graph())
    assert cycles == [], describe_cycles(cycles)


def test_the_cycle_check_finds_cycles():
    """Negative controls: a 3-package cycle (the edges found inside functions count the same) and a 2-package
    one through two modules are found, with their edges; imports inside one package and a chain are not."""
    sample = {
        "paddlenlp_ext.config.parse": {"paddlenlp_ext.models.family_table", "paddlenlp_ext.config.schema"},
        "paddlenlp_ext.config.schema": {"paddlenlp_ext.config.parse"},  # inside one package: no cycle
        "paddlenlp_ext.models.family_table": {"paddlenlp_ext.quant.formats"},
        "paddlenlp_ext.quant.formats": {"paddlenlp_ext.config.parse"},
        "paddlenlp_ext.serve.app": {"paddlenlp_ext.config.parse", "paddlenlp_ext.lazy"},  # only downward
        "paddlenlp_ext.lazy": set(),
    }
    cycles = package_cycles(sample)
    assert cycles == [
        (
            ["config", "models", "quant"],
            [
                ("paddlenlp_ext.config.parse", "paddlenlp_ext.models.family_table"),
                ("paddlenlp_ext.models.family_table", "paddlenlp_ext.quant.formats"),
                ("paddlenlp_ext.quant.formats", "paddlenlp_ext.config.parse"),
            ],
        )
    ]
    assert "paddlenlp_ext.quant.formats -> paddlenlp_ext.config.parse" in describe_cycles(cycles)
    two = {
        "paddlenlp_ext.adapters.api": {"paddlenlp_ext.parallel.checkpoint"},
        "paddlenlp_ext.parallel.checkpoint": {"paddlenlp_ext.adapters.base"},
        "paddlenlp_ext.adapters.base": set(),
    }
    assert [m for m, _ in package_cycles(two)] == [["adapters", "parallel"]]
    del sample["paddlenlp_ext.quant.formats"]
    assert package_cycles(sample) == []
    # the graph is built from imports anywhere in a file: one inside a function counts
    tree = ast.parse("def f():\n    from ..models import family_table\n")
    assert "paddlenlp_ext.models.family_table" in set(imported_names(tree, "paddlenlp_ext.config.x"))


#: the trees ``ruff format`` will re-flow (pyproject.toml); none of their modules may then pass MAX_LINES
FORMATTED_DIRS = ("paddlenlp_ext", "llm", "bench")
#: pyproject.toml's extend-exclude, and caches
NOT_FORMATTED = {"build", "output", "__pycache__"}


def ruff_command():
    """The command that runs ruff here (the venv's, one on PATH, or the importable module), or None."""
    beside = os.path.join(os.path.dirname(sys.executable), "ruff")
    if os.path.isfile(beside):
        return [beside]
    if shutil.which("ruff"):
        return [shutil.which("ruff")]
    return [sys.executable, "-m", "ruff"] if importlib.util.find_spec("ruff") else None


def formatted_line_counts(root, dirs, ruff):
    """{path under ``root``: its line count after ``ruff format`` with root's pyproject.toml} for the .py files
    of ``dirs``; the formatting happens in a copy, the files themselves are left as they are."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(root, "pyproject.toml"), tmp)
        copied = []
        for d in dirs:
            for dirpath, subdirs, files in os.walk(os.path.join(root, d)):
                subdirs[:] = sorted(s for s in subdirs if s not in NOT_FORMATTED)
                for f in files:
                    if f.endswith(".py"):
                        rel = os.path.relpath(os.path.join(dirpath, f), root)
                        os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
                        shutil.copy(os.path.join(root, rel), os.path.join(tmp, rel))
                        copied.append(rel)
        done = subprocess.run([*ruff, "format", "--quiet", *dirs], cwd=tmp, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"ruff format failed: {done.stderr[-2000:]}"
        return {rel: read(os.path.join(tmp, rel)).count("\n") for rel in copied}


def test_modules_stay_within_the_limit_once_formatted(tmp_path):
    """ruff format splits long lines: a module must stay within MAX_LINES after it too, or formatting the tree
    would break the rule above. The formatter runs on a copy with the project's pyproject.toml."""
    ruff = ruff_command()
    if ruff is None:
        pytest.skip("ruff is not installed")
    counts = formatted_line_counts(ROOT, FORMATTED_DIRS, ruff)
    assert len(counts) > 100 and os.path.join("paddlenlp_ext", "models", "family_table.py") in counts
    over = {rel: n for rel, n in sorted(counts.items()) if n > MAX_LINES}
    assert not over, (
        f"once `ruff format`ted these modules have more than {MAX_LINES} lines: {over}; split them "
        "by job (the formatter puts each argument of a long call on a line of its own)"
    )
    # the measure formats with the project's line length (120): a 137-character call becomes 10 lines
    os.makedirs(tmp_path / "paddlenlp_ext")
    (tmp_path / "pyproject.toml").write_text(read(os.path.join(ROOT, "pyproject.toml")))
    (tmp_path / "paddlenlp_ext" / "m.py").write_text("f(" + ", ".join(["argument_number"] * 8) + ")\n" + "g(1)\n")
    assert formatted_line_counts(str(tmp_path), ["paddlenlp_ext"], ruff) == {os.path.join("paddlenlp_ext", "m.py"): 11}
