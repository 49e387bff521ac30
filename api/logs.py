"""How every kvgate server logs: one line per record, as text or JSON (`--log-format`), at
`--log-level` (or only warnings and errors with `--quiet`), to stderr.

kvgate's own loggers follow the level; libraries (grpc, httpx, kopf, uvicorn) stay at warnings
unless kvgate itself logs at debug, so a start-up reads as what kvgate did, not its plumbing.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line; `extra=` fields (request_id, endpoint, ...) become keys."""

    _STD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._STD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str = "info", fmt: LogFormat = "text", quiet: bool = False) -> None:
    """Set up the process's logging once, at start (replaces any earlier set-up)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    own = logging.WARNING if quiet else getattr(logging, level.upper())
    libraries = logging.DEBUG if own == logging.DEBUG else logging.WARNING
    logging.basicConfig(level=libraries, handlers=[handler], force=True)
    logging.getLogger("kvgate").setLevel(own)
