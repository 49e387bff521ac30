"""The engine's side of structured outputs: one grammar compiler per engine (built on first
use, so engines that never see a constraint never load the grammar library), a matcher per
constrained request, and each step's token bitmask.

Matchers live on their `Request` and advance in `Scheduler.update` with every sampled token,
so preemption by recompute keeps them right (the recomputed tokens were accepted already).
Speculative drafts never advance them: the scheduler keeps the drafts the grammar allows
(`GrammarMatcher.valid_drafts`), `prepare` gives each draft position its own mask, and only the
tokens verification emits are accepted into the matcher.
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
        """Fill the batch's token bitmask for the constrained seqs that sample this step.

        A seq with speculative drafts (which the scheduler checked against its grammar) gets
        1 + len(drafts) consecutive rows from its `bitmask_rows` entry: the mask for its next
        token, then the mask after each draft, so position i is verified exactly as plain
        decoding would sample it once the drafts before it were accepted."""
        constrained: list[tuple[str, GrammarMatcher, list[int]]] = []
        for seq in batch.seqs:
            if not seq.sample:
                continue
            request = requests.get(seq.request_id)
            if request is not None and request.grammar is not None:
                constrained.append((seq.request_id, request.grammar, seq.draft_token_ids))
        if not constrained:
            return
        matchers = [m for _, m, _ in constrained]
        if any(d for _, _, d in constrained):
            batch.token_bitmask = self.compiler.fill_bitmask(matchers, [d for _, _, d in constrained])
        else:
            batch.token_bitmask = self.compiler.fill_bitmask(matchers)
        rows: dict[str, int] = {}
        row = 0
        for rid, _, drafts in constrained:
            rows[rid] = row
            row += 1 + len(drafts)
        batch.bitmask_rows = rows
