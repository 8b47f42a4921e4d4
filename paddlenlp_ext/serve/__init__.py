"""Serving a fine-tuned model: ``llm/predict/server.py`` (docs/serve.md).

Owns: the OpenAI-compatible HTTP API (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``; streamed as server-sent events) and its request checks and errors
(``protocol.py``, no paddle), text streaming with stop sequences (``textstream.py``), the
served names -- one base and its adapters -- loaded by the predictor's loaders, and prompts
built by the predictor's prompt code (``models.py``), the batching scheduler on one generation
thread (``engine.py``; static or continuous batches, ``continuous.py``), the decoding loop with
per-row sampling, logprobs and token masks (``decode.py``), logprobs shapes (``logprobs.py``), tool
calls (``tools.py``), llguidance constrained decoding (``constrain.py``), vLLM's tokenizer routes
(``tokens.py``), Prometheus metrics (``metrics.py``), the routes and the API key (``app.py``), flags
and SIGTERM draining (``cli.py``), lm-eval against the server (``evaluate.py``), and the chat page
(``static/``).

Never: its own model/adapter loading or prompt format (``predict/`` owns them), training,
or writing weights.  Importing this package, ``protocol``, ``textstream`` or ``models``
never imports paddle.
"""
