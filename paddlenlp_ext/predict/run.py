"""The two ways to run the predictor: a prompt file in batches, and an interactive chat.

``predict_file`` writes ``--output_file`` as JSON lines, one per prompt in input
order: ``{"src": <as given>, "tgt": <as given, if the line had one>, "output": <answer>}``,
prints one progress line per batch (stderr) and each prompt with its answer,
shortened to a few lines (stdout).

``chat`` keeps the conversation as the multi-turn training format does (``src`` turns
and the model's earlier answers), prints the answer token by token and, with
``--output_file``, saves each answered turn as a prompt-file line + its output.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import textwrap
import time
from typing import IO, Callable, List, Optional, Sequence

from .inputs import PredictInputError, PromptRecord
from .options import PredictOptions
from .prompts import Prompt, build_prompt

SHOW_LINES, SHOW_WIDTH = 3, 100  # how much of a prompt / answer the console shows


def shorten(text: str, lines: int = SHOW_LINES, width: int = SHOW_WIDTH) -> List[str]:
    """The text wrapped at ``width`` characters, at most ``lines`` lines; " ..." marks a cut.

    >>> shorten("a\\nb\\nc\\nd", lines=2, width=10)
    ['a', 'b ...']
    >>> shorten("one two three four", lines=3, width=9)
    ['one two', 'three', 'four']
    """
    rows = [w for line in (text.splitlines() or [""]) for w in (textwrap.wrap(line, width) or [""])]
    out = rows[:lines]
    if len(rows) > lines:
        out[-1] += " ..."
    return out


def terminal_safe(text: str) -> str:
    r"""Model text as the console may show it: control characters (a weak model's NUL, BEL, BS, ESC
    sequences that move the cursor or recolour the terminal, CR, DEL, C1 codes) become visible
    escapes; newlines and tabs stay.  Files (``--output_file``) keep the exact text.

    >>> terminal_safe("ok\x00\x1b[2Jbye\x07\tx\n\x08\x7f\x9b")
    'ok\\x00\\x1b[2Jbye\\x07\tx\n\\x08\\x7f\\x9b'
    """
    return "".join(
        c if c in "\n\t" or not (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F) else f"\\x{ord(c):02x}" for c in text
    )


def show_pair(rec: PromptRecord, answer: str, write: Callable[[str], None]) -> None:
    earlier = f"[{len(rec.src) - 1} earlier turn(s)] " if len(rec.src) > 1 else ""
    for tag, text in (("> ", earlier + rec.src[-1]), ("< ", answer)):
        for i, line in enumerate(shorten(text)):
            write((tag if i == 0 else "  ") + terminal_safe(line) + "\n")


def output_row(rec: PromptRecord, answer: str) -> dict:
    row = {"src": rec.raw.get("src")}
    if rec.raw.get("tgt") is not None:
        row["tgt"] = rec.raw["tgt"]
    row["output"] = answer
    return row


def decode(tokenizer, ids: Sequence[int]) -> str:
    # PaddleNLP's predictor decodes the same way (special tokens out, spaces as the tokenizer made them)
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def build_prompts(records: Sequence[PromptRecord], tokenizer, o: PredictOptions, use_template: bool) -> List[Prompt]:
    """Every prompt's ids before the model loads; all bad prompts reported at once (file:line)."""
    from .session import prompt_template

    prompts, problems, jinja = [], [], prompt_template(o)
    for rec in records:
        try:
            prompts.append(build_prompt(rec, tokenizer, o.src_length, o.max_length, use_template, jinja))
        except PredictInputError as e:
            problems.append(str(e))
    if problems:
        raise PredictInputError("cannot build these prompts:\n  " + "\n  ".join(problems[:20]))
    return prompts


def predict_file(
    session,
    o: PredictOptions,
    records: Sequence[PromptRecord],
    prompts: Sequence[Prompt],
    out: Optional[IO] = None,
    err: Optional[IO] = None,
) -> dict:
    """Generate every prompt in batches of ``o.batch_size``; returns counts and timings.
    ``out`` / ``err`` default to sys.stdout / sys.stderr as they are at call time."""
    from .generate import generate_batch

    out, err = out or sys.stdout, err or sys.stderr
    folder = os.path.dirname(os.path.abspath(o.output_file))
    os.makedirs(folder, exist_ok=True)
    n_batches = -(-len(prompts) // o.batch_size)
    cut = sum(p.truncated for p in prompts)
    if cut:
        err.write(
            f"[predict] note: {cut} prompt(s) were truncated to --src_length {o.src_length} tokens "
            "(earlier turns dropped first, each src cut to its first src_length tokens)\n"
        )
    t_all, new_tokens = time.time(), 0
    with open(o.output_file, "w", encoding="utf-8") as f:
        for b in range(n_batches):
            t0 = time.time()
            batch = list(range(b * o.batch_size, min((b + 1) * o.batch_size, len(prompts))))
            answers = generate_batch(session.model, [prompts[i] for i in batch], o, session.eos_ids, session.pad_id)
            for i, ids in zip(batch, answers):
                text = decode(session.tokenizer, ids)
                f.write(json.dumps(output_row(records[i], text), ensure_ascii=False) + "\n")
                show_pair(records[i], text, out.write)
            f.flush()
            n = sum(len(a) for a in answers)
            new_tokens += n
            lengths = [len(prompts[i].ids) for i in batch]
            err.write(
                f"[predict] batch {b + 1}/{n_batches}: {len(batch)} prompt(s) of {min(lengths)}-{max(lengths)} "
                f"tokens, {n} new tokens in {time.time() - t0:.1f}s\n"
            )
            err.flush()
    seconds = time.time() - t_all
    err.write(
        f"[predict] wrote {len(prompts)} prediction(s) to {o.output_file} ({new_tokens} new tokens, "
        f"{new_tokens / max(seconds, 1e-9):.1f} tokens/s)\n"
    )
    return {"prompts": len(prompts), "new_tokens": new_tokens, "seconds": seconds}


CHAT_HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits"


def _read_line(stdin: IO, out: IO, prompt: str) -> Optional[str]:
    """One line of user input, None at end of input (on a terminal, input() gives line editing)."""
    if stdin is sys.stdin and stdin.isatty():
        try:
            return input(prompt)
        except EOFError:  # Ctrl-D: end the prompt's line, so the shell's prompt starts on its own
            out.write("\n")
            out.flush()
            return None
    line = stdin.readline()
    if line == "":
        return None
    out.write(prompt + line.rstrip("\n") + "\n")  # echoed: a piped session reads as a transcript
    out.flush()
    return line.rstrip("\n")


def chat(session, o: PredictOptions, stdin: Optional[IO] = None, out: Optional[IO] = None) -> int:
    """Interactive multi-turn session; returns the number of answers given.  With ``o.output_file`` every
    answered turn is saved (``chat_turn_row``).  ``stdin`` / ``out`` default to sys.stdin / sys.stdout
    as they are at call time."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    if stdin is sys.stdin and stdin.isatty():
        import readline  # noqa: F401  (importing it gives input() line editing and Up/Down history)

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    layout = (
        "the tokenizer's chat template"
        if session.use_template or session.jinja
        else "the training layout: [bos] + question + answer + eos + ..."
    )
    write(f"[chat] {session.description}\n[chat] prompts use {layout}; {CHAT_HELP}\n")
    if o.output_file:
        os.makedirs(os.path.dirname(os.path.abspath(o.output_file)), exist_ok=True)
    with open(o.output_file, "w", encoding="utf-8") if o.output_file else contextlib.nullcontext() as record:
        return _chat_loop(session, o, stdin, out, write, record)


def chat_turn_row(questions: Sequence[str], answers: Sequence[str], answer: str) -> dict:
    """One answered turn as a prompt-file line (src turns, earlier answers as tgt) + its output, so
    ``--data_file`` on the saved file replays the conversation.

    >>> chat_turn_row(["hi"], [], "yo")
    {'src': 'hi', 'output': 'yo'}
    >>> chat_turn_row(["hi", "and?"], ["yo"], "bye")
    {'src': ['hi', 'and?'], 'tgt': ['yo'], 'output': 'bye'}
    """
    if len(questions) == 1:
        return {"src": questions[0], "output": answer}
    return {"src": list(questions), "tgt": list(answers), "output": answer}


def _chat_loop(session, o: PredictOptions, stdin: IO, out: IO, write: Callable[[str], None], record) -> int:
    from .generate import TokenPrinter, generate_batch

    questions: List[str] = []
    answers: List[str] = []
    given = 0
    while True:
        line = _read_line(stdin, out, "user> ")
        if line is None or line.strip() in ("/exit", "/quit"):
            return given
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            questions, answers = [], []
            write("[chat] new conversation\n")
            continue
        rec = PromptRecord(src=questions + [text], history=list(answers), origin=f"chat turn {len(questions) + 1}")
        try:
            prompt = build_prompt(
                rec, session.tokenizer, o.src_length, o.max_length, session.use_template, session.jinja
            )
        except PredictInputError as e:  # e.g. one question longer than the whole budget: say so, keep chatting
            write(f"[chat] {e}\n")
            continue
        if prompt.dropped_rounds:
            write(f"[chat] ({prompt.dropped_rounds} earlier turn(s) left out to fit --src_length {o.src_length})\n")
        write("model> ")
        printer = TokenPrinter(session.tokenizer, session.eos_ids, lambda piece: write(terminal_safe(piece)))
        ids = generate_batch(session.model, [prompt], o, session.eos_ids, session.pad_id, streamer=printer)[0]
        answer = decode(session.tokenizer, ids)
        if record is not None:
            record.write(json.dumps(chat_turn_row(rec.src, rec.history, answer), ensure_ascii=False) + "\n")
            record.flush()
        questions.append(text)
        answers.append(answer)
        given += 1
