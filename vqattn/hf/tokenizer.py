"""``VQAttnByteTokenizer``: the vocabulary of every vqattn language model, the 256 byte values.

Text is encoded as UTF-8 and each byte is one token, id = byte value (what ``vqattn.train.data`` feeds the
trainer; there are no merges and no vocabulary file). Token strings are the Latin-1 characters chr(id), so a
token's string is exactly one byte. Decoding joins the bytes and decodes them as UTF-8, replacing invalid
sequences (a sampled byte string need not be valid UTF-8).

The corpora have no document marker, so the special tokens (bos = eos = pad) are the NUL byte, id 0, which no
text corpus contains: ``generate`` then never stops on a text byte, lm-evaluation-harness's rolling
log-likelihood puts NUL before a document's first byte (one token of context the model never trained on), and
no text byte is ever dropped by ``decode(skip_special_tokens=True)``. No special token is added when encoding.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizer

NUM_BYTES = 256
NUL = "\x00"


class VQAttnByteTokenizer(PreTrainedTokenizer):
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, bos_token=NUL, eos_token=NUL, pad_token=NUL, **kwargs):
        super().__init__(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return NUM_BYTES

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(NUM_BYTES)}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        if len(token) != 1 or ord(token) >= NUM_BYTES:
            raise ValueError(f"{token!r} is not a byte token (one character of code point < {NUM_BYTES})")
        return ord(token)

    def _convert_id_to_token(self, index: int) -> str:
        return chr(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(ord(t) for t in tokens).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return ()  # the vocabulary is the byte values: nothing to write
