"""The n-gram proposer (vLLM's prompt lookup): draft tokens copied from earlier in the sequence.

For n from `max_n` down to `min_n`: if the sequence's last n tokens occurred earlier, propose
the (up to) k tokens that followed their most recent earlier occurrence. Grounded answers
(quoting, repeating, editing a given text) make these drafts right often; a free answer seldom.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for what follows `token_ids` (prompt + output), or [] if no n-gram
    of the sequence's suffix, min_n <= n <= max_n, occurred before."""
    return propose_ngram_match(token_ids, k, min_n, max_n)[0]


def propose_ngram_match(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """`propose_ngram`'s drafts and the length n of the suffix that matched (0: none)."""
    length = len(token_ids)
    if k < 1 or length < 2:
        return [], 0
    seq = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n :]
        # Windows starting at 0 .. length - n - 1: every earlier occurrence, each followed by
        # at least one token.
        windows = sliding_window_view(seq[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist(), n
    return [], 0
