"""GGUF's byte layout, read: the metadata and where each tensor's bytes lie (model/gguf.py builds the model from
them). Reference: ggml's docs/gguf.md.

    magic "GGUF", version (u32: 2 or 3), tensor count (u64), metadata count (u64)
    metadata: key (string), value type (u32), value        a string is its byte length (u64), then UTF-8 bytes;
                                                            an array its item type (u32), count (u64), then items
    tensor infos: name (string), n_dims (u32), ne[n_dims] (u64, the contiguous dimension first), type (u32),
                  offset (u64, from the data's start)
    the data: from the end of the infos rounded up to `general.alignment` (32 by default)

Fields and tensors carry the names of gguf-py's `GGUFReader` (`fields[key].contents()`, `.types`; `tensors[i]`'s
`name`, `shape`, `tensor_type`, `data`), so either reader's output builds a model. This one decodes a vocabulary's
~10^5 strings in one pass of plain Python, where `GGUFReader` makes numpy views of every item's parts first. A
tensor's `data` is its raw bytes, shaped (rows..., bytes a row), which `gguf.quants.dequantize` reads for every type.
Little-endian files only, as llama.cpp writes them.
"""
import struct
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
           GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
           GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
           GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
DEFAULT_ALIGNMENT = 32


class Field(NamedTuple):
    value: object  # a number, bool or str; a list for an array
    types: list  # [the value's type], or [ARRAY, the items' type(s)]

    def contents(self):
        return self.value


class Tensor(NamedTuple):
    name: str
    shape: tuple  # ggml's ne: the contiguous dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # uint8 (rows..., bytes a row): a view of the file


class GGUFFile:
    """A GGUF file's `fields` (key -> `Field`) and `tensors` (`Tensor`s in the file's order). Raises ValueError on a
    file that is not GGUF, or is cut short."""

    def __init__(self, path):
        self.bytes = np.memmap(path, mode="r", dtype=np.uint8)
        self.view, self.at = memoryview(self.bytes), 0
        try:
            self._read()
        except (struct.error, KeyError, IndexError) as e:  # the layout ran past the end, or an unknown type code
            raise ValueError(f"bad or cut-short layout at byte {self.at}: {e!r}") from e

    def _read(self):
        if bytes(self.view[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        self.at = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reads 2 and 3, little-endian)")
        n_tensors, n_fields = self._scalar("<Q"), self._scalar("<Q")
        self.fields = {}
        for _ in range(n_fields):
            key = self._string()
            kind = GGUFValueType(self._scalar("<I"))
            value, types = self._value(kind)
            self.fields[key] = Field(value, types)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            shape = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
            infos.append((name, shape, GGMLQuantizationType(self._scalar("<I")), self._scalar("<Q")))
        alignment = self.fields["general.alignment"].value if "general.alignment" in self.fields else \
            DEFAULT_ALIGNMENT
        start = self.at + (-self.at % alignment)
        self.tensors, names = [], set()
        for name, shape, qtype, offset in infos:
            if name in names:
                raise ValueError(f"tensor {name!r} is listed twice")
            names.add(name)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            rows = tuple(reversed(shape[1:]))
            row_bytes = shape[0] // block * block_bytes if shape else block_bytes
            size = int(np.prod(rows, dtype=np.int64)) * row_bytes
            begin = start + offset
            if begin + size > len(self.bytes):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            self.tensors.append(Tensor(name, shape, qtype, self.bytes[begin:begin + size].reshape(*rows, row_bytes)))

    def _scalar(self, fmt):
        value = struct.unpack_from(fmt, self.view, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def _string(self):
        n = self._scalar("<Q")
        if self.at + n > len(self.view):
            raise ValueError("a string runs past the end of the file")
        s = str(self.view[self.at:self.at + n], "utf-8")
        self.at += n
        return s

    def _value(self, kind):
        """(value, types) of one value of type `kind` at the read position."""
        if kind == GGUFValueType.STRING:
            return self._string(), [kind]
        if kind != GGUFValueType.ARRAY:
            return self._scalar(SCALARS[kind]), [kind]
        item, n = GGUFValueType(self._scalar("<I")), self._scalar("<Q")
        if item == GGUFValueType.STRING:
            return [self._string() for _ in range(n)], [kind, item]
        if item == GGUFValueType.ARRAY:
            values = [self._value(item) for _ in range(n)]
            return [v for v, _ in values], [kind, *(values[0][1] if values else [item])]
        fmt = SCALARS[item]
        items = np.frombuffer(self.view, dtype=np.dtype(fmt), count=n, offset=self.at)
        self.at += items.nbytes
        return items.tolist(), [kind, item]
