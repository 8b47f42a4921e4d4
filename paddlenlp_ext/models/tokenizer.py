"""Loading a model directory's tokenizer, including one given only as ``tokenizer.json``.

Owns :func:`load_tokenizer`, the one place training, DPO, the predictor and the
tools load a tokenizer.  PaddleNLP 3.0.0b4's ``AutoTokenizer`` picks the slow
(python) class named by ``tokenizer_config.json``'s ``tokenizer_class`` unless
``use_fast=True``, and its slow Qwen2/Llama classes need ``vocab.json`` +
``merges.txt`` or a SentencePiece file.  Checkpoints from the Hugging Face hub
(Qwen2/2.5/3, Llama 3) ship only ``tokenizer.json`` (a ``tokenizers`` byte-level
BPE), so for a directory with ``tokenizer.json`` and none of those files the fast
class is used: PaddleNLP's ``PretrainedTokenizerFast`` family, which runs the
``tokenizers`` library on ``tokenizer.json`` and reads the special tokens (bos,
eos, pad, added tokens) from ``tokenizer_config.json`` / ``special_tokens_map.json``
as transformers does.  ``tokenizer_class: "PreTrainedTokenizerFast"`` (transformers'
spelling, as Llama 3 ships) is PaddleNLP's ``PretrainedTokenizerFast``.
"""

from __future__ import annotations

import os
from typing import Any, Dict

FAST_FILE = "tokenizer.json"
#: files a slow (python) tokenizer reads its vocabulary from; none present -> the fast path
SLOW_FILES = (
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.txt",
    "ice_text.model",
    "qwen.tiktoken",
)
#: transformers' generic fast class -> PaddleNLP's spelling of it (transformers 5.x saves it as "TokenizersBackend")
GENERIC_FAST = ("PreTrainedTokenizerFast", "PretrainedTokenizerFast", "TokenizersBackend")


class TokenizerLoadError(ValueError):
    """A tokenizer directory that cannot be loaded; the message names the file/key and what to do."""


def uses_fast_file(path: str) -> bool:
    """Whether ``path`` is a directory whose tokenizer exists only as ``tokenizer.json``."""
    return (
        os.path.isdir(path)
        and os.path.isfile(os.path.join(path, FAST_FILE))
        and not any(os.path.isfile(os.path.join(path, f)) for f in SLOW_FILES)
    )


def _tokenizer_config(path: str) -> Dict[str, Any]:
    from .hf_layout import read_json_dict

    return read_json_dict(os.path.join(path, "tokenizer_config.json"), TokenizerLoadError)


def load_tokenizer(path: str):
    """The tokenizer of ``path`` (a PaddleNLP tokenizer object: encode/decode, special tokens, chat templates).

    Raises :class:`TokenizerLoadError` for a ``tokenizer.json``-only directory whose
    ``tokenizer_class`` has no fast class in PaddleNLP (naming the key and file).
    """
    from paddlenlp.transformers import AutoTokenizer

    if not uses_fast_file(path):
        return _slow_tokenizer(AutoTokenizer, path)
    tok_cfg = _tokenizer_config(path)
    cls_name = tok_cfg.get("tokenizer_class")
    if cls_name in GENERIC_FAST:
        from paddlenlp.transformers.tokenizer_utils_fast import PretrainedTokenizerFast

        return _with_extra_special_tokens(PretrainedTokenizerFast.from_pretrained(path), tok_cfg, path)
    try:
        tok = AutoTokenizer.from_pretrained(path, use_fast=True)
    except TypeError as e:  # a slow class was chosen and wants its vocabulary files
        raise TokenizerLoadError(
            f"{os.path.join(path, 'tokenizer_config.json')}: tokenizer_class={cls_name!r} has no fast (tokenizer.json) "
            f"class in PaddleNLP, and {path} has none of the files its slow class reads ({', '.join(SLOW_FILES)}): "
            f'set tokenizer_class to "PreTrainedTokenizerFast" ({type(e).__name__}: {e})'
        ) from e
    return _with_extra_special_tokens(tok, tok_cfg, path)


def _slow_tokenizer(auto, path: str):
    """The slow (python) tokenizer of ``path``.  transformers saves a SentencePiece vocabulary as
    ``tokenizer.model``, while PaddleNLP's classes look for their own file name (LlamaTokenizer:
    ``sentencepiece.bpe.model``) and fail with ``missing ... 'vocab_file'``: name the file for them."""
    try:
        return auto.from_pretrained(path)
    except TypeError as e:
        spm = os.path.join(path, "tokenizer.model")
        if "vocab_file" not in str(e):
            raise
        if not os.path.isfile(spm):
            raise TokenizerLoadError(
                f"{path}: the tokenizer class of tokenizer_config.json needs a vocabulary file and the directory has "
                f"none it reads ({', '.join(SLOW_FILES)}, or tokenizer.json): copy the tokenizer files of the base "
                f"model here ({type(e).__name__}: {e})"
            ) from e
        return auto.from_pretrained(path, vocab_file=spm)


def _with_extra_special_tokens(tok, tok_cfg: Dict[str, Any], path: str):
    """transformers 5.x saves the additional special tokens as a list under ``extra_special_tokens``
    (4.x: ``additional_special_tokens``), which PaddleNLP does not read: register them as additional
    special tokens.  They are already in tokenizer.json's added tokens, so no id changes (checked)."""
    extra = tok_cfg.get("extra_special_tokens")
    if not isinstance(extra, list) or not extra:
        return tok
    names = [t.get("content") if isinstance(t, dict) else t for t in extra]
    missing = [t for t in names if t not in tok.all_special_tokens]
    if not missing:
        return tok
    size = len(tok)
    tok.add_special_tokens({"additional_special_tokens": list(tok.additional_special_tokens) + missing})
    if len(tok) != size:
        raise TokenizerLoadError(
            f"{os.path.join(path, 'tokenizer_config.json')}: extra_special_tokens {missing} are "
            f"not in {FAST_FILE}'s vocabulary; add them there or remove them from the list"
        )
    return tok
