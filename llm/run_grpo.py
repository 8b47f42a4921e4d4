"""GRPO (group relative policy optimization) of a causal LM with reward functions, from a JSON config.

    python llm/run_grpo.py llm/config/tiny/grpo_argument.json [--key value ...]

Data: prompts in any data format (messages, alpaca, sharegpt, src/tgt; a trailing answer is
dropped); the other fields of each record are passed to the reward functions.  Keys: TRL's
GRPOConfig names (num_generations, max_completion_length, temperature, top_p, beta, epsilon,
scale_rewards, reward_funcs, reward_weights, ...; docs/alignment.md) plus the model / adapter /
training keys of llm/run_finetune.py.  Config problems (a reward function that cannot be imported
included) are all reported together, before anything is loaded, with exit code 2; so are bad
data records (``file:line``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paddlenlp_ext.cli.prelude import prepare_script  # noqa: E402

prepare_script(
    __file__, config_first=True
)  # this project's Python; CPU threads and MKL before paddle loads; import noise off

from paddlenlp_ext.cli.common import run_config_script  # noqa: E402

USAGE = "usage: python llm/run_grpo.py CONFIG.json [--key value ...]"


def main(argv):
    return run_config_script(argv, USAGE, mode="grpo", runner="paddlenlp_ext.grpo.run")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
