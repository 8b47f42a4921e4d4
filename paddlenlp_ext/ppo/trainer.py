"""PPOTrainer: GRPO's rollout machinery (seeded sampling, rewards, reference, accumulation, several
steps per rollout) with a value head on the policy, GAE and PPO's clipped policy and value losses.

The value head is one linear layer ``hidden -> 1`` on the policy's last hidden state (after the final
norm), attached to the model as ``ppo_value_head`` so the optimizer and data parallel see it; it is
trained with the policy (LoRA adapters or every weight) and saved next to the weights as
``value_head.safetensors`` (never inside the policy's own files, so the saved policy / adapter loads
as any other).  ``V_t`` is read at the position that predicts completion token t: the state before it.

One rollout (each micro-batch of the step, before the first trains): completions and scores (the
reward functions and/or the reward model), the policy's log-probs and values and the reference's
log-probs (no gradient) -> ``ppo.objective.token_rewards`` (k1 KL penalty, the clipped score on the
last token; ``whiten_rewards``) -> GAE -> advantages whitened over this rank's rollout.  Each
micro-batch: ``policy_loss + vf_coef * value_loss`` (token means).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddlenlp.utils.log import logger

from ..grpo.rollout import MicroRollout, Rollout
from ..grpo.trainer import ROW_KEYS, GRPOTrainer
from ..models.heads import split_lm_head
from .objective import gae, policy_loss, token_rewards, value_loss, whiten

VALUE_HEAD_NAME = "value_head.safetensors"
HEAD_ATTR = "ppo_value_head"


def policy_and_values(model, batch, temperature: float, value_head, real_tokens=None):
    """([T] log-probs, [T] values) of the completion tokens of ``batch`` (one forward).

    The body + lm_head split runs lm_head on the scored rows only; a data-parallel wrapper (whose
    forward registers the gradient all-reduce) runs whole, its last hidden state (after the final norm)
    read from ``hidden_states``.  ``real_tokens`` [B, S]: the policy's training forward on an MoE row, whose
    router aux loss over those tokens is recorded for the trainer (training/moe_aux.py)."""
    from ..training.moe_aux import prepare_forward, record_body_forward

    kw = {k: batch[k] for k in ROW_KEYS if batch.get(k) is not None}
    index = batch["logp_index"]  # [T] flat row * S + position
    split = split_lm_head(model, router_aux=True)
    if split is not None:
        body, head = split
        out = body(**kw, use_cache=False, return_dict=True)
        if real_tokens is not None:
            record_body_forward(model, getattr(out, "router_logits", None), real_tokens)
        hidden = out[0]  # [B, S, H]
        rows = paddle.gather(hidden.reshape([-1, hidden.shape[-1]]), index, axis=0)  # [T, H]
        logits = head(rows.unsqueeze(0))[0]  # [T, V]
    else:
        if real_tokens is not None:
            prepare_forward(model, real_tokens)  # the whole forward records the aux loss over real tokens itself
        out = model(**kw, use_cache=False, output_hidden_states=True, return_dict=True)
        hidden = out.hidden_states[-1]  # [B, S, H]
        rows = paddle.gather(hidden.reshape([-1, hidden.shape[-1]]), index, axis=0)  # [T, H]
        logits = paddle.gather(out.logits.reshape([-1, out.logits.shape[-1]]), index, axis=0)  # [T, V]
    logits = logits.astype("float32") / float(temperature)
    logps = -F.cross_entropy(logits, batch["logp_token"].unsqueeze(-1), reduction="none").squeeze(-1)  # [T]
    values = value_head(rows.astype("float32")).squeeze(-1)  # [T]
    return logps, values


class PPOTrainer(GRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if split_lm_head(self.model, router_aux=True) is None:
            raise ValueError(
                "PPO's value head reads the policy's last hidden states, which this model family does "
                "not expose (no separable lm_head); use a Llama or Qwen2 family model"
            )
        if not hasattr(self.model, HEAD_ATTR):
            head = nn.Linear(int(self.model.config.hidden_size), 1)
            with paddle.no_grad():
                head.weight.set_value(paddle.zeros_like(head.weight))  # V = 0 at the start: no bias in the first GAE
                head.bias.set_value(paddle.zeros_like(head.bias))
            self.model.add_sublayer(HEAD_ATTR, head)
        self.loss_type = "ppo"
        logger.info(
            f"PPO: kl_coeff {self.grpo.kl_coeff}, clip_range_ratio {self.grpo.clip_range_ratio}, "
            f"clip_range_value {self.grpo.clip_range_value}, gamma {self.grpo.gamma}, "
            f"gae_lambda {self.grpo.gae_lambda}, vf_coef {self.grpo.vf_coef}"
        )

    # -- the value head's own file ---------------------------------------------------
    @contextlib.contextmanager
    def _head_detached(self):
        """The policy without its value head (its files are the policy's alone)."""
        head = getattr(self.model, HEAD_ATTR, None)
        if head is not None:
            delattr(self.model, HEAD_ATTR)  # Layer.__delattr__ drops the sublayer
        try:
            yield head
        finally:
            if head is not None:
                self.model.add_sublayer(HEAD_ATTR, head)

    def _write_weights(self, output_dir: str) -> None:
        from safetensors.numpy import save_file

        with self._head_detached() as head:
            super()._write_weights(output_dir)
        if head is not None:
            save_file({k: v.numpy() for k, v in head.state_dict().items()}, os.path.join(output_dir, VALUE_HEAD_NAME))

    def load_weights(self, resume_from_checkpoint) -> bool:
        from safetensors.numpy import load_file

        with self._head_detached() as head:
            done = super().load_weights(resume_from_checkpoint)
        path = (
            os.path.join(str(resume_from_checkpoint), VALUE_HEAD_NAME)
            if resume_from_checkpoint and not isinstance(resume_from_checkpoint, bool)
            else None
        )
        if head is not None and path and os.path.isfile(path):
            head.set_state_dict({k: paddle.to_tensor(v) for k, v in load_file(path).items()})
            logger.info(f"Loaded the value head from {path}")
        return done

    # -- the rollout ------------------------------------------------------------------
    def _set_advantages(self, rollout: Rollout, G: int, world: int) -> None:
        """Token rewards, GAE and whitened advantages of every micro-batch of this rank's rollout."""
        o = self.grpo
        was_training = self.model.training
        self.model.eval()
        try:
            with paddle.no_grad():
                for m in rollout.micro:
                    m.old_logps, m.old_values = policy_and_values(
                        self.model, m.batch, o.temperature, getattr(self.model, HEAD_ATTR)
                    )
        finally:
            if was_training:
                self.model.train()
        rewards, segments = [], []
        for m in rollout.micro:
            seg = m.batch["logp_segment"].numpy()
            ref = m.ref_logps.numpy() if m.ref_logps is not None else m.old_logps.numpy()
            rewards.append(token_rewards(m.old_logps.numpy(), ref, m.rewards, seg, o.kl_coeff, o.clip_range_score))
            segments.append(seg)
        if o.whiten_rewards:  # over this rank's rollout, the mean kept (TRL's shift_mean=False)
            flat = whiten(np.concatenate(rewards), shift_mean=False)
            rewards = np.split(flat, np.cumsum([len(r) for r in rewards])[:-1])
        advs, rets = [], []
        for m, r, seg in zip(rollout.micro, rewards, segments):
            a, ret = gae(r, m.old_values.numpy(), seg, o.gamma, o.gae_lambda)
            advs.append(a)
            rets.append(ret)
            m.kl_tokens = (m.old_logps - m.ref_logps).numpy() if m.ref_logps is not None else None
        flat = whiten(np.concatenate(advs))  # over every token of this rank's rollout (TRL's masked_whiten)
        for m, a, ret in zip(rollout.micro, np.split(flat, np.cumsum([len(a) for a in advs])[:-1]), rets):
            m.token_advantages = paddle.to_tensor(a.astype(np.float32))  # [T]
            m.returns = paddle.to_tensor(ret.astype(np.float32))  # [T]
            m.advantages = np.zeros(len(m.completions), dtype=np.float32)  # (per completion: unused by PPO)

    # -- one micro-batch ----------------------------------------------------------------
    def _micro_loss(self, model, m: MicroRollout):
        o = self.grpo
        real = self._policy_real_tokens(model, m.batch, pop=False)  # [B, S] on an MoE row with an aux loss, else None
        logps, values = policy_and_values(model, m.batch, o.temperature, getattr(self.model, HEAD_ATTR), real)  # [T]
        pg, pg_clipped = policy_loss(logps, m.old_logps, m.token_advantages, o.clip_range_ratio)
        vf, vf_clipped = value_loss(values, m.old_values, m.returns, o.clip_range_value)
        loss = self.with_router_aux(model, pg + o.vf_coef * vf, real)  # + router_aux_loss_coef * aux (MoE rows)
        lengths = np.asarray([len(c) for c in m.completions], dtype=np.float64)
        metrics = {
            "reward": float(np.mean(m.rewards)),
            "policy_loss": float(pg),
            "value_loss": float(vf),
            "clip_ratio": float(pg_clipped.astype("float32").mean()),
            "value_clip_ratio": float(vf_clipped.astype("float32").mean()),
            "completion_length": float(lengths.mean()),
        }
        if m.kl_tokens is not None:
            metrics["kl"] = float(np.mean(m.kl_tokens))
        for name, values_ in m.per_func.items():
            metrics[f"rewards/{name}"] = float(np.mean(values_))
        return loss, metrics
