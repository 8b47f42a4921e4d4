"""Lazy package exports (PEP 562): a name loads its module on first access, so importing a package
imports nothing heavy (paddle).  Used by the ``__init__`` of ``adapters``, ``parallel`` and ``quant``.

    __getattr__, __dir__ = lazy_exports(__name__, {"LoRALinear": "lora"})
    # paddlenlp_ext.adapters.LoRALinear -> imports paddlenlp_ext.adapters.lora, caches the name
"""

import importlib
import sys
from typing import Callable, List, Mapping, Tuple


def lazy_exports(package: str, table: Mapping[str, str]) -> Tuple[Callable, Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps an exported name to its submodule."""

    def __getattr__(name: str):
        mod = table.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{mod}"), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
