"""Serving a fine-tuned model: ``llm/predict/server.py`` (docs/serve.md).

Owns: the OpenAI-compatible HTTP API (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``; streamed as server-sent events) and its request checks and errors
(``protocol.py``, no paddle), text streaming with stop sequences (``textstream.py``), the
served names -- one base and its adapters -- loaded by the predictor's loaders, and prompts
built by the predictor's prompt code (``models.py``), the batching scheduler on one generation
thread (``engine.py``), the routes (``app.py``), flags and SIGTERM draining (``cli.py``), and
the chat page (``static/``).

Never: its own model/adapter loading or prompt format (``predict/`` owns them), training,
or writing weights.  Importing this package, ``protocol``, ``textstream`` or ``models``
never imports paddle.
"""
