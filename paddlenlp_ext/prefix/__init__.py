"""Prefix tuning (Li & Liang 2021), in PaddleNLP's semantics and save format.

A frozen causal LM gets ``num_prefix_tokens`` trained key/value vectors in
front of every attention layer (passed as ``past_key_values``); only the
prefix trains.  Owns:

    config.py  PrefixConfig (the prefix_config.json fields of PaddleNLP), model
               facts, config validation for config.parse; never imports paddle
    model.py   PrefixEncoder, PrefixModel (the wrapper: forward, masks, generate)
    io.py      save / load in PaddleNLP's files (prefix_config.json,
               prefix_model_state.pdparams, pre_caches.npy), the trainer hook,
               attach_prefix() used by training/run.py

Importing this package never imports paddle (config.parse imports
``prefix.config``); import ``prefix.model`` / ``prefix.io`` for the rest.
See docs/prefix.md.
"""
