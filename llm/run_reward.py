"""Reward-model training: a causal LM's decoder + a scalar score head on preference pairs, from a JSON config.

    python llm/run_reward.py llm/config/tiny/reward_lora_argument.json [--key value ...]

Data: preference pairs in the DPO formats (docs/alignment.md), e.g. dpo_en_demo.json's
``{"conversations": [...], "chosen": {...}, "rejected": {...}}``.  Loss: -log sigmoid(r_chosen -
r_rejected), r = the score of each answer's last token.  Keys: PaddleNLP's llm/alignment/rm ones
(train_dataset_path, dev_dataset_path, max_seq_len, max_prompt_len, greedy_zero_padding, ...;
docs/alignment.md) plus the model / adapter / training keys of llm/run_finetune.py.  Config problems
are all reported together, before anything is loaded, with exit code 2; so are bad data records
(``file:line``).  The output directory is scored with llm/predict/reward_score.py or
``paddlenlp_ext.reward.scorer.RewardScorer``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(
    __file__, config_first=True
)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.cli.common import run_config_script  # noqa: E402

USAGE = "usage: python llm/run_reward.py CONFIG.json [--key value ...]"


def main(argv):
    return run_config_script(argv, USAGE, mode="reward", runner="paddlenlp_ext.reward.run")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
