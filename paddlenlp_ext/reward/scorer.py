"""Score sequences with a trained reward model: ``RewardScorer`` (the API GRPO and reward_score.py use).

    scorer = RewardScorer.from_pretrained("output/reward_lora")   # full or adapter reward directory
    scorer.score_texts(["What is 2+2?"], ["4"])                   # -> array([0.83], dtype=float32)
    scorer.score_ids([[1, 529, 29871, 2]])                        # one float32 score per sequence

A sequence's score is the score head applied to the hidden state of its LAST token, as in
training (where the last token of each answer is scored, its eos when not truncated).
``score_texts`` renders ``prompt`` + ``completion`` exactly as training rendered a pair's prompt
and one answer (the chat template if training used one, else ``bos + prompt + completion + eos``;
``reward_config.json`` says which), then calls ``score_ids``.
"""

from __future__ import annotations

import os
from typing import List, Sequence

import numpy as np

from .io import load_score_head, read_reward_config

__all__ = ["RewardScorer"]


class RewardScorer:
    """A reward model in eval mode with its tokenizer; build it with :meth:`from_pretrained`."""

    def __init__(self, model, tokenizer, info: dict, use_chat_template: bool, batch_size: int = 8):
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.use_chat_template = bool(use_chat_template)
        self.batch_size = int(batch_size)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad if pad is not None else 0)

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32") -> "RewardScorer":
        """Load a reward output directory (``llm/run_reward.py``'s output_dir or a checkpoint of it,
        full weights or an adapter over ``base_model_name_or_path``, or a merged one) and its tokenizer."""

        from ..data.tokenize import resolve_chat_template
        from ..models.registration import register_decoder, register_qwen3
        from ..models.loading import load_model_streaming
        from ..models.model_config import load_model_config
        from ..models.tokenizer import load_tokenizer
        from .head import attach_score_head

        info = read_reward_config(path)
        register_qwen3()
        register_decoder()  # the decoder's rows (models/family_table.py, Family.decoder) for AutoConfig
        tokenizer = load_tokenizer(path)
        use_template = resolve_chat_template(tokenizer, info.get("chat_template_file"))
        if bool(info.get("chat_template")) != bool(use_template):
            raise ValueError(
                f"{path}: training {'used' if info.get('chat_template') else 'did not use'} a chat "
                f"template, but the saved tokenizer {'has none' if not use_template else 'has one'}"
            )
        weights_dir, quantization = path, None
        if info.get("adapter"):
            from ..adapters.config import AdapterConfig

            weights_dir = info.get("base_model_name_or_path") or AdapterConfig.load(path).base_model_name_or_path
            if not weights_dir or not os.path.isdir(weights_dir):
                raise ValueError(
                    f"{path}: the adapter's base model {weights_dir!r} (reward_config.json "
                    "base_model_name_or_path) is not a directory here"
                )
            quantization = AdapterConfig.load(path).quantization
        config = load_model_config(weights_dir, dtype=dtype)
        config.use_flash_attention = False  # eager attention: the same math on any device
        model, _ = load_model_streaming(weights_dir, config, dtype, quantization=quantization)
        if info.get("adapter"):
            from ..adapters import load_adapter

            load_adapter(model, path)
        attach_score_head(model)
        load_score_head(model, path)
        model.eval()
        for p in model.parameters():
            p.stop_gradient = True
        return cls(model, tokenizer, info, use_template)

    def score_ids(self, input_ids: List[List[int]]) -> np.ndarray:
        """float32 ``[n]``: the score of each sequence's last token (right-padded batches of
        ``batch_size``; causal attention, so padding after the last token changes nothing)."""
        import paddle

        from .head import sequence_scores

        seqs = [list(map(int, s)) for s in input_ids]
        for i, s in enumerate(seqs):
            if not s:
                raise ValueError(f"input_ids[{i}] is empty; every sequence needs at least one token")
        out = np.zeros([len(seqs)], dtype=np.float32)
        order = np.argsort([len(s) for s in seqs], kind="stable")  # similar lengths share a batch
        with paddle.no_grad():
            for start in range(0, len(seqs), self.batch_size):
                chunk = order[start : start + self.batch_size]
                S = max(len(seqs[i]) for i in chunk)
                ids = np.full([len(chunk), S], self.pad_token_id, dtype=np.int64)  # [b, S]
                for b, i in enumerate(chunk):
                    ids[b, : len(seqs[i])] = seqs[i]
                index = np.asarray([b * S + len(seqs[i]) - 1 for b, i in enumerate(chunk)], dtype=np.int64)  # [b]
                pos = np.tile(np.arange(S, dtype=np.int64), [len(chunk), 1])  # [b, S]
                scores = sequence_scores(
                    self.model,
                    {"input_ids": paddle.to_tensor(ids), "position_ids": paddle.to_tensor(pos)},
                    paddle.to_tensor(index),
                )  # [b]
                out[chunk] = scores.numpy()
        return out

    def encode(self, prompt: str, completion: str) -> List[int]:
        """Token ids of ``prompt`` + ``completion`` as training rendered a prompt and one answer
        (truncated as fine-tuning truncates: prompt to max_prompt_len, the whole to max_seq_len)."""
        from ..data.reader import Example
        from ..data.tokenize import encode_turns, fit_turns

        prefix, turns = encode_turns(
            Example([prompt.strip()], [completion.strip()], None), self.tokenizer, self.use_chat_template
        )
        max_seq_len = int(self.info.get("max_seq_len") or 1 << 30)
        max_prompt_len = int(self.info.get("max_prompt_len") or max_seq_len - 1)
        tokens, _, _, _ = fit_turns(prefix, turns, max_prompt_len, max_seq_len)
        return list(tokens)

    def score_texts(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
        """float32 ``[n]``: ``score_ids`` of each ``prompt`` + ``completion`` pair (see :meth:`encode`)."""
        if len(prompts) != len(completions):
            raise ValueError(
                f"{len(prompts)} prompts but {len(completions)} completions; give one completion per prompt"
            )
        return self.score_ids([self.encode(p, c) for p, c in zip(prompts, completions)])
