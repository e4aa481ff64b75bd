"""A GGUF file's metadata and tensors, read in one pass over its header.

gguf-py's `GGUFReader` keeps a NumPy view of every part of every metadata value: for a
tokenizer of 49k tokens and 49k merges that is over a million views, 2.3 s of every start of
every process (gateway, workers, ranks) on the machine the figure came from, ten times the
time this reader takes (docs/benchmarks.md). The tensors are the same memory-mapped views,
in gguf-py's shapes and types, so its dequantization applies unchanged."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
# tensors stored as plain numbers; every other type is blocks of bytes
PLAIN: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-moving dimension first
    data: np.ndarray  # row-major (rows, ...); uint8 rows of blocks for quantized types


class GgufFile:
    """ValueError for anything but a whole GGUF file of version 2 or 3 (little-endian)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, mode="r")
        self._buf = memoryview(self._map)  # type: ignore[arg-type]
        self._at = 0
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file")
        self._at = 4
        try:
            self._read()
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: not a readable GGUF file ({e})") from e

    def _read(self) -> None:
        version, n_tensors, n_fields = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2, 3)")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(GGUFValueType(self._unpack("<I")[0]))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(name, shape, kind, start + offset)
                        for name, shape, kind, offset in infos]

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._buf, self._at)
        self._at += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._buf, self._at)
        start = self._at + 8
        self._at = start + length
        return str(self._buf[start:self._at], "utf-8")

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind in SCALARS:
            return self._unpack("<" + SCALARS[kind])[0]
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: unknown metadata type {kind}")
        item, count = self._unpack("<IQ")
        item = GGUFValueType(item)
        if item in SCALARS:  # numbers in one read
            dtype = np.dtype("<" + SCALARS[item])
            values = np.frombuffer(self._buf, dtype, count, self._at)
            self._at += dtype.itemsize * count
            return values.tolist()
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (dims,) = self._unpack("<I")
        shape = self._unpack(f"<{dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, shape, GGMLQuantizationType(kind), offset

    def _tensor(self, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType,
                at: int) -> GgufTensor:
        rows = tuple(reversed(shape))  # row-major, as NumPy holds it
        count = int(np.prod(shape))
        if kind in PLAIN:
            data = np.frombuffer(self._buf, PLAIN[kind], count, at).reshape(rows)
        else:
            block, size = GGML_QUANT_SIZES[kind]
            data = np.frombuffer(self._buf, np.uint8, count * size // block, at)
            data = data.reshape(quant_shape_to_byte_shape(rows, kind))
        return GgufTensor(name, kind, shape, data)
