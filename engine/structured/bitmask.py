"""Token bitmasks (the layout llguidance and xgrammar fill): int32 words, bit t % 32 of word
t // 32 set when token t is allowed. Torch only, so samplers need no grammar library."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size] from an int32 [rows, words] bitmask, on the bitmask's device."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [rows, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The allowed token ids of one int32 [words] bitmask row, ascending."""
    return unpack_bitmask(bitmask_row[None, :], vocab_size)[0].nonzero().flatten().tolist()
