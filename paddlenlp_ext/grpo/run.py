"""GRPO (``llm/run_grpo.py``; PPO's ``ppo.run`` with its own trainer): the run recipe (``training.recipe``)
with these hooks.

data: the prompts (read, rendered) and the rewards (before the model: a reward model loads first) ->
trainer: :class:`~paddlenlp_ext.grpo.trainer.GRPOTrainer` (the multi-turn tool environment when tools are
configured; its runner closed however training ends) -> summary: the rollout settings before training;
prompts, completions and tokens, the per-step rewards and the mean reward of the first and last ten steps
after it.  GRPO only trains (no evaluation set).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Dict, List

from ..config.parse import ConfigError, RunConfig
from ..training.recipe import RunHooks, run_recipe

#: per-step metrics copied from the log history into run_summary.json
STEP_KEYS = (
    "loss",
    "reward",
    "reward_std",
    "kl",
    "clip_ratio",
    "completion_length",
    "rollout_time",
    "tools/call_frequency",
    "tools/failure_frequency",
    "tools/turns",
    "aux_loss",
)


def build_prompts(cfg: RunConfig, tokenizer):
    """(PromptDataset, report): the train prompts rendered with the run's template (DataError naming file:line)."""
    from ..data.build import make_renderer
    from ..data.reader import DataError
    from ..data.tokenize import resolve_chat_template
    from ..dpo.data import resolve_split_files
    from .data import PromptDataset, fit_prompt, offer_tools, read_prompts

    o, d = cfg.alignment, cfg.data
    files = resolve_split_files(o.train_dataset_path, "train")
    records = read_prompts(files, d.dataset_format, d.dataset_columns)
    use_template = resolve_chat_template(tokenizer, d.chat_template)
    renderer = make_renderer(cfg, tokenizer, use_template)
    schemas = tool_schemas(cfg, renderer)
    if schemas:
        problems = []
        for k, rec in enumerate(records):
            try:
                records[k] = offer_tools(rec, schemas)
            except ValueError as e:
                problems.append(str(e))
        if problems:
            raise DataError(problems[:20], max(len(problems) - 20, 0))
    renderer.src_length = renderer.max_length = 1 << 30  # fit_prompt cuts, by the one truncation policy
    ids, problems, truncated = [], [], 0
    for rec in records:
        try:
            ids_i, cut, _ = fit_prompt(rec, renderer, o.max_prompt_len)  # oldest rounds first, then the left
            truncated += int(cut)
            ids.append(ids_i)
        except (ValueError, TypeError, KeyError, IndexError, StopIteration) as e:  # re-raised with file:line
            problems.append(f"{rec.origin}: could not render the prompt: {e}")
    if problems:
        raise DataError(problems)
    dataset = PromptDataset(records, ids)
    report = {
        "files": files,
        "chat_template": use_template,
        "packing": "in_order" if d.zero_padding else "none",
        "examples": len(dataset),
        "tokens": dataset.stats()["prompt_tokens"],
        **dataset.stats(),
        "truncated_prompts": truncated,
    }
    if schemas:
        report["tools"] = schemas
    if truncated:
        from ..training.console import current

        current().line(
            f"notice: {truncated} of {len(dataset)} prompts are longer than max_prompt_len "
            f"{o.max_prompt_len}: their oldest rounds go first, then they keep their last "
            f"{o.max_prompt_len} tokens (docs/data.md); raise max_prompt_len to "
            "keep them whole"
        )
    return dataset, report


def tool_schemas(cfg: RunConfig, renderer):
    """The tools' JSON schemas, or None without tools; ConfigError when the chat template cannot offer them
    (no jinja template, or one that writes no tool-call format the parser reads)."""
    from ..config.grpo import resolve_tools
    from ..serve.tools import tool_style

    tools = getattr(cfg.alignment, "tools", None)
    if not tools:
        return None
    source = renderer.templates.get(True) or renderer.templates.get(False)
    where = cfg.source or "config"
    if not source:
        raise ConfigError(
            [
                f"{where}: tools need a jinja chat template that renders tools= and tool calls (the "
                "tokenizer has none): set chat_template to a jinja file, e.g. the model family's own"
            ]
        )
    if tool_style(source) is None:
        raise ConfigError(
            [
                f"{where}: the chat template writes no tool-call format the parser reads (<tool_call> "
                "blocks, or Llama 3's <|python_tag|> JSON); use a template that does"
            ]
        )
    return [schema for _, schema in resolve_tools(tools)]


def tool_env(cfg: RunConfig, tokenizer, dataset_report):
    """The multi-turn rollout's :class:`~paddlenlp_ext.grpo.multiturn.ToolEnv`, or None without tools."""
    if not getattr(cfg.alignment, "tools", None):
        return None
    from ..data.chat_template import find_template, special_tokens_of
    from ..serve.tools import tool_style
    from .multiturn import ToolEnv
    from .tools import ToolRunner

    m, o = cfg.model, cfg.alignment
    source = find_template(m.tokenizer_name_or_path or m.model_name_or_path, cfg.data.chat_template, True)
    return ToolEnv(
        tokenizer=tokenizer,
        source=source,
        special=special_tokens_of(tokenizer),
        style=tool_style(source),
        schemas=dataset_report["tools"],
        runner=ToolRunner(o.tools, o.tool_timeout),
        eos_ids=[int(tokenizer.eos_token_id)],
    )


def reward_trend(log_history: List[Dict[str, Any]], n: int = 10) -> Dict[str, Any]:
    """Per-step metrics and the mean reward of the first and last ``n`` logged steps.

    >>> t = reward_trend([{"step": s, "reward": float(s), "loss": 0.0} for s in range(1, 5)], n=2)
    >>> t["reward_first"], t["reward_last"]
    (1.5, 3.5)
    """
    steps = [{k: e[k] for k in ("step",) + STEP_KEYS if k in e} for e in log_history if "reward" in e]
    rewards = [s["reward"] for s in steps]
    out: Dict[str, Any] = {"steps": steps}
    if rewards:
        out.update(
            reward_first=sum(rewards[:n]) / len(rewards[:n]),
            reward_last=sum(rewards[-n:]) / len(rewards[-n:]),
            reward_window=min(n, len(rewards)),
        )
    return out


class GRPOHooks(RunHooks):
    mode = "grpo"

    def __init__(self, trainer_cls=None):
        self.trainer_cls = trainer_cls  # GRPOTrainer by default; ppo.run passes PPOTrainer
        self.env = None

    def data(self, cfg, args, tokenizer, resume_cursor):
        from .data import prompt_collator
        from .rewards import RewardSet

        dataset, report = build_prompts(cfg, tokenizer)
        o = cfg.alignment
        self.rewards = RewardSet(o.reward_funcs or [], o.reward_model_name_or_path, o.reward_weights)
        return SimpleNamespace(train=dataset, dev=None, collator=prompt_collator, reports={"train": report})

    def trainer(self, cfg, built, args, tokenizer, data):
        from .trainer import GRPOTrainer

        self.env = tool_env(cfg, tokenizer, data.reports["train"])
        extra = {"tool_env": self.env} if self.env is not None else {}
        return (self.trainer_cls or GRPOTrainer)(
            model=built.model,
            args=args,
            train_dataset=data.train,
            tokenizer=tokenizer,
            data_collator=data.collator,
            adapter_config=built.adapter_config,
            grpo_config=cfg.alignment,
            rewards=self.rewards,
            flash_mask=cfg.model.flash_mask,
            packed=cfg.data.zero_padding,
            **extra,
        )

    def describe(self, cfg, trainer) -> Dict[str, Any]:
        from paddlenlp.utils.log import logger

        o, env = cfg.alignment, self.env
        out = {
            "trainer": o.mode,
            "loss_type": o.loss_type,
            "reference": trainer.reference,
            "rewards": self.rewards.names,
            "num_generations": o.num_generations,
            "num_iterations": o.num_iterations,
            "importance_sampling_level": o.importance_sampling_level,
            "scale_rewards": o.scale_rewards,
            "epsilon_high": trainer.epsilon_high,
        }
        if env is not None:
            out.update(tools=list(o.tools), max_turns=o.max_turns, tool_timeout=o.tool_timeout)
            logger.info(
                f"GRPO tools: {[s['function']['name'] for s in env.schemas]}, up to {o.max_turns} turns, "
                f"{o.tool_timeout:g} s per call, {env.style} tool calls"
            )
        return out

    @contextlib.contextmanager
    def training(self):
        try:
            yield
        finally:
            if self.env is not None:
                self.env.runner.close()

    def trained(self, cfg, trainer, summary, train_time) -> None:
        from ..training.console import current
        from ..training.rank_counts import sum_over_ranks

        if self.env is not None:
            summary["tool_isolation"] = self.env.runner.isolation  # the no-network layers the tool process had
        tokens, completion_tokens = trainer.global_token_counts()
        completions, prompts, real = sum_over_ranks(
            [trainer.trained_pairs, trainer.trained_prompts, trainer.trained_real_tokens]
        )
        summary.update(
            row_tokens_trained=tokens,
            completion_tokens_trained=completion_tokens,
            prompts_trained=prompts,
            completions_trained=completions,
            tokens_trained=real,
            row_padding_ratio=round(1.0 - real / max(tokens, 1), 4),
            completions_per_second=round(completions / max(train_time, 1e-9), 3),
        )
        summary.update(reward_trend(trainer.state.log_history), rollouts_generated=trainer.rollouts)
        if self.env is not None:
            calls = [s["tools/call_frequency"] for s in summary["steps"] if "tools/call_frequency" in s]
            summary["tool_calls_per_completion"] = sum(calls) / len(calls) if calls else 0.0
        if "reward_first" in summary:
            k = summary["reward_window"]
            current().line(
                f"mean reward: first {k} steps {summary['reward_first']:.4f} -> last {k} steps "
                f"{summary['reward_last']:.4f}"
            )


def run(cfg: RunConfig) -> Dict[str, Any]:
    """Train as configured; returns the run summary (also output_dir/run_summary.json)."""
    return run_recipe(cfg, GRPOHooks())
