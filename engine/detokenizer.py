"""Incremental detokenization and stop-string matching for one request.

Text is decoded over a sliding window of token ids (prefix offset .. end). The text from
`read_offset` on is only released once it decodes without a trailing U+FFFD, so a multi-byte
character split across tokens never shows up half-made. Released text then passes a stop-string
filter that holds back any tail which could still grow into a stop string, so streamed deltas
never contain (a piece of) a stop string that later matches.
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens decoded in front of the first output token, so tokenizers that decide on a
# leading space by context (SentencePiece) render the first output token as they would in a
# full decode.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = [s for s in (stop or []) if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens  # stop strings only count from this many output tokens on
        self._num_tokens = 0
        self.text = ""  # decoded so far, including held-back text (minus anything past a stop)
        self._emitted = 0  # len of text already handed out
        self.stop_string: str | None = None  # set once a stop string matched

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; returns the text that may be released now."""
        if self.stop_string is not None:
            return ""
        self._ids.append(token_id)
        self._num_tokens += 1
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # an incomplete character, or a token that renders as nothing yet
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._append(delta)

    def _append(self, delta: str) -> str:
        before = len(self.text)
        self.text += delta
        if self._stops and self._num_tokens >= self._min_tokens:
            start = max(0, before - self._max_stop + 1)
            hit = -1
            for s in self._stops:
                idx = self.text.find(s, start)
                if idx >= 0 and (hit < 0 or idx < hit):
                    hit, self.stop_string = idx, s
            if hit >= 0:
                assert self.stop_string is not None
                self.text = self.text[: hit + (len(self.stop_string) if self._include_stop else 0)]
                return self._release(len(self.text))
            return self._release(len(self.text) - self._held_back())
        return self._release(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self.text
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out

    def flush(self) -> str:
        """At the end: release held-back text and any bytes still waiting on a character."""
        out = ""
        if self.stop_string is None and self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            if len(new_text) > len(prefix_text):
                self._prefix_offset = self._read_offset = len(self._ids)
                out = self._append(new_text[len(prefix_text) :])
        return out + self._release(len(self.text))

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]
