"""GRPO (Group Relative Policy Optimization, DeepSeekMath 2024) for ``llm/run_grpo.py``.

Owns online RL with verifiable rewards: prompts read from any data format and rendered with the
training chat template (``data.py``), G seeded completions per prompt from the KV-cache generation
(``sampling.py``), rewards from Python functions named in the config and/or a reward model
(``rewards.py``), group-normalised advantages and the clipped objective with the k3 KL term
(``objective.py``), prompt + completion sequences packed into rows with start-row masks
(``rows.py``) and the trainer (``trainer.py``).  The config mode is ``config/grpo.py``.

One step: the global batch of prompts (``data.global_batches`` order, each rank its slice) ->
G completions each (seeded by (seed, prompt index, generation index, step), never by the rank) ->
rewards -> advantages per group -> one policy forward over the packed rows (and the reference's:
adapters off for LoRA, a frozen copy for full fine-tuning, none for beta=0) -> the loss summed over
every completion token and divided by the completion tokens of the global batch.
"""
