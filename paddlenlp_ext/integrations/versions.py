"""The paddle / paddlenlp versions the integrations were written and tested against.

Read from package metadata (``importlib.metadata``), so checking never
imports paddle.  The modules of this package that touch private names call
:func:`check_versions` when they are imported: an untested release fails
with a message saying what is installed, what is tested and how to proceed,
instead of silently misbehaving where a private symbol changed meaning.
"""

from __future__ import annotations

import os
from functools import lru_cache
from importlib import metadata
from typing import Dict, Optional, Tuple

#: distribution -> (lowest tested version inclusive, first untested version exclusive)
TESTED: Dict[str, Tuple[str, str]] = {
    "paddle": ("3.0.0", "3.4.0"),
    "paddlenlp": ("3.0.0b4", "3.0.0b5"),
}
# Paddle's CPU and GPU wheels have different distribution names.
_DISTRIBUTIONS = {
    "paddle": ("paddlepaddle", "paddlepaddle-gpu"),
    "paddlenlp": ("paddlenlp",),
}
#: Set to 1 to run an untested paddle/paddlenlp anyway (a warning instead of an error).
SKIP_ENV = "PADDLENLP_EXT_SKIP_VERSION_CHECK"


class UnsupportedVersionError(RuntimeError):
    """An installed paddle/paddlenlp outside the range the integrations were tested with."""


def _key(version: str) -> Tuple:
    """Order PEP 440-ish versions: ``3.0.0b4`` < ``3.0.0b5`` < ``3.0.0`` < ``3.3.0``.

    >>> _key("3.0.0b4") < _key("3.0.0") < _key("3.3.1") < _key("3.4.0")
    True
    """
    main, pre = version, None
    for tag in ("rc", "b", "a"):
        head, sep, tail = version.partition(tag)
        if sep and head and head[-1].isdigit():
            main, pre = head, (tag, int("".join(c for c in tail if c.isdigit()) or 0))
            break
    nums = tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in main.split(".")[:3])
    nums = nums + (0,) * (3 - len(nums))
    # a release sorts after its pre-releases
    return nums + ((0, pre[0], pre[1]) if pre else (1, "", 0))


def installed_version(name: str) -> Optional[str]:
    for dist in _DISTRIBUTIONS[name]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_problems() -> Dict[str, str]:
    """``{name: message}`` for every package outside its tested range (empty when all fit)."""
    problems = {}
    for name, (low, high) in TESTED.items():
        found = installed_version(name)
        if found is None:
            problems[name] = f"{name} is not installed (tested: >={low},<{high}); run `make setup`"
        elif not (_key(low) <= _key(found) < _key(high)):
            problems[name] = (
                f"{name} {found} is installed, but paddlenlp_ext's integration with it is tested "
                f"only for >={low},<{high}"
            )
    return problems


@lru_cache(maxsize=1)
def check_versions() -> None:
    """Raise :class:`UnsupportedVersionError` (or warn, with ``PADDLENLP_EXT_SKIP_VERSION_CHECK=1``)."""
    problems = version_problems()
    if not problems:
        return
    text = "; ".join(problems.values())
    hint = (
        f"install the tested versions (`make setup` uses constraints.txt), or set {SKIP_ENV}=1 to run anyway "
        "(private PaddleNLP symbols this toolkit patches may have changed)"
    )
    if os.environ.get(SKIP_ENV) == "1":
        import warnings

        warnings.warn(f"{text}; running anyway because {SKIP_ENV}=1", stacklevel=2)
        return
    raise UnsupportedVersionError(f"{text}. {hint}")
