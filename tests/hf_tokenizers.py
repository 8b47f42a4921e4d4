"""Byte-level BPE tokenizers given only as tokenizer.json (+ tokenizer_config.json), trained here with the
``tokenizers`` library in a Qwen2-style and a Llama-3-style flavour and saved by transformers: the files
the hub ships.  Shared by tests/test_hf_tokenizer.py and tests/test_predict_template.py."""

import json
import os

from conftest import DATA_DIR

CHINESE = [
    "你好，世界！今天天气很好。",
    "机器学习是人工智能的一个分支，深度学习又是机器学习的一部分。",
    "我们一起去公园散步吧：春天来了，花都开了。",
    "混合 English 和中文 123，还有 emoji 😀 和标点「」。",
]
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


def local_texts():
    out = []
    for split in ("train.json", "dev.json"):
        with open(os.path.join(DATA_DIR, split), encoding="utf-8") as f:
            for line in f:
                ex = json.loads(line)
                out += [ex["src"], ex["tgt"]]
    return out + CHINESE * 3


def build(out_dir, style):
    """A byte-level BPE saved as tokenizer.json + tokenizer_config.json (+ special_tokens_map.json)."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=(style == "llama3")))
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    split = QWEN2_SPLIT if style == "qwen2" else LLAMA3_SPLIT
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        if style == "qwen2"
        else ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials if style == "qwen2" else [],
    )
    tok.train_from_iterator(local_texts(), trainer)
    if style == "qwen2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        kw = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    else:
        tok.add_special_tokens(specials)  # after the vocabulary, as Llama 3's reserved ids
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single="<|begin_of_text|> $A",
                    pair="<|begin_of_text|> $A $B:1",
                    special_tokens=[("<|begin_of_text|>", bos)],
                ),
            ]
        )
        kw = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kw).save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    cfg = json.load(open(path))
    cfg["tokenizer_class"] = "Qwen2Tokenizer" if style == "qwen2" else "PreTrainedTokenizerFast"
    json.dump(cfg, open(path, "w"))
    assert not {"vocab.json", "merges.txt", "tokenizer.model"} & set(os.listdir(out_dir))
    return out_dir
