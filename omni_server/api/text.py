"""Text in and out of the pipeline: chat template + tokenization, incremental detokenization."""

from __future__ import annotations

import functools
from typing import Any

from tokenizers.decoders import DecodeStream


class TextCodec:
    """Owns the first stage's tokenizer (loaded once; the api process never loads weights)."""

    def __init__(self, path: str, chat_template: str | None = None):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if chat_template is not None:  # (server.chat_template: the deployment's own)
            self.tokenizer.chat_template = chat_template
        elif getattr(self.tokenizer, "chat_template", None) is None:
            # Some multimodal checkpoints keep the template with the processor only.
            from transformers import AutoProcessor

            self.tokenizer.chat_template = AutoProcessor.from_pretrained(path).chat_template
        self._backend = self.tokenizer.backend_tokenizer  # a `tokenizers.Tokenizer`
        # Token id -> text, for logprobs (up to 21 per output token); at most the vocabulary.
        self._token_texts: dict[int, str] = {}
        # Byte-level BPE (Qwen's) spells a token's bytes as characters: this maps them back
        # (token id -> bytes, cached like the texts).
        self._byte_of = {c: b for b, c in _bytes_to_chars().items()}
        self._special = set(self.tokenizer.all_special_ids)
        self._token_bytes: dict[int, bytes] = {}

    @functools.cached_property
    def writes_tools(self) -> bool:
        """Whether the chat template writes `tools` into the prompt (some ignore them), found once."""
        turn = [{"role": "user", "content": "?"}]
        probe = [{"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}]
        return self.render_chat(turn, probe) != self.render_chat(turn)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def token_text(self, token_id: int) -> str:
        """One token's text (a byte-level piece of a longer character reads as U+FFFD)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (part of a character's UTF-8 for a piece of one; a special token's
        text as UTF-8)."""
        out = self._token_bytes.get(token_id)
        if out is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None and token_id not in self._special and all(c in self._byte_of for c in piece):
                out = bytes(self._byte_of[c] for c in piece)
            else:
                out = self.token_text(token_id).encode()
            self._token_bytes[token_id] = out
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def detokenizer(self, stop: list[str]) -> "Detokenizer":
        return Detokenizer(self._backend, stop)

    def offsets(self, start: int = 0) -> "Offsets":
        return Offsets(self._backend, start)


class Offsets:
    """Where each token's text starts in the decoded text (a character split over tokens starts at
    its first), counted from `start`."""

    def __init__(self, backend, start: int):
        self._backend, self._stream, self.end = backend, DecodeStream(skip_special_tokens=True), start

    def push(self, token_id: int) -> int:
        at = self.end
        self.end += len(self._stream.step(self._backend, token_id) or "")
        return at


class Detokenizer:
    """Incremental detokenization with stop strings; never emits text past a stop string or a
    possible prefix of one (held back until it is resolved)."""

    def __init__(self, backend, stop: list[str]):
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self.text = ""  # everything decoded so far
        self._emitted = 0
        self.stopped = False
        self._ends: list[int] = []  # where each token's text ends in `text`
        # Once stopped: how many tokens lie wholly before the stop string (what later stages read).
        self.kept = 0

    def push(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text that can be shown now."""
        for tid in token_ids:
            if self.stopped:
                break
            piece = self._stream.step(self._backend, tid)
            self.text += piece or ""
            self._ends.append(len(self.text))
            if piece:
                self._check_stop()
        return self._take(final=False)

    def flush(self) -> str:
        return self._take(final=True)

    def _check_stop(self) -> None:
        for s in self._stop:
            at = self.text.find(s, max(0, self._emitted - len(s)))
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                # Tokens wholly before it (one the stop starts inside is not: its speech would say
                # part of the stop string).
                self.kept = next(i for i, end in enumerate(self._ends) if end > at)

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not final and not self.stopped:
            # Hold back a tail that could still become a stop string.
            for s in self._stop:
                for k in range(min(len(s) - 1, len(self.text) - self._emitted), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        out = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return out


def _bytes_to_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character BPE vocabularies spell it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}
