"""A model directory checked before it is trusted: its JSON files and the headers of
its safetensors files (gguf_check.py does the same for GGUF files).

A directory comes from the hub or a user's disk, and its files may be cut short,
edited by hand, or made to hurt. Before transformers or safetensors read anything:

    config.json, tokenizer_config.json, generation_config.json
        JSON objects (a syntax error names its line and column); config.json's sizes
        (hidden_size, num_hidden_layers, vocab_size, ...) whole numbers in a range a
        real model has, so a config cannot make the loader allocate a model of 10**15
        parameters or build a rotary table of 10**12 positions
    *.safetensors
        an 8-byte header length inside the file and at most 100 MB; a header that is
        a JSON object of tensor entries, each with a known dtype, a shape of sizes
        >= 0, and data offsets [begin, end] inside the data area whose length is the
        shape's bytes; no two tensors overlapping

Every failure is a ModelLoadError naming the file (and the key or tensor) and what is
wrong, in one line.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

JSON_FILES = ("config.json", "tokenizer_config.json", "generation_config.json")
SIZE_LIMITS = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 20,
    "num_hidden_layers": 1 << 10, "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10, "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 24, "sliding_window": 1 << 24, "num_labels": 1 << 16,
}
"""config.json size -> the largest accepted (several times the largest released models')."""
MAX_HEADER_BYTES = 100 * 1000 * 1000
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
               "F64": 8}


def check_model_dir(model_dir: Path) -> None:
    """Raise ModelLoadError for the first thing in the directory that is wrong."""
    for name in JSON_FILES:
        path = model_dir / name
        if path.is_file():
            values = read_json_object(path)
            if name == "config.json":
                check_sizes(path, values)
                if isinstance(values.get("text_config"), dict):
                    check_sizes(path, values["text_config"], "text_config.")
    for path in sorted(model_dir.glob("*.safetensors")):
        check_safetensors_header(path)


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_bytes())
    except UnicodeDecodeError as error:
        raise ModelLoadError(f"{path}: not UTF-8 text ({error.reason} at byte "
                             f"{error.start})") from None
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path}: not JSON ({error.msg} at line {error.lineno}, "
                             f"column {error.colno})") from None
    except RecursionError:
        raise ModelLoadError(f"{path}: JSON nested too deeply") from None
    if not isinstance(values, dict):
        raise ModelLoadError(f"{path}: a JSON object was expected, found "
                             f"{type(values).__name__}")
    return values


def check_sizes(path: Path, values: dict[str, Any], prefix: str = "") -> None:
    for key, limit in SIZE_LIMITS.items():
        value = values.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise ModelLoadError(f"{path}: {prefix}{key} is {value!r}; a whole number from 1 "
                                 f"to {limit:,} was expected")


def check_safetensors_header(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as file:
        if size < 8:
            raise ModelLoadError(f"{path}: {size} bytes, shorter than a safetensors header "
                                 "length: truncated?")
        header_bytes = struct.unpack("<Q", file.read(8))[0]
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            raise ModelLoadError(f"{path}: the header claims {header_bytes:,} bytes; the file "
                                 f"holds {size - 8:,} after its length (at most "
                                 f"{MAX_HEADER_BYTES:,} are read): truncated or not safetensors?")
        raw = file.read(header_bytes)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ModelLoadError(f"{path}: the header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: the header is not a JSON object")
    data_bytes = size - 8 - header_bytes
    spans = sorted(_tensor_span(path, name, entry, data_bytes)
                   for name, entry in header.items() if name != "__metadata__")
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ModelLoadError(f"{path}: tensors {first} and {second} overlap")


def _tensor_span(path: Path, name: str, entry: Any, data_bytes: int) -> tuple[int, int, str]:
    """(begin, end, name) of a header entry, every field checked."""
    if not isinstance(entry, dict):
        raise ModelLoadError(f"{path}: tensor {name}'s entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise ModelLoadError(f"{path}: tensor {name} has dtype {dtype!r}; known: "
                             f"{', '.join(DTYPE_BYTES)}")
    if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool)
                                            and 0 <= n < 1 << 40 for n in shape)):
        raise ModelLoadError(f"{path}: tensor {name} has shape {shape!r}; a list of sizes "
                             "from 0 to 2**40 - 1 was expected")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise ModelLoadError(f"{path}: tensor {name}'s data_offsets {offsets!r} are not a "
                             f"range inside the {data_bytes:,} data bytes: truncated?")
    needed = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != needed:
        raise ModelLoadError(f"{path}: tensor {name} of shape {shape} ({dtype}) needs "
                             f"{needed:,} bytes; its data_offsets span {offsets[1] - offsets[0]:,}")
    return offsets[0], offsets[1], name
