"""bench/e2e.py's PaddleNLP side: PaddleNLP's own ``llm/run_finetune.py`` (3.0.0b4), run as a user runs it.

    python bench/e2e_paddlenlp.py PADDLENLP_LLM_DIR CONFIG.json RESULT.json

PADDLENLP_LLM_DIR holds PaddleNLP's ``llm/run_finetune.py`` and the ``llm/utils/`` it imports (not part
of the pip package, not part of this repository: see ``bench/e2e.py --paddlenlp-llm``).  The script
runs unchanged as ``__main__`` with ``CONFIG.json``; this wrapper only observes it:

* supervised tokens: the labels != -100 of every batch that reaches ``SFTTrainer.training_step``
  (PaddleNLP's labels are already shifted).

Step times, losses and the training time come from PaddleNLP's own log lines and
``train_results.json``, peak RSS and CPU% from the harness that runs this process; bench/e2e.py reads those.
"""

import json
import os
import runpy
import sys


def main(llm_dir: str, config: str, result_path: str) -> None:
    sys.path.insert(0, llm_dir)  # run_finetune.py imports utils.argument / utils.data from its own dir
    from paddlenlp.trl import SFTTrainer

    supervised = [0]
    original = SFTTrainer.training_step

    def counting_step(self, model, inputs, *args, **kwargs):
        supervised[0] += int((inputs["labels"] != -100).sum())
        return original(self, model, inputs, *args, **kwargs)

    SFTTrainer.training_step = counting_step
    sys.argv = [os.path.join(llm_dir, "run_finetune.py"), config]
    runpy.run_path(sys.argv[0], run_name="__main__")
    with open(result_path, "w") as f:
        json.dump({"supervised_tokens": supervised[0]}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
