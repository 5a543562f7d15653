"""Byte-level BPE tokenizer of the embedded models, trained with `tokenizers`.

`train_tokenizer(texts, vocab_size)` returns a `PreTrainedTokenizerFast`; `save_pretrained(dir)`
writes `tokenizer.json` so that `AutoTokenizer.from_pretrained(dir)` loads it. Byte-level means
every string round-trips exactly (no unknown token).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|endoftext|>", "<|pad|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with BOS/EOS/PAD special tokens on `texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, BOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
