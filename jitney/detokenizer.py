"""Streaming token ids -> text, with stop strings.

Two things make this harder than ``decode(new_ids)``:

* A byte-level BPE token can carry part of a multi-byte UTF-8 character, and a SentencePiece-style
  decoder treats the first token of a string differently (it drops the leading space). So each
  new token is decoded inside a small window of the tokens before it, and the text it adds is the
  difference between the window decoded with and without it. While that text ends in U+FFFD (a
  character still incomplete), nothing is emitted.
* A stop string can be split across tokens. Text that could still become the start of a stop string
  is held back until the next tokens decide it; the stop string itself is never emitted (unless
  ``include_stop_str_in_output``).

The window and the held-back text are bounded by a few tokens and by the longest stop string, so
each call costs O(new tokens), independent of how long the generation already is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context for the first generated token.
_PROMPT_CONTEXT = 6
# A UTF-8 character has at most 4 bytes and every token adds at least one: a longer incomplete run
# is genuinely invalid output, which is then emitted with its replacement characters.
_MAX_PENDING_TOKENS = 4
# Drop consumed ids from the window's list once this many have piled up (keeps memory bounded).
_COMPACT_AFTER = 64


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated ids into text deltas, stopping at the first stop string.

    ``append(ids)`` returns ``(delta, stop_hit)``. When the request ends for another reason
    (length, EOS, abort), call ``flush()`` once to release the text still held back.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Sequence[int],
        stop: Iterable[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = tuple(s for s in (stop or ()) if s)
        if any(not isinstance(s, str) for s in self._stops):
            raise TypeError("stop strings must be str")
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0  # window start (context tokens)
        self._read_offset = len(self._ids)  # tokens before this are already turned into text
        self._pending = ""  # decoded text held back because it may start a stop string
        self._pieces: list[str] = []
        self._stopped = False
        self.stop_reason: str | None = None  # the stop string that ended the request

    # ------------------------------------------------------------------ public
    @property
    def text(self) -> str:
        """All text emitted so far (what the deltas add up to)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def stopped(self) -> bool:
        return self._stopped

    def append(self, token_ids: Iterable[int]) -> tuple[str, bool]:
        """Feed new token ids; return the text they release and whether a stop string was hit.

        Tokens after the one that completes a stop string are ignored, as are calls after a stop.
        """
        if self._stopped:
            return "", True
        released: list[str] = []
        for token_id in token_ids:
            new_text = self._decode_next(int(token_id))
            if not new_text:
                continue
            delta, hit = self._scan_for_stop(new_text)
            released.append(delta)
            if hit:
                break
        return self._emit("".join(released)), self._stopped

    def flush(self) -> str:
        """Release everything held back (incomplete characters, possible stop-string starts)."""
        if self._stopped:
            return ""
        tail = ""
        if len(self._ids) > self._read_offset:
            window = self._decode(self._ids[self._prefix_offset :])
            tail = window[len(self._decode(self._ids[self._prefix_offset : self._read_offset])) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        text, self._pending = self._pending + tail, ""
        return self._emit(text)

    # ------------------------------------------------------------------ decoding
    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_next(self, token_id: int) -> str:
        """The text ``token_id`` completes ('' while a character is still incomplete)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        incomplete = full.endswith(_REPLACEMENT)
        pending_tokens = len(self._ids) - self._read_offset
        if incomplete and pending_tokens < _MAX_PENDING_TOKENS:
            return ""
        new_text = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._prefix_offset > _COMPACT_AFTER:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    # ------------------------------------------------------------------ stop strings
    def _scan_for_stop(self, new_text: str) -> tuple[str, bool]:
        """Split held-back + new text into what can be released now; detect a completed stop."""
        if not self._stops:
            return new_text, False
        buffer = self._pending + new_text
        match = _first_completed_stop(buffer, self._stops)
        if match is not None:
            start, stop_string = match
            self._stopped = True
            self.stop_reason = stop_string
            self._pending = ""
            end = start + len(stop_string) if self._include_stop else start
            return buffer[:end], True
        hold = _longest_stop_prefix_suffix(buffer, self._stops, self._max_stop_len)
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text


def _first_completed_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The stop string whose occurrence in ``text`` ends first (ties: the one starting first)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        key = (start + len(stop), start, stop)
        if best is None or key[:2] < best[:2]:
            best = key
    return None if best is None else (best[1], best[2])


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str], max_len: int) -> int:
    """Length of the longest end of ``text`` that some stop string starts with (0 if none)."""
    for length in range(min(len(text), max_len - 1), 0, -1):
        tail = text[-length:]
        if any(stop.startswith(tail) for stop in stops):
            return length
    return 0
