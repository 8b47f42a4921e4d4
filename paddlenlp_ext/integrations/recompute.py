"""Paddle's non-reentrant recompute for our decoder's layers, without its false warning.

``paddle.distributed.fleet.utils.recompute`` first checks whether any tensor input of the block needs a
gradient and, when none does, logs "[Recompute]: None of the inputs to current recompute block need grad,
therefore there is NO need to recompute this block in backward !" through the logger of
``paddle.distributed.fleet.utils.log_util``, on every call.  Under LoRA the first layer's input (the frozen
embedding's output) and the RoPE tables never need one, so the warning fills the console once per
micro-batch.  It is false for the non-reentrant form (``use_reentrant=False``): that form saves the block's
tensors through hooks, so the parameters inside (the adapters) get their gradients whatever the inputs are
(``tests/test_decoder_parity.py`` compares them with PEFT's).  :func:`recompute_layer` drops exactly that
record while it runs the non-reentrant form; every other record of that logger passes, and the reentrant
form, where the warning is true (nothing inside would be trained), is never called here.
"""

from __future__ import annotations

import importlib
import logging

from paddle.distributed.fleet.utils import recompute

from .versions import check_versions

check_versions()

_RECOMPUTE_MODULE = "paddle.distributed.fleet.recompute.recompute"
#: (object path, attribute, parameter names or None) this module relies on (tests/test_integrations.py).
RELIED_ON = [
    (_RECOMPUTE_MODULE, "recompute", ("function", "args", "kwargs")),
    (_RECOMPUTE_MODULE, "logger", None),
]
FALSE_WARNING = "[Recompute]: None of the inputs to current recompute block need grad"


class _DropFalseWarning(logging.Filter):
    """Drops :data:`FALSE_WARNING` while ``depth`` > 0 (inside :func:`recompute_layer`)."""

    depth = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.depth and record.getMessage().startswith(FALSE_WARNING))


_FILTER = _DropFalseWarning()
importlib.import_module(_RECOMPUTE_MODULE).logger.addFilter(_FILTER)


def recompute_layer(layer, *args):
    """``layer(*args)`` keeping only its inputs for backward (Paddle's non-reentrant recompute)."""
    _FILTER.depth += 1
    try:
        return recompute(layer, *args, use_reentrant=False)
    finally:
        _FILTER.depth -= 1
