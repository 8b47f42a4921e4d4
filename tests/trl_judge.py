"""TRL's own GRPO / RLOO code run on given tensors (a subprocess of tests/test_grpo_trl.py; torch only).

    python tests/trl_judge.py IN.npz CASES.json OUT.npz [HF_DIR]

Loss cases call ``trl.GRPOTrainer._compute_loss`` on a minimal stand-in holding the attributes it reads;
its ``_get_per_token_logps_and_entropies`` returns the given log-probs (a float64 leaf), so TRL's loss and
its gradient with respect to the log-probs are TRL's code alone.  Advantage cases build a real
``GRPOTrainer`` / ``RLOOTrainer`` on a tiny random transformers model (HF_DIR: model + tokenizer) with a
reward function returning the given rewards, and take ``_generate_and_score_completions``'s advantages.
The TRL version is whatever ``import trl`` finds (PYTHONPATH picks a newer one for cispo).
"""

import json
import sys
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import torch


class StandIn:
    def __init__(self, case, logps):
        self.loss_type = case["loss_type"]
        self.importance_sampling_level = case["level"]
        self.beta = case["beta"]
        self.epsilon_low = case["epsilon"]
        self.epsilon_high = case["epsilon_high"]
        self.max_completion_length = case["max_completion_length"]
        self.top_entropy_quantile = 1.0
        self.current_gradient_accumulation_steps = 1
        self.args = SimpleNamespace(delta=None, use_bias_correction_kl=False)
        self.accelerator = SimpleNamespace(num_processes=1, gather=lambda x: x.reshape(1))
        self.model = SimpleNamespace(training=True)
        self._metrics = defaultdict(lambda: defaultdict(list))
        self.tools = None
        self.use_vllm = False
        self.vllm_importance_sampling_correction = False
        self._logps = logps

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        return self._logps, torch.zeros_like(self._logps)


def loss_case(trl_cls, data, case):
    t = lambda k: torch.from_numpy(np.asarray(data[k], dtype=np.float64))  # noqa: E731
    logps = t("logps").clone().requires_grad_(True)  # [B, T]
    mask = t("mask_masked" if case["mask_truncated"] else "mask")  # [B, T]
    B, T = mask.shape
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": t("advantages"),
        "num_items_in_batch": t("mask").sum(),
    }
    if case["old"]:
        inputs["old_per_token_logps"] = t("old")
    if case["beta"] > 0:
        inputs["ref_per_token_logps"] = t("ref")
    loss = trl_cls._compute_loss(StandIn(case, logps), None, inputs)
    loss.backward()
    return float(loss), logps.grad.numpy()


def rloo_loss_case(data, case):
    """``trl.RLOOTrainer._compute_loss``: the ratio of the summed log-probs, clipped, mean over completions."""
    from trl import RLOOTrainer

    t = lambda k: torch.from_numpy(np.asarray(data[k], dtype=np.float64))  # noqa: E731
    logps = t("logps").clone().requires_grad_(True)  # [B, T]
    mask = t("mask_masked" if case["mask_truncated"] else "mask")
    B, T = mask.shape
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": t("advantages"),
        "old_logps": (t("old") * mask).sum(1),
    }
    loss = RLOOTrainer._compute_loss(StandIn(case, logps), None, inputs)
    loss.backward()
    return float(loss), logps.grad.numpy()


def advantage_case(hf_dir, data, case):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trl

    rewards = np.asarray(data[case["rewards"]], dtype=np.float64)
    G = case["group"]
    n = len(rewards) // G

    def preset(prompts, completions, **kwargs):
        return rewards.tolist()

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    dataset = Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(n)]})
    common = dict(
        output_dir=case["output_dir"],
        per_device_train_batch_size=n * G,
        num_generations=G,
        max_completion_length=4,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
    )
    if case["kind"] == "grpo":
        args = trl.GRPOConfig(**common, scale_rewards=case["scale_rewards"], beta=0.0)
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=preset, args=args, train_dataset=dataset, processing_class=tok
        )
    else:
        args = trl.RLOOConfig(**common, normalize_advantages=case["normalize"], beta=0.0)
        trainer = trl.RLOOTrainer(
            model=model, reward_funcs=preset, args=args, train_dataset=dataset, processing_class=tok
        )
    inputs = [{"prompt": f"prompt {i}"} for i in range(n) for _ in range(G)]
    out = trainer._generate_and_score_completions(inputs)
    return out["advantages"].double().numpy()


def main(argv):
    data = dict(np.load(argv[0]))
    cases = json.load(open(argv[1]))
    hf_dir = argv[3] if len(argv) > 3 else None
    results = {}
    from trl import GRPOTrainer

    for i, case in enumerate(cases):
        if case["kind"] in ("loss", "rloo_loss"):
            loss, grad = loss_case(GRPOTrainer, data, case) if case["kind"] == "loss" else rloo_loss_case(data, case)
            results[f"loss_{i}"] = np.asarray(loss)
            results[f"grad_{i}"] = grad
        else:
            results[f"adv_{i}"] = advantage_case(hf_dir, data, case)
    np.savez(argv[2], **results)


if __name__ == "__main__":
    main(sys.argv[1:])
