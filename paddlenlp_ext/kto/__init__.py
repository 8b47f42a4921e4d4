"""KTO (Kahneman-Tversky Optimization) training for ``llm/run_kto.py``.

Owns what is KTO-specific: unpaired examples (a conversation whose last turn is the
assistant's completion, plus a boolean ``label``: desirable or not) read and validated with
``file:line`` errors (``data.py``), the KTO loss with its KL reference point (``losses.py``)
and the trainer (``trainer.py``).  Everything else is DPO's machinery, reused:

* each example becomes a DPO pair row ``prompt + completion + kl_completion``
  (:mod:`paddlenlp_ext.dpo.pair_rows`): the "chosen" slot holds the example's own completion,
  the "rejected" slot a *mismatched* completion (the previous example's, in data order) used
  only to estimate the KL reference point z0.  Both see the prompt and never each other, so
  packing (FlashMask start rows or dense masks) scores them exactly as separate sequences;
* per-answer log-probs (:mod:`paddlenlp_ext.dpo.logps`), the reference (adapters disabled for
  LoRA, a frozen copy for full fine-tuning) and the metric bookkeeping of
  :class:`~paddlenlp_ext.dpo.trainer.DPOTrainer`;
* the config mode (``load_config(..., mode="kto")``: ``config/kto.py``) and ``dpo.run``'s builder.

The batch contract is :mod:`paddlenlp_ext.dpo`'s plus ``kto_label`` ``[N]`` int64 (1 desirable,
0 undesirable), one per pair, in pair order.
"""
