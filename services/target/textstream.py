"""Generated token ids -> the text a client may be sent so far, with stop strings.

Incremental detokenization is the tokenizers library's `DecodeStream`: a character split across tokens (or across
engine steps) is held until its last byte arrives, so the streamed pieces always join to the full decode. Stop
strings (OpenAI's `stop`) are found in the decoded text token by token: the token that completes one ends the
generation, the stop string and what follows it are never sent, and text that could still become a stop string is
held back until the next tokens decide.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from evospec.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def checked_stop(stop: tuple[str, ...], field: str = "stop") -> tuple[str, ...]:
    """Stop strings as given, or InvalidRequestError naming `field`: at most 16 non-empty strings of 256 chars."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(field, f"has {len(stop)} strings; at most {MAX_STOP_STRINGS} are accepted")
    for s in stop:
        if not s:
            raise InvalidRequestError(field, "contains an empty string")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequestError(field, f"has a string of {len(s)} characters; at most {MAX_STOP_CHARS}")
    return tuple(stop)


@dataclass(frozen=True)
class TextDelta:
    """What `TextStream.feed` released: the ids consumed (up to the one that completed a stop string) and the text
    that is final."""
    token_ids: list[int]
    text: str
    stopped: bool


class TextStream:
    """One generation's detokenizer. `feed(ids)` per engine step, `finish()` once when the generation ends."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizer DecodeStream steps with
        self._decoder = DecodeStream(skip_special_tokens=False)
        self._stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._text = ""  # decoded so far (stop string excluded once found)
        self._sent = 0  # characters of _text already released
        self._undecoded: list[int] = []  # ids whose bytes do not form a whole character yet
        self.stopped = False

    def feed(self, token_ids: list[int]) -> TextDelta:
        consumed = []
        for token_id in token_ids:
            if self.stopped:
                break
            consumed.append(token_id)
            self._step(token_id)
        return TextDelta(consumed, self._release(self._safe_end()), self.stopped)

    def finish(self) -> str:
        """The rest of the text: held-back characters, and the bytes of an unfinished character (as U+FFFD)."""
        if self._undecoded and not self.stopped:
            self._append(self._tokenizer.decode(self._undecoded))
            self._undecoded = []
        return self._release(len(self._text))

    def _step(self, token_id: int) -> None:
        piece = self._decoder.step(self._backend, token_id)
        if piece is None:
            self._undecoded.append(token_id)
            return
        self._undecoded = []
        self._append(piece)

    def _append(self, piece: str) -> None:
        searched_from = max(self._sent, len(self._text) - self._longest_stop + 1)
        self._text += piece
        found = [i for i in (self._text.find(s, searched_from) for s in self._stop) if i >= 0]
        if found:
            self._text = self._text[:min(found)]
            self.stopped = True

    def _safe_end(self) -> int:
        """How much of the text is final: all of it after a stop, else all but the longest suffix that begins a
        stop string."""
        if self.stopped or not self._stop:
            return len(self._text)
        for held in range(min(self._longest_stop - 1, len(self._text) - self._sent), 0, -1):
            tail = self._text[-held:]
            if any(s.startswith(tail) for s in self._stop):
                return len(self._text) - held
        return len(self._text)

    def _release(self, end: int) -> str:
        text, self._sent = self._text[self._sent:end], max(self._sent, end)
        return text
