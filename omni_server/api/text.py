"""Text in and out of the pipeline: chat template + tokenization, incremental detokenization."""

from __future__ import annotations

import functools
import re
import secrets
from typing import Any

from tokenizers.decoders import DecodeStream

from omni_server.stop_strings import Detokenizer


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
        # The control tokens' texts (turn markers, media placeholders): in what a client wrote they
        # are plain text, never the tokens themselves.
        self._control_id = {t.content: i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        controls = sorted(self._control_id, key=len, reverse=True)
        self._controls = re.compile("|".join(map(re.escape, controls))) if controls else None
        # A copy of the tokenizer that reads control-token text as text. Its own: the flag is the
        # tokenizer's state, and setting it per call on the shared one races other requests.
        from tokenizers import Tokenizer

        self._as_text = Tokenizer.from_str(self._backend.to_str())
        self._as_text.no_truncation()
        self._as_text.no_padding()
        self._as_text.encode_special_tokens = True

    @functools.cached_property
    def writes_tools(self) -> bool:
        """Whether the chat template writes `tools` into the prompt (some ignore them), found once."""
        turn = [{"role": "user", "content": "?"}]
        probe = [{"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}]
        return self.render_chat(turn, probe) != self.render_chat(turn)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's token ids. A control token's text in the client's strings (`<|im_end|>` in a
        message would end the turn and could open a system one; `<|IMAGE|>` would take an image's
        place) is tokenized as the plain text it is."""
        if self._controls is not None and _any_string(self._controls, (messages, tools)):
            return self._render_escaped(messages, tools)
        ids = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _render_escaped(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        # The client's control texts become marks no client can write (a fresh nonce in private-use
        # characters the template leaves alone), so the control tokens left in the rendered text are
        # the template's own. Between those, each stretch (marks back to their text) is tokenized
        # whole, as the text it is: the same tokens the stretch would get with no control text in it.
        nonce = secrets.token_hex(8)
        found: list[str] = []

        def mark(m: re.Match) -> str:
            found.append(m.group(0))
            return f"\ue000{nonce}:{len(found) - 1}\ue001"
        messages, tools = _map_strings(lambda s: self._controls.sub(mark, s), (messages, tools))
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                  tokenize=False)
        marks = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        ids: list[int] = []
        at = 0
        for m in [*self._controls.finditer(text), None]:
            stretch = marks.sub(lambda k: found[int(k.group(1))], text[at:m.start() if m else len(text)])
            ids += self.encode_as_text(stretch)
            if m:
                ids.append(self._control_id[m.group(0)])
                at = m.end()
        return ids

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of plain text in which control-token text is text too (what a client wrote)."""
        return self._as_text.encode(text, add_special_tokens=False).ids if text else []

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


def _any_string(pattern: re.Pattern, value: Any) -> bool:
    if isinstance(value, str):
        return pattern.search(value) is not None
    if isinstance(value, dict):  # (keys too: tool schemas and parsed call arguments are the client's JSON)
        return any(_any_string(pattern, k) or _any_string(pattern, v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_any_string(pattern, v) for v in value)
    return False


def _map_strings(fn, value: Any) -> Any:
    """`value` with fn applied to every string in it, dict keys included."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(fn, k): _map_strings(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(fn, v) for v in value)
    return value


class Offsets:
    """Where each token's text starts in the decoded text (a character split over tokens starts at
    its first), counted from `start`."""

    def __init__(self, backend, start: int):
        self._backend, self._stream, self.end = backend, DecodeStream(skip_special_tokens=True), start

    def push(self, token_id: int) -> int:
        at = self.end
        self.end += len(self._stream.step(self._backend, token_id) or "")
        return at


def _bytes_to_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character BPE vocabularies spell it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}
