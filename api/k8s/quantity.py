"""Kubernetes resource quantities (`16Gi`, `500M`, `1e9`, `1048576`) as exact byte counts.

The operator reads them where a spec gives a memory size (spec.kvOffload.size) and adds them to
a container's memory request and limit, so the arithmetic is exact (Decimal), as the API
server's own is.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# The API server's quantity syntax: a signed decimal number, then a binary (Ki ... Ei) or a
# decimal SI (n u m k M G T P E) suffix, or a decimal exponent.
QUANTITY_RE = re.compile(
    r"^(?P<number>[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$"
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
GIB = 1 << 30


def parse_quantity(value: int | str) -> Decimal:
    """A quantity's exact value (bytes, for a memory size). ValueError: not a quantity."""
    if isinstance(value, int):
        return Decimal(value)
    match = QUANTITY_RE.match(value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 16Gi, 512Mi, 20G)")
    try:
        number = Decimal(match.group("number"))
    except InvalidOperation:  # pragma: no cover - the pattern admits only numbers
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from None
    suffix = match.group("suffix") or ""
    if suffix in _BINARY:
        return number * (1 << (10 * _BINARY[suffix]))
    if suffix in _DECIMAL:
        return number.scaleb(_DECIMAL[suffix])
    return number.scaleb(int(suffix[1:]))


def format_bytes(count: int) -> str:
    """A byte count as a quantity: the largest binary, then decimal, suffix that divides it exactly."""
    if count <= 0:
        return str(count)
    for suffix, power in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
        if count % (1 << (10 * power)) == 0:
            return f"{count >> (10 * power)}{suffix}"
    for suffix, exp in sorted(_DECIMAL.items(), key=lambda kv: -kv[1]):
        if exp > 0 and count % 10**exp == 0:
            return f"{count // 10**exp}{suffix}"
    return str(count)


def memory_bytes(value: int | str) -> int:
    """A memory quantity in whole bytes (a fraction of a byte rounds up, as the API server does)."""
    exact = parse_quantity(value)
    whole = int(exact)
    return whole + 1 if exact > whole else whole
