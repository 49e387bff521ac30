"""Files' bytes on disk under the batch directory, each written whole (temp file, fsync, rename)."""

from __future__ import annotations

import os
from pathlib import Path


class Blobs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not file_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"bad file id {file_id!r}")
        return self.root / file_id

    def write(self, file_id: str, data: bytes) -> Path:
        dest = self.path(file_id)
        tmp = dest.with_name(dest.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        return dest

    def read(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
