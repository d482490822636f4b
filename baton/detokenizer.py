"""Incremental detokenization with stop strings.

Decoding the whole output after every token costs O(tokens) per step. Instead, the detokenizer decodes a
small window of token ids: ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``, where
``[prefix_offset, read_offset)`` are tokens whose text was already emitted and kept only as context, and
``ids[read_offset:]`` are the new ones. The new text is the difference of the two decodes. Decoding the
new tokens together with a little context gives them the same text they have in a full decode (for
example the leading space of a byte-level BPE or sentencepiece token, which a decoder may strip at the
start of a string), so the concatenation of everything emitted equals ``tokenizer.decode(output ids)``.

UTF-8 safety: a token may end in the middle of a multi-byte character; the decoded text then ends in
U+FFFD. Trailing U+FFFD characters are held back (and the window is not advanced) until a later token
completes the character. The window only ever starts where the decoded text ended in a complete
character, which is a point where UTF-8 decoding resynchronizes, so the window decodes exactly as the same
tokens do inside the full output.

Stop strings: text that could still be the start of a stop string is held back (only the longest suffix of
the pending text that is a proper prefix of some stop string, so at most ``len(longest stop) - 1``
characters). When a stop string appears, the text before it is emitted and the detokenizer stops; the stop
string and anything after it are never emitted. If several stop strings occur, the one that ends first
wins (ties: the one that starts first), which is what a character-by-character stream would see first, so
the result does not depend on how the tokens were chunked.

Prompt tokens are not used as decode context: the reference text is ``decode(output ids)``, and a
sentencepiece decoder would give the first output token a leading space with the prompt in front that
``decode(output ids)`` does not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["DetokenizerFinishedError", "IncrementalDetokenizer", "Tokenizer"]

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class DetokenizerFinishedError(RuntimeError):
    """add() was called after a stop string matched or after flush()."""


class IncrementalDetokenizer:
    """Turns the token ids of one request, fed as they are generated, into text safe to stream."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single string; wrap it in a tuple")
        for item in stop:
            if not isinstance(item, str) or not item:
                raise ValueError(f"stop strings must be non-empty strings, got {item!r}")
        self._tokenizer = tokenizer
        self._prompt_token_ids = tuple(prompt_token_ids)
        self._stop = tuple(stop)
        self._skip_special_tokens = skip_special_tokens
        # Output token ids; [prefix_offset, read_offset) is context already emitted, [read_offset:] is new.
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # Characters of the new tokens' text (after read_offset) already passed on while its tail was an
        # incomplete character.
        self._sent_in_window = 0
        # Complete text withheld because it may be the start of a stop string.
        self._held = ""
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self._stop_reason: str | None = None
        self._finished = False

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self._prompt_token_ids

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
        return self._text_cache

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended generation, or None."""
        return self._stop_reason

    @property
    def finished(self) -> bool:
        """True once a stop string matched or flush() was called; add() then raises."""
        return self._finished

    def add(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Feeds newly generated tokens. Returns (text safe to emit now, whether a stop string matched)."""
        if self._finished:
            reason = "a stop string matched" if self._stop_reason is not None else "flush() was called"
            raise DetokenizerFinishedError(f"add() called after {reason}; this request's output is complete")
        if not token_ids:
            return "", False
        self._ids.extend(token_ids)
        return self._process(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """Ends the stream (length limit or EOS) and returns everything still held back.

        This includes an incomplete character at the very end, as the U+FFFD that ``decode`` shows for it,
        so the emitted text always equals ``decode(output ids)``. A stop string can still match in the
        flushed text. Calling flush() again, or after a stop, returns "".
        """
        if self._finished:
            return ""
        text, _ = self._process(self._decode_new(final=True), final=True)
        self._finished = True
        return text

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, *, final: bool) -> str:
        """Text of the new tokens not yet passed on: up to the last complete character, or all if final."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        if len(full_text) <= len(prefix_text):
            return ""  # the new tokens decode to nothing (e.g. skipped special tokens) yet
        new_text = full_text[len(prefix_text) :]
        if final or not new_text.endswith(REPLACEMENT_CHAR):
            # Complete: move the window so that the new tokens become the context of the next ones.
            out = new_text[self._sent_in_window :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._sent_in_window = 0
            return out
        # Ends in an incomplete character: pass on only what precedes it and keep the window where it is.
        safe = new_text.rstrip(REPLACEMENT_CHAR)
        out = safe[self._sent_in_window :]
        self._sent_in_window = max(self._sent_in_window, len(safe))
        return out

    def _process(self, new_text: str, *, final: bool) -> tuple[str, bool]:
        """Runs the stop-string check over held + new text; returns (text to emit, stopped)."""
        if not self._stop:
            return self._emit(new_text), False
        if not new_text and not final:
            return "", False
        pending = self._held + new_text
        match = self._find_stop(pending)
        if match is not None:
            start, stop = match
            self._held = ""
            self._stop_reason = stop
            self._finished = True
            return self._emit(pending[:start]), True
        keep = 0 if final else self._stop_prefix_length(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return self._emit(pending[: len(pending) - keep]), False

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string occurrence that ends first (ties: starts first) as (start, stop), or None."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        return best[1], best[2]

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = min(len(text), max(len(stop) for stop in self._stop) - 1)
        for length in range(longest, 0, -1):
            suffix = text[len(text) - length :]
            if any(len(stop) > length and stop.startswith(suffix) for stop in self._stop):
                return length
        return 0

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
            self._text_cache = None
        return text
