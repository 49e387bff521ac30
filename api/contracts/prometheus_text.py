"""Prometheus' text exposition format, read: the one parser the EPP's scraper, the operator's
External Metrics API and the bench share.

Deliberately small: the series read are plain counters, gauges and info metrics, one sample a
line (`name{labels} value [timestamp]`); comments, blank and malformed lines are skipped, and a
value that is not a number drops its line.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(
    text: str, names: Collection[str] | None = None, prefixes: tuple[str, ...] = ()
) -> Iterator[tuple[str, str, float]]:
    """(name, raw label text, value) of each sample; only those `names` holds, and only lines
    starting with one of `prefixes` are parsed at all (a cheap filter on a long exposition)."""
    for line in text.splitlines():
        if prefixes and not line.startswith(prefixes):
            continue
        match = _SAMPLE.match(line)
        if match is None or (names is not None and match.group(1) not in names):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        yield match.group(1), match.group(2) or "", value


def labels(raw: str) -> dict[str, str]:
    """A sample's label text as a dict (values as written, escapes kept)."""
    return dict(_LABEL.findall(raw))


def summed(text: str) -> dict[str, float]:
    """Each sample name's values summed over its label sets."""
    sums: dict[str, float] = {}
    for name, _, value in samples(text):
        sums[name] = sums.get(name, 0.0) + value
    return sums
