"""The key groups of the alignment CLIs (no paddle import here): ``llm/run_dpo.py``, ``run_kto.py``,
``run_reward.py``, ``run_grpo.py`` and ``run_ppo.py``, each held in ``RunConfig.alignment``.

Same conventions as ``schema.py`` (PaddleNLP's / TRL's names and defaults; field metadata as ``keys.py``
says), which re-exports every name here.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

from .keys import key as _f
from .keys import unsupported_key as _unsupported


# Preference-loss names of PaddleNLP's DPOTrainer (paddlenlp_ext.dpo.losses.PREFERENCE_LOSSES) plus
# its run_dpo.py alias "orpo" (= "or" + sft_loss_ratio 1 + reference_free); kept here as text so the
# config never imports paddle.
GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "rloo")  # grpo/objective.LOSS_TYPES
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "kto_pair", "sppo_hard", "nca_pair", "dpop", "or", "simpo", "orpo")


# Keys of llm/run_dpo.py only (load_config(..., mode="dpo")): PaddleNLP's DPOConfig and
# DPODataArgument (llm/alignment/dpo/dpo_argument.py), same names and defaults.
@dataclass
class DPOArgument:
    beta: float = _f(0.1, "Strength of the KL anchor to the reference model (DPO beta; IPO tau).", gt=0.0)
    simpo_gamma: float = _f(0.5, "SimPO target reward margin gamma.")
    label_smoothing: float = _f(
        0.0,
        "Conservative DPO: assumed probability that a preference label is flipped, in [0, 0.5) "
        "(sigmoid and simpo only).",
        min=0.0,
    )
    loss_type: str = _f(
        "sigmoid",
        "Preference loss (docs/dpo.md): sigmoid (DPO), hinge, ipo, kto_pair, sppo_hard, "
        "nca_pair, dpop, or (ORPO's odds ratio), simpo; orpo = or + sft_loss_ratio 1.",
        choices=DPO_LOSS_TYPES,
    )
    pref_loss_ratio: float = _f(1.0, "Weight of the preference loss in the total loss.", min=0.0)
    sft_loss_ratio: float = _f(0.0, "Weight of the SFT loss (mean NLL of the chosen answers' tokens).", min=0.0)
    dpop_lambda: float = _f(50.0, "DPO-Positive penalty weight lambda (loss_type dpop).", min=0.0)
    ref_model_update_steps: int = _f(
        -1,
        "Copy the policy weights into the reference model every N optimizer steps (full fine-tuning only); -1 = never.",
    )
    reference_free: bool = _f(
        False, "No reference model: the reference log-probs are 0 (forced for or/simpo, as PaddleNLP does)."
    )
    normalize_logps: bool = _f(
        False,
        "Score every answer by its mean token log-prob instead of the sum (ipo, or and simpo always "
        "use the mean, as PaddleNLP).",
    )
    rslora_plus: bool = _f(False, "PaddleNLP's shortcut: rslora=true, lora_plus_scale=4, lora_alpha=4 (needs lora).")
    train_dataset_path: Optional[str] = _f(
        None, "Preference train data: a JSON-lines file (PaddleNLP) or a directory with train.json."
    )
    dev_dataset_path: Optional[str] = _f(None, "Preference dev data: a JSON-lines file or a directory with dev.json.")
    max_seq_len: int = _f(4096, "Maximum tokens of prompt + chosen + rejected; also the packed row length.", gt=2)
    max_prompt_len: int = _f(2048, "Maximum prompt tokens (the prompt is truncated from the left first).", gt=0)
    use_attn_mask_startend_row_indices: bool = _unsupported(
        True,
        "PaddleNLP's switch between start-row and dense masks.",
        "not a separate switch here: flash_mask decides the mask form (true: start rows, false: dense)",
    )
    offset_alpha: float = _unsupported(0.0, "Score-based DPO offset.")
    ignore_eos_token: bool = _unsupported(False, "Leave the EOS token out of the answer log-probs.")
    mask_out_eos_token: bool = _unsupported(True, "EOS loss masking of PaddleNLP's streaming DPO data.")
    num_samples_each_epoch: int = _unsupported(
        6000000, "Samples per epoch of PaddleNLP's streaming DPO data.", "not used: the data is read in memory"
    )
    buffer_size: int = _unsupported(
        1000, "Preloading buffer of PaddleNLP's streaming DPO data.", "not used: the data is read in memory"
    )
    dpo_benchmark: bool = _unsupported(False, "PaddleNLP's DPO benchmark mode.")


# Keys of llm/run_kto.py only (the KTO mode of config/modes.py; held in RunConfig.alignment, the preference key
# group): PaddleNLP's KTOConfig and KTODataArgument (llm/alignment/kto/kto_argument.py), same names and
# defaults, plus ref_model_update_steps as in DPO.
@dataclass
class KTOArgument:
    beta: float = _f(0.1, "Strength of the KL anchor to the reference model (KTO beta).", gt=0.0)
    desirable_weight: float = _f(1.0, "Weight lambda_D of the desirable (label true) examples' loss.", min=0.0)
    undesirable_weight: float = _f(1.0, "Weight lambda_U of the undesirable (label false) examples' loss.", min=0.0)
    ref_model_update_steps: int = _f(
        -1,
        "Copy the policy weights into the reference model every N optimizer steps (full fine-tuning only); -1 = never.",
    )
    rslora_plus: bool = _f(False, "PaddleNLP's shortcut: rslora=true, lora_plus_scale=4, lora_alpha=4 (needs lora).")
    train_dataset_path: Optional[str] = _f(
        None, "KTO train data (messages + boolean label; docs/alignment.md): a file or a directory with train.json."
    )
    dev_dataset_path: Optional[str] = _f(None, "KTO dev data: a file or a directory with dev.json.")
    max_seq_len: int = _f(
        4096,
        "Maximum tokens of prompt + completion + the mismatched (KL) completion; also the packed row length.",
        gt=2,
    )
    max_prompt_len: int = _f(2048, "Maximum prompt tokens (the prompt is truncated from the left first).", gt=0)

    # not keys: what the preference code shared with DPO reads (KTO always has a reference model)
    reference_free = False

    @property
    def loss_type(self) -> str:  # one loss, named after the mode (config/modes.py stamps ``mode``)
        return self.mode


# how GRPO / PPO sample their completions (docs/alignment.md#rollouts): the same tokens under the same seeds
ROLLOUT_ENGINES = ("engine", "generate")
ROLLOUT_ENGINE_DEFAULT = "engine"
ROLLOUT_ENGINE_HELP = (
    "How completions are sampled: engine (every group of a micro-batch decoded as one batch with a "
    "KV cache, finished rows leave it) or generate (PaddleNLP's model.generate, one call per "
    "group); both draw the same tokens under the same seed."
)


# Keys of llm/run_grpo.py only (the GRPO mode of config/modes.py; held in RunConfig.alignment, the alignment key
# group): TRL's GRPOConfig names (num_generations, max_completion_length, epsilon, beta, scale_rewards,
# reward_weights, ...) plus PaddleNLP's data key names (train_dataset_path, max_prompt_len).
@dataclass
class GRPOArgument:
    train_dataset_path: Optional[str] = _f(
        None,
        "GRPO prompts (any data format: messages, alpaca, sharegpt, src/tgt; a trailing answer is dropped; "
        "other fields go to the reward functions): a file or a directory with train.json.",
    )
    reward_funcs: Optional[List[str]] = _f(
        None, 'Reward functions "package.module:function", each f(prompts, completions, **columns) -> floats.'
    )
    reward_model_name_or_path: Optional[str] = _f(
        None, "A reward model directory (llm/run_reward.py's export) scored after the reward functions."
    )
    reward_weights: Optional[List[float]] = _f(
        None, "Weight of each reward (reward_funcs in order, then the reward model); default 1 each."
    )
    num_generations: int = _f(8, "G: completions sampled per prompt (the group of the advantages).", gt=1)
    max_prompt_len: int = _f(
        256,
        "Maximum prompt tokens (longer prompts lose their oldest rounds first, then keep their end; docs/data.md).",
        gt=0,
    )
    max_completion_length: int = _f(64, "Maximum tokens of a completion (its EOS included).", gt=0)
    temperature: float = _f(1.0, "Sampling temperature of the completions (also applied to the scored logits).", gt=0.0)
    top_p: float = _f(1.0, "Top-p (nucleus) of the completions' sampling; 1.0 = off.", gt=0.0)
    rollout_engine: str = _f(ROLLOUT_ENGINE_DEFAULT, ROLLOUT_ENGINE_HELP, choices=ROLLOUT_ENGINES)
    beta: float = _f(0.04, "Weight of the k3 KL term to the reference model; 0 = no reference model.", min=0.0)
    loss_type: str = _f(
        "dapo",
        "TRL's GRPO loss (docs/alignment.md): dapo (tokens of the global batch), grpo "
        "(per-completion mean), bnpo (micro-batch tokens), dr_grpo (completions x max_completion_length),"
        " cispo (clipped-weight REINFORCE), rloo (leave-one-out baseline, KL in the reward).",
        choices=GRPO_LOSS_TYPES,
    )
    epsilon: float = _f(0.2, "Clipping range of the probability ratio (PPO's epsilon; the lower bound).", gt=0.0)
    epsilon_high: Optional[float] = _f(
        None,
        "Upper clipping bound 1 + epsilon_high (DAPO's clip-higher; default "
        "epsilon); cispo: the bound of the weight itself.",
        gt=0.0,
    )
    importance_sampling_level: str = _f(
        "token",
        "Ratio per token, or per completion (sequence: GSPO's length-normalised sequence ratio).",
        choices=("token", "sequence"),
    )
    num_iterations: int = _f(
        1,
        "Optimizer steps per generated batch (TRL's mu); > 1 reuses the rollout with its "
        "old log-probs, so the ratio moves away from 1 and clipping acts.",
        gt=0,
    )
    scale_rewards: Union[str, bool] = _f(
        "group",
        "Advantage scaling: group (divide by the group's std), batch "
        "(the global batch's std), none (Dr. GRPO); true/false = group/none.",
    )
    mask_truncated_completions: bool = _f(False, "Completions cut at max_completion_length (no EOS) carry no loss.")
    normalize_advantages: bool = _f(
        False, "loss_type rloo: normalise the advantages over the global batch (TRL's RLOOConfig key)."
    )
    rslora_plus: bool = _f(False, "PaddleNLP's shortcut: rslora=true, lora_plus_scale=4, lora_alpha=4 (needs lora).")
    tools: Optional[List[str]] = _f(
        None,
        'Tools "package.module:function" offered in the prompt (the chat template\'s tools=) and run between '
        "turns, each in a sandboxed child process without network (docs/alignment.md); needs max_turns >= 2.",
    )
    max_turns: int = _f(
        1,
        "Assistant turns per completion: after a turn with tool calls the results are appended "
        "as tool messages and generation continues, up to this many turns (1 = single turn).",
        gt=0,
    )
    tool_timeout: float = _f(
        10.0, "Seconds one tool call may run; past it the call is stopped and its result is an error message.", gt=0.0
    )

    # not keys: what the alignment code shared with DPO reads
    ref_model_update_steps = -1
    reference_free = False

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + completion sequence (a packed row's length; what the planner sizes)."""
        return self.max_prompt_len + self.max_completion_length


# Keys of llm/run_ppo.py only (the PPO mode of config/modes.py; held in RunConfig.alignment): the prompt, sampling
# and reward keys of GRPO plus PaddleNLP's PPO names (kl_coeff, clip_range_ratio, clip_range_value,
# clip_range_score, gamma, gae_lambda) and TRL's (vf_coef, whiten_rewards).
@dataclass
class PPOArgument:
    train_dataset_path: Optional[str] = _f(
        None, "PPO prompts (as GRPO's: any data format; other fields go to the reward functions)."
    )
    reward_funcs: Optional[List[str]] = _f(
        None, 'Reward functions "package.module:function", each f(prompts, completions, **columns) -> floats.'
    )
    reward_model_name_or_path: Optional[str] = _f(
        None, "A reward model directory (llm/run_reward.py's export) scored after the reward functions."
    )
    reward_weights: Optional[List[float]] = _f(
        None, "Weight of each reward (reward_funcs in order, then the reward model); default 1 each."
    )
    num_generations: int = _f(1, "Completions sampled per prompt.", min=1)
    max_prompt_len: int = _f(
        256,
        "Maximum prompt tokens (longer prompts lose their oldest rounds first, then keep their end; docs/data.md).",
        gt=0,
    )
    max_completion_length: int = _f(64, "Maximum tokens of a completion (its EOS included).", gt=0)
    temperature: float = _f(1.0, "Sampling temperature (also applied to the scored logits).", gt=0.0)
    top_p: float = _f(1.0, "Top-p of the sampling; 1.0 = off.", gt=0.0)
    rollout_engine: str = _f(ROLLOUT_ENGINE_DEFAULT, ROLLOUT_ENGINE_HELP, choices=ROLLOUT_ENGINES)
    kl_coeff: float = _f(
        0.02,
        "Weight of the per-token KL penalty (k1, to the reference) in the reward; 0 = no reference model.",
        min=0.0,
    )
    clip_range_ratio: float = _f(0.2, "Clipping range of the policy ratio.", gt=0.0)
    clip_range_value: float = _f(5.0, "Clipping range of the new values around the rollout's.", gt=0.0)
    clip_range_score: float = _f(50.0, "Scores are clipped to +-clip_range_score before entering the reward.", gt=0.0)
    gamma: float = _f(1.0, "Discount of GAE.", min=0.0)
    gae_lambda: float = _f(0.95, "Lambda of GAE.", min=0.0)
    vf_coef: float = _f(0.1, "Weight of the value loss.", min=0.0)
    whiten_rewards: bool = _f(False, "Whiten the token rewards (keeping their mean) before GAE.")
    num_iterations: int = _f(1, "Optimizer steps per rollout (PPO epochs).", gt=0)
    rslora_plus: bool = _f(False, "PaddleNLP's shortcut: rslora=true, lora_plus_scale=4, lora_alpha=4 (needs lora).")

    # not keys: what the alignment / GRPO code shared with PPO reads
    ref_model_update_steps = -1
    reference_free = False
    epsilon_high = None
    importance_sampling_level = "token"
    scale_rewards = "none"
    mask_truncated_completions = False
    normalize_advantages = False

    @property
    def loss_type(self) -> str:  # one loss, named after the mode (config/modes.py stamps ``mode``)
        return self.mode

    @property
    def beta(self) -> float:
        return self.kl_coeff  # the reference model is needed when the KL penalty is on

    @property
    def epsilon(self) -> float:
        return self.clip_range_ratio

    @property
    def max_seq_len(self) -> int:
        return self.max_prompt_len + self.max_completion_length


# Keys of llm/run_reward.py only (the reward mode of config/modes.py; held in RunConfig.alignment, the preference
# key group): PaddleNLP's reward-model DataArgument (llm/alignment/rm/flashmask/reward_argument.py), same
# names and defaults; its greedy_zero_padding, lazy, benchmark, autotuner_benchmark and model keys are
# the fine-tuning ones of the same names.
@dataclass
class RewardArgument:
    train_dataset_path: Optional[str] = _f(
        None,
        "Reward train data (preference pairs, the DPO formats; docs/alignment.md): a file or a directory "
        "with train.json.",
    )
    dev_dataset_path: Optional[str] = _f(None, "Reward dev data: a file or a directory with dev.json.")
    max_seq_len: int = _f(4096, "Maximum tokens of prompt + chosen + rejected; also the packed row length.", gt=2)
    max_prompt_len: int = _f(2048, "Maximum prompt tokens (the prompt is truncated from the left first).", gt=0)

    # not keys: what the preference code shared with DPO reads (a reward model has no reference model)
    reference_free = True
    ref_model_update_steps = -1
    rslora_plus = False

    @property
    def loss_type(self) -> str:  # one loss, named after the mode (config/modes.py stamps ``mode``)
        return self.mode
