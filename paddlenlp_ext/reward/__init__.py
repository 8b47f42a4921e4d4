"""Reward-model training and scoring (``llm/run_reward.py``, ``llm/predict/reward_score.py``).

Owns what is reward-model specific; the rest is :mod:`paddlenlp_ext.dpo`'s machinery, reused:

* the model (``head.py``): the causal LM's decoder body plus a scalar ``score_head``
  (``Linear(hidden, 1)`` without bias, PaddleNLP's ``LlamaModelForScore`` name and shape) that
  scores the LAST token of each sequence -- in a packed pair row, the last token of each
  chosen and each rejected answer; the pairwise Bradley-Terry loss
  ``-log sigmoid(r_chosen - r_rejected)`` and the pair metrics;
* the data (``data.py``): DPO's preference pairs and packed pair rows
  (:mod:`paddlenlp_ext.dpo.pair_rows`, FlashMask start rows) plus ``score_index``, the flat
  ``row * S + position`` of every answer's last token (chosen, rejected, pair by pair);
* saving (``io.py``): a reward output or checkpoint directory is the model's usual files
  (full weights, or the adapter + the base's config) plus ``score_head.safetensors`` and
  ``reward_config.json`` (how training rendered prompts, the base model of an adapter);
* ``RewardTrainer`` (``trainer.py``) and the run (``run.py``: ``dpo.run`` with reward data and
  trainer);
* scoring a saved reward model (``scorer.py``: :class:`~paddlenlp_ext.reward.scorer.RewardScorer`,
  used by ``llm/predict/reward_score.py`` and by GRPO's reward-model rewards).

Batch contract: :mod:`paddlenlp_ext.dpo`'s plus ``score_index`` ``[2N]`` int64 (``2k``: pair k's
chosen answer, ``2k + 1``: its rejected one).
"""
