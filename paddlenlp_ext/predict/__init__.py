"""Prediction after fine-tuning: ``llm/predict/predictor.py`` (docs/predict.md).

Owns: the predictor's options and their checks before anything loads
(``options.py``, no paddle), reading prompt files with ``file:line`` errors
(``inputs.py``, no paddle), turning a prompt into token ids with the SAME
format and truncation rules as training (``prompts.py``, reusing
``data.tokenize.encode_turns``), loading the base model with an adapter,
PaddleNLP LoRA adapter or prefix from ``--lora_path`` (``session.py``),
batched left-padded generation with the KV cache and token streaming
(``generate.py``), and the two ways to run: a prompt file and an interactive
chat (``run.py``).

Never: training, the trainer, or writing model weights (merging into a
checkpoint is ``merge/``).  Bad input raises :class:`PredictInputError`
(exit code 2 in the CLI).

Importing this package, ``options``, ``inputs`` or ``prompts`` never imports paddle,
so a bad command line or data file fails in well under a second.
"""

from .inputs import PredictInputError

__all__ = ["PredictInputError"]
