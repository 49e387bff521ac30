"""The engine's side of structured outputs: one grammar compiler per engine (built on first
use, so engines that never see a constraint never load the grammar library), a matcher per
constrained request, and each step's token bitmask.

Matchers live on their `Request` and advance in `Scheduler.update` with every sampled token,
so preemption by recompute keeps them right (the recomputed tokens were accepted already).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvgate.engine.core.runner_api import ScheduledBatch
from kvgate.engine.structured.spec import StructuredOutputError, StructuredOutputSpec

if TYPE_CHECKING:
    from kvgate.engine.core.request import Request
    from kvgate.engine.structured.grammar import GrammarCompiler, GrammarMatcher


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise StructuredOutputError(
                        "Structured outputs need the model's tokenizer, and this engine has none."
                    )
                from kvgate.engine.structured.grammar import GrammarCompiler

                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size)
            return self._compiler

    def compile(self, spec: StructuredOutputSpec) -> None:
        """Compile (and cache) a spec; StructuredOutputError when it cannot be used. Safe to
        call from any thread: servers call it off their event loop before submitting."""
        self.compiler.compile(spec)

    def matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        return self.compiler.matcher(spec)

    def prepare(self, batch: ScheduledBatch, requests: Mapping[str, Request]) -> None:
        """Fill the batch's token bitmask for the constrained seqs that sample this step."""
        constrained: list[tuple[str, GrammarMatcher]] = []
        for seq in batch.seqs:
            if not seq.sample:
                continue
            request = requests.get(seq.request_id)
            if request is not None and request.grammar is not None:
                constrained.append((seq.request_id, request.grammar))
        if not constrained:
            return
        batch.token_bitmask = self.compiler.fill_bitmask([m for _, m in constrained])
        batch.bitmask_rows = {rid: row for row, (rid, _) in enumerate(constrained)}
