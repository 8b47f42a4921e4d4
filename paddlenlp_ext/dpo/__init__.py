"""Preference training (DPO and its family) for ``llm/run_dpo.py``.

Owns: preference data (``data.py``: PaddleNLP's JSON-lines format read and
validated with ``file:line`` errors, tokenized with the chat template, packed
pairs with FlashMask start-row masks), per-pair response log-probs
(``logps.py``), the loss formulas (``losses.py``) and the DPO trainer
(``trainer.py``: policy vs reference, metrics).

The batch contract between data and model code (both packed and unpacked):

    input_ids        [B, S] int64   the full sequences (NOT shifted): prompt, chosen, rejected, ...
    position_ids     [B, S] int64   the rejected answer restarts at len(prompt); each pair restarts at 0
    attn_mask_startend_row_indices [B, 1, S, 1] int32   (flash_mask) or
    attention_mask   [B, 1, S, S] bool                  (dense; True = may attend)
    logp_index       [T] int64      flat index row * S + position of the logits that predict a scored token
    logp_token       [T] int64      the scored (response) token
    logp_segment     [T] int64      2 * pair + 0 for the chosen answer, 2 * pair + 1 for the rejected one
    num_pairs        int            N; pairs are numbered 0..N-1 across the batch
    real_tokens      [B, S] int64   1 = a token of a pair, 0 = tail padding (the MoE router aux loss's tokens)

A response token ``tok`` at sequence position ``p`` is predicted by the logits
at ``p - 1``, except the first rejected token, whose context is the prompt: it
is predicted by the logits of the last prompt token (``len(prompt) - 1``),
which therefore appears twice in ``logp_index`` (once for chosen[0], once for
rejected[0]).  So one sequence ``prompt + chosen + rejected`` scores both
answers exactly as two separate sequences would, provided the rejected tokens
see the prompt but not the chosen answer (the mask) and continue the prompt's
positions (``position_ids``).
"""
