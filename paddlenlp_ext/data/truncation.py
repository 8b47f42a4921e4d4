"""The one truncation policy of every trainer (docs/data.md), on token segments (pure functions).

An example is ``prefix`` (bos / system / tools, as the template renders them), ``history`` (earlier
rounds: a user turn and everything up to the next one), ``last`` (the turn(s) the answers reply to,
ending with the assistant header) and its ``answers`` (one for SFT, chosen + rejected for DPO, KTO and
reward models).  When it does not fit:

1. history is cut from the oldest round first, while the prompt is longer than ``max_prompt_len``
   or the whole longer than ``max_seq_len`` (whole rounds: no half question stays);
2. then the prompt is cut from the left (HF's ``truncation_side="left"``: its end, the question's last
   words and the assistant header, stays) to ``max_prompt_len`` -- the prefix is kept while it leaves
   room for some of the question, else the prompt's last tokens are kept;
3. then the answers lose their tails (eos included) to fit ``max_seq_len``, shared in proportion
   to their lengths, at least one token each.

``max_prompt_len`` bounds the whole prompt, history included.  Every example fits as long as
``max_prompt_len + len(answers) <= max_seq_len`` (the config checks it), so nothing is refused for
its length.
"""

from typing import Dict, List, Sequence, Tuple


def cut_prompt(prefix: Sequence[int], last: Sequence[int], cap: int) -> List[int]:
    """``prefix + last`` cut from the left to ``cap`` tokens, the prefix kept while ``last`` keeps a token.

    >>> cut_prompt([1], [5, 6, 7, 8], 3)
    [1, 7, 8]
    >>> cut_prompt([1, 2, 3], [5, 6], 2)
    [5, 6]
    """
    if len(prefix) + len(last) <= cap:
        return list(prefix) + list(last)
    keep = cap - len(prefix)
    if keep >= 1:
        return list(prefix) + list(last[len(last) - keep :])
    return (list(prefix) + list(last))[-cap:]


def share_answers(answers: Sequence[Sequence[int]], room: int) -> List[List[int]]:
    """Cut the answers' tails so they total at most ``room`` tokens, in proportion to their lengths
    (the first gets ``int(len / total * room)``, at least 1, the second the rest).

    >>> share_answers([[20, 21, 22, 23, 2], [30, 31, 2]], 6)
    [[20, 21, 22], [30, 31, 2]]
    >>> share_answers([[6, 7, 8, 2]], 2)
    [[6, 7]]
    """
    lens = [len(a) for a in answers]
    if sum(lens) <= room:
        return [list(a) for a in answers]
    if len(answers) == 1:
        return [list(answers[0][:room])]
    c = min(max(int(lens[0] / sum(lens) * room), 1), room - 1)
    return [list(answers[0][:c]), list(answers[1][: room - c])]


def fit_segments(
    prefix: Sequence[int],
    history: Sequence[Sequence[int]],
    last: Sequence[int],
    answers: Sequence[Sequence[int]],
    max_seq_len: int,
    max_prompt_len: int,
    bound_history: bool = True,
) -> Tuple[List[int], List[List[int]], Dict]:
    """``(prompt, answers, info)`` by the policy of the module doc; ``info`` = ``{"dropped_rounds",
    "truncated_prompt", "truncated_response"}``.  ``bound_history=False`` (fine-tuning, whose history answers
    are learned too): ``max_prompt_len`` bounds ``prefix + last`` only, and history rounds go only while the
    whole does not fit ``max_seq_len``.  Worked examples (max_prompt_len 4): the history round would make the
    prompt 7 tokens, so it goes; with max_seq_len 8 the answers then share the 4 tokens left (chosen
    ``int(3 / 5 * 4) = 2``):

    >>> fit_segments([1], [[40, 41, 2]], [5, 6, 7], [[8, 9, 2], [10, 2]], 9, 4)
    ([1, 5, 6, 7], [[8, 9, 2], [10, 2]], {'dropped_rounds': 1, 'truncated_prompt': False, 'truncated_response': False})
    >>> fit_segments([1], [[40, 41, 2]], [5, 6, 7], [[8, 9, 2], [10, 2]], 8, 4)[1]
    [[8, 9], [10, 2]]
    >>> fit_segments([1], [[40, 41, 2]], [5, 6, 7], [[8, 9, 2]], 10, 4, bound_history=False)[0]
    [1, 40, 41, 2, 5, 6, 7]
    """
    cap = min(max_prompt_len, max_seq_len - len(answers))
    if cap < 1:
        raise ValueError(f"max_seq_len={max_seq_len} leaves no room for a prompt and {len(answers)} answer(s)")
    need = sum(len(a) for a in answers)
    hist = [list(h) for h in history]
    info = {"dropped_rounds": 0, "truncated_prompt": False, "truncated_response": False}
    if not bound_history and len(prefix) + len(last) > cap:  # the last prompt first: history does not count
        head = cut_prompt(prefix, last, cap)
        info["truncated_prompt"] = True
        prefix, last = (head[: len(prefix)], head[len(prefix) :]) if cap > len(prefix) else ([], head)

    def prompt_len():
        return len(prefix) + sum(len(h) for h in hist) + len(last)

    while hist and ((bound_history and prompt_len() > cap) or prompt_len() + need > max_seq_len):
        hist.pop(0)  # the oldest round first
        info["dropped_rounds"] += 1
    prompt = list(prefix) + [t for h in hist for t in h] + list(last)
    if len(prompt) > cap and bound_history:  # only when no history is left
        prompt = cut_prompt(prefix, last, cap)
        info["truncated_prompt"] = True
    out = share_answers(answers, max_seq_len - len(prompt))
    info["truncated_response"] = [len(a) for a in out] != [len(a) for a in answers]
    return prompt, out, info
