"""A GGUF file checked against its own size before anything trusts it.

Every count, length, type id, dimension, offset and the alignment in the header,
the metadata and the tensor table is checked against the bytes the file has (counts
against what its size could hold at the smallest size of an entry) before a loader
allocates, reshapes or hands a range to the native parser. Tensors' data ranges must
lie inside the file, on the file's alignment, without overlapping. A failure is a
GGUFError naming the file, the key or tensor, and what is wrong, in one line:

    model.gguf: tensor blk.3.ffn_down.weight needs 2,359,296 bytes at offset
    49,152,000; the file ends at 49,181,216: truncated?

Layout (GGUF v2/v3, little-endian): "GGUF" | version u32 | tensor_count u64 |
kv_count u64; kv_count x (key string, value type u32, value); tensor_count x (name
string, n_dims u32, dims u64 x n_dims, ggml type u32, offset u64); padding to
`general.alignment` (32 by default); the data. A string is a u64 length and bytes.
Plain Python over the mapped file; arrays of strings (vocabularies) are skipped in one
tight loop (skip_strings).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
MAX_NAME = 65535
"""Longest key or tensor name accepted (llama.cpp's GGUF names are far shorter)."""
MAX_DIMS = 4
MAX_NESTING = 3
MIN_KV_BYTES = 8 + 1 + 4 + 1          # key length, a 1-byte key, type, the smallest value
MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8


class GGUFError(ValueError):
    """A GGUF file that is damaged or not one this engine reads."""


_LENGTH = struct.Struct("<Q")


def skip_strings(buffer, at: int, count: int, size: int) -> int | None:
    """The offset just past `count` strings (u64 length, bytes) from offset `at`, or
    None where one runs past `size` (the caller's slow walk then names the fault).
    A vocabulary's strings in one tight loop, for the check and the reader alike,
    instead of a walk value by value."""
    unpack = _LENGTH.unpack_from
    for _ in range(count):
        if at + 8 > size:
            return None
        at += 8 + unpack(buffer, at)[0]
    return at if at <= size else None


def check_gguf_file(path: Path) -> None:
    """check_gguf over the file at `path`, mapped."""
    with open(path, "rb") as file:
        if file.seek(0, 2) == 0:
            raise GGUFError(f"{path}: the file is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            check_gguf(str(path), buffer)


class _Reader:
    def __init__(self, name: str, buffer) -> None:
        self.name, self.buffer, self.at, self.size = name, buffer, 0, len(buffer)

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.name}: {what}")

    def take(self, fmt: str, what: str):
        width = struct.calcsize("<" + fmt)
        if self.at + width > self.size:
            raise self.fail(f"{what} needs {width} bytes at offset {self.at:,}; the file ends "
                            f"at {self.size:,}: truncated?")
        values = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += width
        return values if len(values) > 1 else values[0]

    def string(self, what: str, limit: int | None = None) -> str:
        length = self.take("Q", f"the length of {what}")
        if limit is not None and length > limit:
            raise self.fail(f"{what} claims {length:,} bytes; at most {limit:,} are allowed")
        self.skip(length, what)
        try:
            return bytes(self.buffer[self.at - length:self.at]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def skip(self, length: int, what: str) -> None:
        if length > self.size - self.at:
            raise self.fail(f"{what} needs {length:,} bytes at offset {self.at:,}; the file "
                            f"ends at {self.size:,}: truncated?")
        self.at += length

    def value(self, value_type: int, key: str, depth: int = 0) -> None:
        if value_type in _SCALARS:
            self.skip(_SCALARS[value_type], f"the value of {key}")
        elif value_type == _STRING:
            length = self.take("Q", f"the length of {key}'s string")
            self.skip(length, f"{key}'s string")
        elif value_type == _ARRAY:
            if depth >= MAX_NESTING:
                raise self.fail(f"metadata {key} nests arrays deeper than {MAX_NESTING}")
            item_type, count = self.take("IQ", f"{key}'s array header")
            smallest = _SCALARS.get(item_type, 8 if item_type in (_STRING, _ARRAY) else 0)
            if not smallest:
                raise self.fail(f"metadata {key} holds items of unknown type {item_type}")
            if count > (self.size - self.at) // smallest:
                raise self.fail(f"metadata {key} claims {count:,} items; the {self.size - self.at:,} "
                                f"bytes left hold at most {(self.size - self.at) // smallest:,}")
            if item_type in _SCALARS:
                self.skip(smallest * count, f"{key}'s array")
            elif item_type == _STRING and (end := skip_strings(self.buffer, self.at, count,
                                                               self.size)) is not None:
                self.at = end
            else:
                for _ in range(count):
                    self.value(item_type, key, depth + 1)
        else:
            raise self.fail(f"metadata {key} has unknown value type {value_type}")


def check_gguf(name: str, buffer) -> None:
    """Raise GGUFError unless `buffer` (the file's bytes, e.g. its mmap) is a GGUF
    v2/v3 file whose every part lies inside it (see the module's docstring)."""
    reader = _Reader(name, buffer)
    magic, version, tensor_count, kv_count = reader.take("4sIQQ", "the header")
    if magic != b"GGUF":
        raise reader.fail("not a GGUF file (no 'GGUF' magic)")
    if version not in (2, 3):
        raise reader.fail(f"GGUF version {version} (as little-endian); versions 2 and 3 are read")
    for count, what, smallest in ((kv_count, "metadata keys", MIN_KV_BYTES),
                                  (tensor_count, "tensors", MIN_TENSOR_BYTES)):
        if count > reader.size // smallest:
            raise reader.fail(f"claims {count:,} {what}; a file of {reader.size:,} bytes holds "
                              f"at most {reader.size // smallest:,}")
    alignment = 32
    for index in range(kv_count):
        key = reader.string(f"metadata key {index}", MAX_NAME)
        value_type = reader.take("I", f"the type of {key}")
        if key == "general.alignment" and value_type == _UINT32:
            alignment = reader.take("I", "general.alignment")
            if alignment == 0 or alignment & (alignment - 1) or alignment > 1 << 20:
                raise reader.fail(f"general.alignment is {alignment}; a power of two up to 1 MiB "
                                  f"is expected")
        else:
            reader.value(value_type, key)
    table = [_tensor_entry(reader, index) for index in range(tensor_count)]
    _check_data(reader, table, -(-reader.at // alignment) * alignment, alignment)


def _tensor_entry(reader: _Reader, index: int) -> tuple[str, int, int]:
    """(name, byte size, offset) of the table's entry `index`, its fields checked."""
    name = reader.string(f"the name of tensor {index}", MAX_NAME)
    n_dims = reader.take("I", f"tensor {name}'s dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise reader.fail(f"tensor {name} has {n_dims} dimensions; 1 to {MAX_DIMS} are allowed")
    dims = reader.take("Q" * n_dims, f"tensor {name}'s dimensions")
    dims = dims if isinstance(dims, tuple) else (dims,)
    ggml_type, offset = reader.take("IQ", f"tensor {name}'s type and offset")
    try:
        per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        known = ", ".join(f"{kind.name} ({kind.value})" for kind in GGML_QUANT_SIZES)
        raise reader.fail(f"tensor {name} has unknown type id {ggml_type}; the GGUF "
                          f"types are {known}") from None
    elements = 1
    for dim in dims:
        if dim == 0 or dim >= 1 << 40:
            raise reader.fail(f"tensor {name} has dimension {dim}; 1 to 2**40 - 1 are allowed")
        elements *= dim
    if dims[0] % per_block:
        raise reader.fail(f"tensor {name}'s rows of {dims[0]} are not whole blocks of "
                          f"{per_block} ({GGMLQuantizationType(ggml_type).name})")
    return name, elements // per_block * block_bytes, offset


def _check_data(reader: _Reader, table, data_start: int, alignment: int) -> None:
    end_of_file = reader.size
    ranges = []
    for name, nbytes, offset in table:
        if offset % alignment:
            raise reader.fail(f"tensor {name}'s offset {offset:,} is not a multiple of the "
                              f"alignment {alignment}")
        start = data_start + offset
        if start + nbytes > end_of_file:
            raise reader.fail(f"tensor {name} needs {nbytes:,} bytes at offset {start:,}; the "
                              f"file ends at {end_of_file:,}: truncated?")
        ranges.append((start, start + nbytes, name))
    ranges.sort()
    for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
        if start < end:
            raise reader.fail(f"tensors {first} and {second} overlap")
