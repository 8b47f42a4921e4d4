"""paddlenlp_ext: JSON-config driven LLM fine-tuning on PaddlePaddle.

Importing the top-level package is cheap and never imports paddle: config
validation (``paddlenlp_ext.config``) must run in well under a second so that
bad configs fail before any model or data is touched.
"""

__version__ = "0.1.0"
