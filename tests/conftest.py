import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY_DIR = os.path.join(ROOT, "build", "tiny-llama")
DATA_DIR = os.path.join(ROOT, "llm", "data", "advertise")


def run_jobs(jobs, workers=2):
    """Run independent CLI jobs two at a time; return {name: failure text} for those that failed.

    ``jobs`` maps a name to a callable that runs its subprocesses and asserts on their output.  A tiny
    model's CLI run is mostly Python start-up and imports on one core, so two at a time on CI's two cores
    halves a slow loop's wall time; every job still runs and every failure is reported at once.
    Example: ``run_jobs({"a": lambda: None, "b": f})`` with ``f`` raising ``AssertionError("x")`` -> ``{"b": "x"}``;
    any other exception (a missing output file, a JSON error) is a failure of its job too, reported as the tail of
    its traceback (``{"b": "Traceback ... FileNotFoundError: ..."}``), not as one anonymous error of the pool.
    """
    import traceback
    from concurrent.futures import ThreadPoolExecutor

    def one(job):
        try:
            job()
        except AssertionError as e:
            return str(e)[-1500:]
        except Exception as e:
            return "".join(traceback.format_exception(type(e), e, e.__traceback__))[-1500:]
        return None

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = dict(zip(jobs, pool.map(one, jobs.values())))
    return {name: text for name, text in results.items() if text is not None}


def all_on_first_use(jobs):
    """A ``check(name)`` for a module's cached CLI runs: its first call runs every job of ``jobs`` (two at a time,
    run_jobs); each call then fails, with the job's output tail, only if ``name``'s own job failed.

    The runs a module's tests share go two at a time instead of one per test as the tests ask for them; a
    test selected alone (-k) waits for all of them.  Example: ``check = all_on_first_use({"a": f, "b": g})``;
    ``check("a")`` runs f and g, then passes if f raised nothing; ``check("b")`` runs nothing more.
    """
    failures = None

    def check(name):
        nonlocal failures
        if failures is None:
            failures = run_jobs(jobs)
        assert name not in failures, f"{name}: {failures[name]}"

    return check


def selected_params(request, test_name):
    """The parameters (one dict per selected case, in order) that this session runs ``test_name``, a parametrized
    test of the requesting module, with.

    A module fixture that runs every case's CLI jobs at once (run_jobs) uses it to run only the cases that -k or
    a node id selected, so a per-row parametrized test keeps its per-row selection and report.  Example: with
    ``pytest 'tests/test_x.py::test_a[mistral]'``, ``selected_params(request, "test_a")`` ->
    ``[{"model_type": "mistral"}]``.
    """
    return [
        item.callspec.params
        for item in request.session.items
        if getattr(item, "originalname", None) == test_name and item.module is request.module
    ]


@pytest.fixture(autouse=True)
def no_library_patch_left_behind():
    """Every test leaves PaddleNLP unpatched: patches are installed by context (integrations)."""
    yield
    flashmask = sys.modules.get("paddlenlp_ext.integrations.flashmask")
    if flashmask is not None:
        assert not flashmask.is_installed(), "a test left the fusion_ops FlashMask patch installed"


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The tiny demo model (built once; `make test` builds it before pytest runs)."""
    from paddlenlp_ext.models.tiny import ensure_tiny_model

    return ensure_tiny_model(TINY_DIR, DATA_DIR)


@pytest.fixture(scope="session")
def tiny_qwen2_dir():
    """A tiny Qwen2ForCausalLM with the tiny Llama's sizes and tokenizer (built once)."""
    from paddlenlp_ext.models.tiny import ensure_tiny_model

    return ensure_tiny_model(os.path.join(ROOT, "build", "tiny-qwen2"), DATA_DIR, family="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir():
    """A tiny Qwen3ForCausalLM (ours) with the tiny Llama's sizes and tokenizer, head_dim 32 != 64 / 4."""
    from paddlenlp_ext.models.tiny import ensure_tiny_model

    return ensure_tiny_model(os.path.join(ROOT, "build", "tiny-qwen3"), DATA_DIR, family="qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir():
    """A tiny Qwen3MoeForCausalLM (ours): the tiny Qwen3 with 4 experts (top 2) in layer 0, layer 1 dense."""
    from paddlenlp_ext.models.tiny import ensure_tiny_model

    return ensure_tiny_model(os.path.join(ROOT, "build", "tiny-qwen3-moe"), DATA_DIR, family="qwen3_moe")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from paddlenlp.transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
