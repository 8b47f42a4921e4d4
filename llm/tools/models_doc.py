"""Write the family x feature table of docs/models.md from the family table.

    python llm/tools/models_doc.py            # rewrite the table between the markers in docs/models.md
    python llm/tools/models_doc.py --check    # exit 1 when docs/models.md is not current

Each cell is "yes (the test that backs it)" or "refused: <the config-time message>" (paddlenlp_ext/models/
family_table.py decides; tests/test_families.py checks this file is current).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from paddlenlp_ext.models.family_table import FAMILIES, feature_problem  # noqa: E402

DOC = os.path.join(ROOT, "docs", "models.md")
BEGIN, END = "<!-- family table: llm/tools/models_doc.py -->", "<!-- end of family table -->"
COLUMNS = [
    ("lora", "LoRA"),
    ("qlora", "QLoRA"),
    ("full", "full"),
    ("packing", "packing"),
    ("flash_mask", "FlashMask"),
    ("dpo", "DPO"),
    ("kto", "KTO"),
    ("reward", "reward"),
    ("grpo", "GRPO"),
    ("tp", "TP"),
    ("pp", "PP"),
    ("merge", "merge"),
    ("predict", "predict"),
    ("hf_checkpoint", "HF checkpoint"),
]

_E2E = "test_families_e2e.py::"
#: the tests behind each "yes" (tests/...); the rows that moved onto our decoder (llama, qwen2, qwen3) are
#: filled in below from the decoder's suites plus the CLI suites that have long run them
EVIDENCE = {
    "qwen3_moe": {
        "lora": "test_qwen3_moe.py (CLI)",
        "qlora": "test_qwen3_moe.py (nf4 streaming load)",
        "full": "test_qwen3_moe.py (gradients vs transformers)",
        "packing": "test_qwen3_moe.py",
        "flash_mask": "test_qwen3_moe.py",
        "merge": "test_qwen3_moe.py (CLI)",
        "hf_checkpoint": "on our decoder: the transformers-layout row below",
    },
}
#: the rows built with our decoder (models/decoder; Family.decoder): the parity suite and the CLI suite
_DEC = "test_decoder_cli.py::test_lora_packing_qlora_and_full_train_a_transformers_checkpoint"
DECODER = {
    "lora": _DEC,
    "qlora": _DEC + " (nf4)",
    "full": _DEC,
    "packing": _DEC + ", test_decoder_parity.py (packed)",
    "flash_mask": _DEC + ", test_decoder_parity.py (packed)",
    "hf_checkpoint": "test_decoder_parity.py (every row vs transformers 4.55)",
    "predict": "test_decoder_cli.py::test_predictor_greedy_text_equals_transformers_generate",
    "merge": "test_decoder_export.py (merge + transformers/PEFT export vs transformers 4.55 and peft)",
    "dpo": "test_decoder_dpo.py (packed pairs == each answer alone, every row; CLI on gemma2, phi3)",
    "tp": "test_decoder_tp.py (TP=2 and sequence parallel == one process: loss and every gradient, every "
    "dense row; LoRA, QLoRA)",
    "pp": "test_decoder_pp.py (PP=2, 4 stages, virtual chunks == one process: loss and every gradient, "
    "every dense row; LoRA; tied embeddings; stage checkpoints)",
}
#: KTO and GRPO score packed rows with DPO's log-prob path (dpo/logps.py): on a family without its own KTO/GRPO run
#: the evidence is that path's test there plus the CLI run on llama
_KTO, _GRPO = "KTO itself: test_kto_e2e.py on llama", "GRPO itself: test_grpo_e2e.py on llama"
for _name, _ev in EVIDENCE.items():
    if "dpo" in _ev:
        _ev.setdefault("kto", f"{_ev['dpo']} (DPO's log-prob path; {_KTO})")
        _ev.setdefault("grpo", f"{_ev['dpo']} (DPO's log-prob path; {_GRPO})")
_ALIGN = "test_decoder_align.py::test_kto_reward_and_grpo_train_every_dense_decoder_row"
DECODER.update(kto=_ALIGN, reward=_ALIGN, grpo=_ALIGN)
#: the MoE rows' alignment cells: the loss = the mode's loss + router_aux_loss_coef x the policy forward's aux loss
#: (in-process, every MoE row and mode) and the four CLIs with LoRA and the aux loss on mixtral
_MOE_T = "test_moe_align.py::test_"
_MOE_CLI = f"{_MOE_T}the_four_alignment_clis_train_an_moe_row_with_lora_and_the_aux_loss on mixtral"
_MOE_KR = f"{_MOE_T}kto_and_reward_losses_add_coef_times_the_policy_aux"
MOE_DECODER = dict(
    DECODER,
    dpo=f"{_MOE_T}dpo_loss_is_the_preference_loss_plus_coef_times_the_policy_aux, test_decoder_dpo.py (packed pairs "
    f"== each answer alone), {_MOE_CLI}",
    kto=f"{_MOE_KR}, {_MOE_CLI}",
    reward=f"{_MOE_KR} (the score head on the MoE body keeps its aux loss), {_MOE_CLI}",
    grpo=f"{_MOE_T}grpo_and_ppo_losses_add_coef_times_the_policy_aux, {_MOE_CLI}",
    tp="test_moe_parallel.py::test_moe_two_ranks_equal_one_process_loss_aux_and_every_gradient (TP=2 and sequence "
    "parallel == one process with the aux loss on: loss and every gradient; "
    "deepseek's latent attention split by heads; test_moe_lora_on_split_experts_equals_one_process; nf4 experts: "
    "test_a_run_loads_its_rank_of_a_transformers_moe_checkpoint)",
    pp="test_moe_parallel.py::test_moe_two_stages_equal_one_process (PP=2 == one process: loss and every gradient, "
    "full and LoRA; with the aux loss off: with router_aux_loss_coef > 0 refused)",
)
#: the dense decoder rows also run the other adapter methods (the MoE rows: LoRA, QLoRA and full only)
DENSE_DECODER = dict(
    DECODER, lora=_DEC + ", test_decoder_methods.py (rsLoRA, LoRA+, PiSSA, VeRA, LoKr + their merge, NEFTune)"
)
#: llama, qwen2 and qwen3 moved onto the decoder: the decoder's matrix runs them like every dense row, the CLI
#: suites on the tiny models (build/tiny-llama, -qwen2, -qwen3: PaddleNLP-layout checkpoints) run them too, and
#: PaddleNLP-built checkpoints load with their classes' logits (test_decoder_moved.py)
_MOVED = {
    "llama": dict(
        lora="test_methods_e2e.py",
        qlora="test_qlora_e2e.py",
        full="test_e2e.py",
        packing="test_packing_e2e.py",
        flash_mask="test_packing_e2e.py",
        dpo="test_dpo_e2e.py",
        kto="test_kto_e2e.py",
        reward="test_reward_e2e.py",
        grpo="test_grpo_e2e.py",
        tp="test_parallel_e2e.py",
        merge="test_merge.py",
        predict="test_predict.py",
        hf_checkpoint="test_hf_checkpoint.py",
    ),
    "qwen2": dict(lora="test_compat_e2e.py", qlora="test_compat_e2e.py", full="test_compat_e2e.py"),
    "qwen3": dict(
        lora="test_qwen3_e2e.py",
        qlora="test_qwen3_e2e.py",
        full="test_qwen3_e2e.py",
        packing="test_qwen3_e2e.py (check_packing)",
        dpo="test_qwen3_e2e.py",
        merge="test_qwen3_e2e.py",
        predict="test_qwen3_e2e.py",
    ),
}
for _name, _cli in _MOVED.items():
    EVIDENCE[_name] = {f: f"{_cli[f]}, {t}" if f in _cli else t for f, t in DENSE_DECODER.items()}
    EVIDENCE[_name]["hf_checkpoint"] += ", test_decoder_moved.py (PaddleNLP's layout)"
NEW_FAMILY = {
    "lora": _E2E + "test_lora_trains",
    "qlora": _E2E + "test_qlora_nf4_trains",
    "full": _E2E + "test_full_finetune_trains",
    "packing": _E2E + "test_check_packing_exact_or_refused",
    "merge": _E2E + "test_merge_then_predict",
    "predict": _E2E + "test_merge_then_predict",
    "dpo": _E2E + "test_lora_dpo_trains_and_packs_exactly",
    "hf_checkpoint": "test_hf_checkpoint.py",
}
NEW_FAMILY.update(
    kto=f"{NEW_FAMILY['dpo']} (DPO's log-prob path; {_KTO})", grpo=f"{NEW_FAMILY['dpo']} (DPO's log-prob path; {_GRPO})"
)


def table() -> str:
    rows = ["| family | " + " | ".join(h for _, h in COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    whole = []
    for name, fam in FAMILIES.items():
        if fam.refused is not None:
            whole.append(f"| {name} | refused: {fam.refused} |")
            continue
        cells = []
        for feature, _ in COLUMNS:
            why = feature_problem(name, feature)
            decoder = DENSE_DECODER if fam.arch is not None and fam.arch.mlp != "moe" else MOE_DECODER
            evidence = EVIDENCE.get(name, decoder if fam.decoder else NEW_FAMILY)
            cells.append(f"yes ({evidence[feature]})" if why is None else f"refused: {why}")
        if fam.hf_row is None:
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
            continue
        # a family whose transformers-layout checkpoints train on another row (qwen3_moe: the decoder's MoE row)
        rows.append(f"| {name} (PaddleNLP layout) | " + " | ".join(cells) + " |")
        hf_evidence = dict(DECODER, tp=MOE_DECODER["tp"], pp=MOE_DECODER["pp"])
        cells = [
            f"yes ({hf_evidence[f]})"
            if feature_problem(name, f, hf_layout=True) is None
            else f"refused: {feature_problem(name, f, hf_layout=True)}"
            for f, _ in COLUMNS
        ]
        rows.append(f"| {name} (transformers layout) | " + " | ".join(cells) + " |")
    rows += [
        "",
        "Families refused as a whole (every column; exit 2 before loading):",
        "",
        "| family | refused |",
        "|---|---|",
        *whole,
    ]
    return "\n".join(rows)


def render(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv) -> int:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print(f"{DOC} is not current; run python llm/tools/models_doc.py", file=sys.stderr)
            return 1
        return 0
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
