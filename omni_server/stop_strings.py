"""Stop strings over incrementally decoded tokens: the api cuts the client's text with them, and
an AR stage what it forwards (the same decoding, so both cut at the same token)."""

from __future__ import annotations

import functools

from tokenizers.decoders import DecodeStream

_UNSET = float("inf")  # end of a token holding part of a character not yet complete


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
        self._ends: list[float] = []  # where each token's text ends in `text`
        self._partial: list[int] = []  # tokens holding the bytes of a character not yet complete
        # Once stopped: how many tokens lie wholly before the stop string (what later stages read).
        self.kept = 0
        # Tokens whose text is all emitted: no stop string can start in them (at most `kept`).
        self.clear = 0

    def push(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text that can be shown now."""
        for tid in token_ids:
            if self.stopped:
                break
            piece = self._stream.step(self._backend, tid)
            if not piece and tid not in _special_ids(self._backend):
                # Part of a character split over byte tokens: it ends where that character does.
                self._partial.append(len(self._ends))
                self._ends.append(_UNSET)
                continue
            self.text += piece or ""
            self._ends.append(len(self.text))
            if piece:
                for i in self._partial:
                    self._ends[i] = len(self.text)
                self._partial.clear()
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
        while self.clear < len(self._ends) and self._ends[self.clear] <= self._emitted:
            self.clear += 1
        return out


@functools.lru_cache(maxsize=4)
def _special_ids(backend) -> frozenset[int]:
    """A tokenizer's special tokens (skipped in the text: an empty piece, but no part of a
    character); found once per tokenizer, not per request."""
    added = backend.get_added_tokens_decoder() if backend is not None else {}
    return frozenset(i for i, t in added.items() if t.special)
