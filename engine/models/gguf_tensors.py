"""The tensor table of a GGUF file, read without decoding its metadata values.

gguf-py's GGUFReader builds a numpy view for every part of every metadata value: the
default model's tokenizer (49,152 tokens, 48,900 merges) alone makes ~250k views, and
they take most of its load time. The weights need only the tensors' names, shapes, types
and bytes (and the file's architecture, which names its tensor processing), so this
reader walks the metadata with `struct` (each value's size is read, not its contents,
but for `general.architecture`) to reach the tensor table. GGUF v2/v3 layout:

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x (key: string, value_type u32, value)        string = length u64 + bytes
    tensor_count x (name: string, n_dims u32, dims u64 x n_dims, ggml_type u32, offset u64)
    padding to `general.alignment` (default 32), then the data; offsets count from there

A tensor's dims list the row length first (ne[0]): a [576 x 1536] Q4_1 projection is
1,536 rows of 576 weights, each row 576 / 32 blocks of 20 bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..loading.gguf_check import GGUFError, check_gguf, skip_strings
from ..kernels.block_types import GGML_TYPES

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Bytes of each fixed-size metadata value type (8 is a string, 9 an array)."""
_STRING, _ARRAY, _UINT32 = 8, 9, 4


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: str | None    # a GGML_TYPES name ("Q4_1", "Q8_0", "Q4_K", ...); None: another type
    ggml_type: int      # the file's type id (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]   # torch order: the row length last (the file's dims reversed)
    data: np.ndarray    # [rows, bytes per row] uint8, a view of the mapped file
    offset: int         # where `data` starts in the file


@dataclass(frozen=True)
class GGUFFile:
    architecture: str   # general.architecture: "llama", "qwen2", "gemma3", ...
    tensors: list[GGUFTensor]
    mapping: mmap.mmap  # the mapped file the tensors' data views

    def drop_pages(self, tensor: GGUFTensor) -> None:
        """Unmap the pages of `tensor` this process has read (they stay in the page
        cache; the view reads them again if used): reading a file tensor by tensor then
        holds one tensor's pages at a time in resident memory, not the whole file."""
        start = tensor.offset - tensor.offset % mmap.PAGESIZE
        end = tensor.offset + tensor.data.nbytes
        self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


class _Cursor:
    def __init__(self, buffer) -> None:
        self.buffer, self.at = buffer, 0

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.take("Q")
        self.at += length
        return bytes(self.buffer[self.at - length:self.at]).decode("utf-8", "replace")

    def skip_value(self, value_type: int) -> None:
        if value_type == _STRING:
            length = self.take("Q")    # (`self.at += self.take(...)` would add to the old at)
            self.at += length
        elif value_type == _ARRAY:
            item_type, count = self.take("IQ")
            if item_type in _SCALAR_SIZES:
                self.at += _SCALAR_SIZES[item_type] * count
            elif item_type == _STRING:      # the file was checked: every string fits
                self.at = skip_strings(self.buffer, self.at, count, len(self.buffer))
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        else:
            self.at += _SCALAR_SIZES[value_type]


def read_block_tensors(path: Path) -> list[GGUFTensor]:
    """The file's tensors of GGML_TYPES (others are skipped): see read_gguf_file."""
    return [tensor for tensor in read_gguf_file(path).tensors if tensor.kind is not None]


def read_gguf_file(path: Path) -> GGUFFile:
    """The file's architecture and tensors, as views of the mapped file (the mapping
    lives as long as a view does). GGUFError (a ValueError, engine/loading/gguf_check.py) for
    a file this reader cannot read: damaged, truncated, not GGUF v2/v3 little-endian,
    or a tensor type gguf-py does not know."""
    with open(path, "rb") as file:
        if file.seek(0, 2) == 0:
            raise GGUFError(f"{path}: the file is empty")
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    check_gguf(str(path), buffer)      # every range proven inside the file first
    try:
        return _read(path, buffer)
    except (struct.error, KeyError, UnicodeDecodeError) as error:
        raise GGUFError(f"{path}: malformed GGUF ({error})") from error


def _read(path: Path, buffer) -> GGUFFile:
    cursor = _Cursor(buffer)
    magic, version, tensor_count, kv_count = cursor.take("4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):     # a big-endian file reads as 2**24+
        raise ValueError(f"{path} is not a little-endian GGUF v2/v3 file")
    alignment, architecture = 32, ""
    for _ in range(kv_count):
        key, value_type = cursor.string(), cursor.take("I")
        if key == "general.alignment" and value_type == _UINT32:
            alignment = cursor.take("I")
        elif key == "general.architecture" and value_type == _STRING:
            architecture = cursor.string()
        else:
            cursor.skip_value(value_type)
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = cursor.take("Q" * cursor.take("I"))
        dims = dims if isinstance(dims, tuple) else (dims,)
        ggml_type, offset = cursor.take("IQ")
        table.append((name, dims, ggml_type, offset))
    data_start = -(-cursor.at // alignment) * alignment
    whole = np.frombuffer(buffer, dtype=np.uint8)
    tensors = []
    for name, dims, ggml_type, offset in table:
        per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        row_bytes = dims[0] // per_block * block_bytes
        start = data_start + offset
        if start + rows * row_bytes > whole.shape[0]:
            raise ValueError(f"{path}: tensor {name} runs past the end of the file")
        kind = GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else None
        tensors.append(GGUFTensor(name, kind, ggml_type, tuple(reversed(dims)),
                                  whole[start:start + rows * row_bytes].reshape(rows, row_bytes),
                                  start))
    return GGUFFile(architecture, tensors, buffer)
