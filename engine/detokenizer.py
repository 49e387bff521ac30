"""Incremental detokenization and stop-string matching for one request.

Byte-level BPE vocabularies take a fast path: each token's bytes come from a table and one
incremental UTF-8 decoder buffers a character split across tokens until it is complete. Any
other tokenizer: text is decoded over a sliding window of token ids (prefix offset .. end), and
the text from `read_offset` on is only released once it decodes without a trailing U+FFFD.
Either way a multi-byte character never shows up half-made. Released text then passes a stop-string
filter that holds back any tail which could still grow into a stop string, so streamed deltas
never contain (a piece of) a stop string that later matches.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any, Protocol

# Prompt tokens decoded in front of the first output token, so tokenizers that decide on a
# leading space by context (SentencePiece) render the first output token as they would in a
# full decode.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character (the public scheme)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@dataclass(frozen=True)
class ByteLevelTable:
    """The raw bytes of each token of a byte-level BPE vocabulary (GPT-2, Llama 3, Qwen, SmolLM2).

    With it a token decodes by table lookup and an incremental UTF-8 decoder buffers split
    characters exactly, instead of re-decoding a window of tokens twice per token.
    """

    pieces: list[bytes]
    special: frozenset[int]

    @classmethod
    def build(cls, tokenizer: Any) -> ByteLevelTable | None:
        """The table, or None when the tokenizer does not decode byte-level (e.g. SentencePiece)."""
        backend = getattr(tokenizer, "backend", tokenizer)
        if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
            return None
        try:
            vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
            added = backend.get_added_tokens_decoder()
        except (AttributeError, TypeError):
            return None
        char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        pieces = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, tid in vocab.items():
            try:
                pieces[tid] = bytes(char_to_byte[c] for c in token)
            except KeyError:  # like `tokenizers`: a token outside the alphabet stands for itself
                pieces[tid] = token.encode()
        special = frozenset(tid for tid, tok in added.items() if tok.special)
        return cls(pieces, special)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | str | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        byte_table: ByteLevelTable | None = None,
    ) -> None:
        self._tok = tokenizer
        self._table = byte_table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if byte_table is not None else None
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        if isinstance(stop, str):  # vLLM accepts one stop string as well as a list
            stop = [stop]
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
        self._num_tokens += 1
        if self._utf8 is not None:
            return self._add_byte_level(token_id)
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # an incomplete character, or a token that renders as nothing yet
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._append(delta)

    def _add_byte_level(self, token_id: int) -> str:
        table = self._table
        assert table is not None and self._utf8 is not None
        if self._skip and token_id in table.special:
            return ""
        piece = table.pieces[token_id] if 0 <= token_id < len(table.pieces) else b""
        # Holds back an incomplete UTF-8 sequence until the bytes that finish it arrive.
        delta = self._utf8.decode(piece)
        return self._append(delta) if delta else ""

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
        if self.stop_string is None and self._utf8 is not None:
            tail = self._utf8.decode(b"", final=True)
            if tail:
                out = self._append(tail)
        elif self.stop_string is None and self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            if len(new_text) > len(prefix_text):
                self._prefix_offset = self._read_offset = len(self._ids)
                out = self._append(new_text[len(prefix_text) :])
        return out + self._release(len(self.text))

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]
