"""Speculative decoding, n-gram (prompt lookup) or draft-model proposals: see docs/engine.md.

- config.py: `SpeculativeConfig`, parsed from --speculative-config's JSON;
- ngram.py: the n-gram proposer (draft tokens from earlier occurrences of the sequence's suffix);
- draft_model.py: the draft-model proposer (a smaller model on its own paged KV cache; torch,
  so imported only by the engine that needs it);
- verify.py: acceptance (greedy match, rejection sampling for a point-mass draft);
- adaptive.py: how many drafts a request takes each step (its acceptance, the step cost).

The scheduler proposes (n-gram inline per request; a draft model once per step for all decoding
requests) and schedules [last token, drafts] as one small chunk; the runner verifies and
returns the accepted tokens plus one of its own.
"""

from kvgate.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from kvgate.engine.spec_decode.ngram import propose_ngram

__all__ = ["SpeculativeConfig", "SpeculativeConfigError", "propose_ngram"]
