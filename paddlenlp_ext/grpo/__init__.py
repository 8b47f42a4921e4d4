"""GRPO (Group Relative Policy Optimization, DeepSeekMath 2024) for ``llm/run_grpo.py``, with TRL's loss variants.

Owns online RL with verifiable rewards: prompts read from any data format and rendered with the
training chat template (``data.py``), G seeded completions per prompt from the KV-cache generation
(``sampling.py``), rewards from Python functions named in the config and/or a reward model
(``rewards.py``), advantages (group / batch / none scaling, RLOO's leave-one-out) and the losses of
every ``loss_type`` (dapo, grpo, bnpo, dr_grpo, cispo, rloo; token or sequence importance sampling)
with the k3 KL term (``objective.py``), prompt + completion sequences packed into rows with start-row
masks (``rows.py``), the rollout of a step kept for ``num_iterations`` steps and across a checkpoint
(``rollout.py``) and the trainer (``trainer.py``).  The config mode is ``config/grpo.py``; PPO
(``paddlenlp_ext.ppo``) reuses the rollout and trainer.

One rollout: this rank's prompts of every accumulation micro-batch of a step (``data.global_batches``
order) -> G completions each (seeded by (seed, prompt index, generation index, step), never by the
rank) -> rewards -> advantages -> the reference's (and, for num_iterations > 1, the generating
policy's) log-probs -> the global batch's completion tokens and completions.  Each micro-batch: one
policy forward over its packed rows -> the loss of ``loss_type`` normalised over the global batch.
"""
