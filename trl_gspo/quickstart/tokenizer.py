"""A tiny character-level tokenizer built offline with the `tokenizers` library.

Every character of the fixed alphabet below is one token; anything else maps to ``<unk>``.
The tokenizer prepends ``<bos>`` to every encoded text (so prompts and SFT sequences start the
same way), pads on the left (GRPO generation needs left padding) and decodes by simply
concatenating characters, so ``decode(encode(s)) == s`` for any string over the alphabet.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

#: The characters the tokenizer knows, one token each (after the special tokens).
ALPHABET = "0123456789" + "abcdefghijklmnopqrstuvwxyz" + " +-*=:,.?>"


def build_tokenizer(model_max_length: int = 128) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer (ids 0-3 are ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in ALPHABET:
        vocab[ch] = len(vocab)

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Split every character into its own "word"; special tokens such as "<eos>" written in the
    # text are matched before pre-tokenization because they are registered as added tokens.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )

    return wrap_backend(backend, model_max_length)


def wrap_backend(backend: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """A `tokenizers` backend as a transformers tokenizer with this module's special tokens, padding and truncation on
    the left (GRPO generation needs left padding)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        truncation_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
