"""The boundary to PaddleNLP/Paddle internals still matches the installed libraries.

Every module of paddlenlp_ext.integrations lists what it relies on in
RELIED_ON; a paddlenlp/paddle upgrade that renames or re-signs one of them
fails here, in `make test`, instead of in a user's run.
"""

import importlib
import inspect
import warnings

import pytest

from paddlenlp_ext.integrations import versions

MODULES = [
    "flashmask",
    "lazy_init",
    "trainer",
    "training_args",
    "mp_ops",
    "logging",
    "sharding",
    "paddlenlp_pipe",
    "qwen3",
    "decoder",
    "rotary",
    "dense_attention",
    "rms_norm",
    "recompute",
]


def resolve(path):
    """'paddlenlp.trainer.Trainer' -> the object (module attribute chain)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def relied_on():
    for name in MODULES:
        mod = importlib.import_module(f"paddlenlp_ext.integrations.{name}")
        for entry in mod.RELIED_ON:
            yield pytest.param(name, entry, id=f"{name}:{entry[0]}.{entry[1]}")


@pytest.mark.parametrize("module,entry", list(relied_on()))
def test_relied_on_symbol_exists_with_signature(module, entry):
    owner_path, attr = entry[0], entry[1]
    owner = resolve(owner_path)
    assert hasattr(owner, attr), f"{owner_path}.{attr} is gone (used by integrations.{module})"
    if len(entry) > 2 and entry[2] is not None:
        params = tuple(inspect.signature(getattr(owner, attr)).parameters)
        assert params == entry[2], f"{owner_path}.{attr}{params} changed (integrations.{module} expects {entry[2]})"


def test_relied_on_instance_attributes_are_still_assigned():
    """Private Trainer instance attributes (RELIED_ON_ATTRIBUTES) cannot be checked on the class: the
    method that assigns each one must still assign it."""
    checked = 0
    for name in MODULES:
        mod = importlib.import_module(f"paddlenlp_ext.integrations.{name}")
        for method_path, attr in getattr(mod, "RELIED_ON_ATTRIBUTES", []):
            source = inspect.getsource(resolve(method_path))
            assert f"self.{attr} = " in source, f"{method_path} no longer assigns self.{attr} (integrations.{name})"
            checked += 1
    assert checked >= 2


def test_overridden_private_methods_are_all_listed():
    """TrainerBoundary overrides no private Trainer method that RELIED_ON does not name."""
    from paddlenlp.trainer import Trainer

    from paddlenlp_ext.integrations import trainer

    listed = {e[1] for e in trainer.RELIED_ON if e[0] == "paddlenlp.trainer.Trainer"}
    overridden = {
        n for n in vars(trainer.TrainerBoundary) if n.startswith("_") and not n.startswith("__") and hasattr(Trainer, n)
    }
    assert overridden <= listed, overridden - listed


def test_training_args_source_matches_the_dataclass():
    import dataclasses

    from paddlenlp.trainer import TrainingArguments

    from paddlenlp_ext.integrations.training_args_source import read_training_fields

    parsed = {f.name: f for f in read_training_fields()}
    real = {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}
    assert set(real) <= set(parsed), set(real) - set(parsed)
    for name in ("learning_rate", "max_steps", "fp16", "evaluation_strategy"):
        assert parsed[name].default == real[name].default, name


def test_installed_versions_are_the_tested_ones():
    assert versions.version_problems() == {}


def test_untested_version_is_a_clear_error_or_a_warning(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda name: {"paddle": "3.4.0", "paddlenlp": "3.0.0b4"}[name])
    versions.check_versions.cache_clear()
    try:
        with pytest.raises(versions.UnsupportedVersionError, match=r"paddle 3\.4\.0 is installed.*>=3\.0\.0,<3\.4\.0"):
            versions.check_versions()
        monkeypatch.setenv(versions.SKIP_ENV, "1")
        versions.check_versions.cache_clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            versions.check_versions()
        assert any("paddle 3.4.0" in str(w.message) for w in caught)
    finally:
        versions.check_versions.cache_clear()


@pytest.mark.parametrize(
    "a,b",
    [
        ("3.0.0b4", "3.0.0b5"),
        ("3.0.0b5", "3.0.0"),
        ("3.0.0", "3.3.1"),
        ("3.3.1", "3.4.0"),
        ("3.0.0rc1", "3.0.0"),
        ("2.6.2", "3.0.0b4"),
    ],
)
def test_version_order(a, b):
    assert versions._key(a) < versions._key(b)
