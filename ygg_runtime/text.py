"""Text in and out: the artifact's tokenizer.json, the chat template frozen at compile time, and
incremental detokenisation for streaming."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextCodec:
    def __init__(self, tokenizer_file: Path, chat_prefix: str | None, chat_suffix: str | None):
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.chat_prefix, self.chat_suffix = chat_prefix, chat_suffix

    @property
    def has_chat_template(self) -> bool:
        return self.chat_prefix is not None

    def prefix_ids(self) -> list[int]:
        """The chat template's tokens before the user's text (its system turn): the prefix every
        chat prompt shares, whose KV rows a decoder computes once (`runner.PrefixCache`)."""
        if not self.has_chat_template or not self.chat_prefix:
            return []
        return self.tokenizer.encode(self.chat_prefix, add_special_tokens=False).ids

    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids of a user prompt, wrapped in the model's chat template unless raw. The
        template already holds any special tokens, so the tokenizer adds none of its own."""
        if raw or not self.has_chat_template:
            return self.tokenizer.encode(prompt).ids
        text = f"{self.chat_prefix}{prompt}{self.chat_suffix}"
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class StreamDecoder:
    """Turns token ids arriving in bursts into printable text deltas, holding back a trailing
    partial UTF-8 character until the token that completes it arrives."""

    def __init__(self, codec: TextCodec):
        self.codec, self.ids, self.emitted = codec, [], 0

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[self.emitted :], len(text)
        return delta

    def finish(self) -> str:
        """Whatever is still held back once generation has ended (an unfinished character)."""
        return self.codec.decode(self.ids)[self.emitted :]
