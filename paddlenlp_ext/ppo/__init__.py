"""PPO for ``llm/run_ppo.py``: a value head on the policy, GAE, PPO's clipped policy and value losses and a
KL penalty in the reward (``objective.py``), on GRPO's rollouts (``trainer.py``); keys in ``schema.PPOArgument``."""
