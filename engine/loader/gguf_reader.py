"""A lean GGUF header reader.

`gguf.GGUFReader` turns every metadata array element into numpy views; for a tokenizer of 49k
tokens and 49k merges that takes seconds. Loading weights needs only the scalar metadata and
the tensor table, so this reader walks the header once with `struct`, skips the tokenizer
arrays (keeping only their length), and exposes each tensor as a zero-copy view of the
memory-mapped file that `gguf.quants.dequantize` accepts.

Format (GGUF v2/v3, little-endian): magic, version, tensor count, KV count; KV pairs; tensor
infos (name, dims fastest-first, ggml type, offset); padding to `general.alignment`; data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY_MAX = 4096  # longer arrays (vocabularies, merges) are skipped, keeping their length


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass
class SkippedArray:
    """A metadata array too long to be worth decoding here (e.g. tokenizer.ggml.tokens)."""

    length: int


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dim first)
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise GGUFFormatError(f"{path}: truncated or corrupt GGUF header ({e})") from e

    # -- header -------------------------------------------------------------------------------

    def _read(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._read("<Q")
        raw = self._map[self._pos : self._pos + length]
        if len(raw) != length:
            raise GGUFFormatError(f"{self.path}: truncated GGUF header (a string runs past the end)")
        self._pos += length
        return raw.decode("utf-8")

    def _skip_value(self, vtype: int) -> None:
        if vtype in _SCALARS:
            self._pos += struct.calcsize(_SCALARS[vtype])
        elif vtype == _STRING:
            length = self._read("<Q")  # read first: `_pos += _read()` would use the stale _pos
            self._pos += length
        elif vtype == _ARRAY:
            etype, count = self._read("<I"), self._read("<Q")
            if etype in _SCALARS:
                self._pos += struct.calcsize(_SCALARS[etype]) * count
            else:
                for _ in range(count):
                    self._skip_value(etype)
        else:
            raise GGUFFormatError(f"unknown GGUF value type {vtype}")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._read(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._read("<I"), self._read("<Q")
            if count > _KEEP_ARRAY_MAX:
                if etype in _SCALARS:
                    self._pos += struct.calcsize(_SCALARS[etype]) * count
                else:
                    for _ in range(count):
                        self._skip_value(etype)
                return SkippedArray(count)
            return [self._value(etype) for _ in range(count)]
        raise GGUFFormatError(f"unknown GGUF value type {vtype}")

    def _parse(self) -> None:
        if self._map[:4] != b"GGUF":
            raise GGUFFormatError(f"{self.path} is not a GGUF file (bad magic)")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported (2, 3)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._read("<I"))
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I")
            dims = [self._read("<Q") for _ in range(n_dims)]
            ggml_type, offset = self._read("<I"), self._read("<Q")
            infos.append((name, dims, ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        for name, dims, ggml_type, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError) as e:
                raise GGUFFormatError(f"{self.path}: tensor {name} has unknown ggml type {ggml_type}") from e
            elements = int(np.prod(dims)) if dims else 1
            self.tensors[name] = TensorInfo(
                name=name,
                shape=tuple(int(d) for d in reversed(dims)),
                ggml_type=ggml_type,
                offset=data_start + offset,
                nbytes=elements // block * type_size,
            )
        end = max((t.offset + t.nbytes for t in self.tensors.values()), default=0)
        if end > len(self._map):
            raise GGUFFormatError(
                f"{self.path}: tensor data runs past the end of the file (truncated download?)"
            )

    # -- data ---------------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [*outer dims, bytes per row], a view of the mapped file."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        t = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        row_bytes = t.shape[-1] // block * type_size
        flat = np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return flat.reshape(*t.shape[:-1], row_bytes)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in torch order."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        array = dequantize(self.raw(name), GGMLQuantizationType(t.ggml_type))
        return np.asarray(array, dtype=np.float32).reshape(t.shape)
