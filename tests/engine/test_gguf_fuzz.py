"""Damaged GGUF files (engine/loading/gguf_check.py): a seeded mutation loop over a small GGUF
built here (truncations at every section boundary, flipped bytes in each section,
huge counts, overlapping and misaligned offsets, zero and huge dimensions, unknown
type ids) where every case either reads or raises GGUFError naming the file, never
another exception; and a few through `python -m server`, each ending with exit 1
and one line naming the file."""

from __future__ import annotations

import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.loading.gguf_check import GGUFError, check_gguf, check_gguf_file
from engine.models.gguf_tensors import read_gguf_file

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> tuple[bytes, dict]:
    """A small valid GGUF's bytes and where its parts are (`_layout`)."""
    import gguf

    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_token_list([f"tok{i}" for i in range(40)])
    writer.add_array("tokenizer.ggml.scores", [0.5] * 40)
    rng = np.random.default_rng(0)
    for name, shape in (("token_embd.weight", (40, 32)), ("blk.0.attn_q.weight", (32, 32)),
                        ("output_norm.weight", (32,))):
        values = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 2 and name != "token_embd.weight":
            values = gguf.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, values, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    raw = path.read_bytes()
    return raw, _layout(raw)


def _layout(raw: bytes) -> dict:
    """Offsets of the header's counts, each metadata entry's end, each tensor entry's
    fields (name, n_dims, dims, type, offset) and the data start."""
    at = 24
    _, _, tensor_count, kv_count = struct.unpack_from("<4sIQQ", raw, 0)

    def string(at):
        return at + 8 + struct.unpack_from("<Q", raw, at)[0]

    def value(at, kind):
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if kind in sizes:
            return at + sizes[kind]
        if kind == 8:
            return string(at)
        item, count = struct.unpack_from("<IQ", raw, at)
        at += 12
        for _ in range(count):
            at = value(at, item)
        return at

    kv_ends = []
    for _ in range(kv_count):
        at = string(at)
        kind = struct.unpack_from("<I", raw, at)[0]
        at = value(at + 4, kind)
        kv_ends.append(at)
    tensors = []
    for _ in range(tensor_count):
        name_at = at
        at = string(at)
        n_dims = struct.unpack_from("<I", raw, at)[0]
        entry = {"name": name_at, "n_dims": at, "dims": at + 4}
        at += 4 + 8 * n_dims
        entry["type"], entry["offset"] = at, at + 4
        at += 12
        tensors.append(entry)
    return {"kv_ends": kv_ends, "tensors": tensors, "table_end": at,
            "data_start": -(-at // 32) * 32}


def _cases(raw: bytes, layout: dict, seed: int = 0) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    cases = []
    boundaries = {0, 4, 8, 16, 24, *layout["kv_ends"], layout["table_end"],
                  layout["data_start"], len(raw) - 1}
    for entry in layout["tensors"]:
        boundaries.update(entry.values())
    for cut in sorted(boundaries):
        for at in (cut - 1, cut, cut + 1):
            if 0 <= at < len(raw):
                cases.append((f"truncated at {at}", raw[:at]))

    def patched(at: int, fmt: str, value) -> bytes:
        copy = bytearray(raw)
        struct.pack_into("<" + fmt, copy, at, value)
        return bytes(copy)

    for value in (2**63, 2**64 - 1, 10**9):
        cases.append((f"tensor count {value}", patched(8, "Q", value)))
        cases.append((f"kv count {value}", patched(16, "Q", value)))
    first, second = layout["tensors"][0], layout["tensors"][1]
    offset0 = struct.unpack_from("<Q", raw, first["offset"])[0]
    cases.append(("overlapping offsets", patched(second["offset"], "Q", offset0)))
    cases.append(("misaligned offset", patched(second["offset"], "Q", offset0 + 1)))
    cases.append(("offset past the end", patched(second["offset"], "Q", 2**62)))
    for value in (0, 2**64 - 1, 2**40, 33):
        cases.append((f"dimension {value}", patched(first["dims"], "Q", value)))
    for value in (0, 5, 2**32 - 1):
        cases.append((f"{value} dimensions", patched(first["n_dims"], "I", value)))
    cases.append(("unknown type", patched(first["type"], "I", 9999)))
    cases.append(("huge name", patched(first["name"], "Q", 2**63)))
    regions = [(0, 24), (24, layout["table_end"]), (layout["kv_ends"][-1], layout["table_end"]),
               (layout["data_start"], len(raw))]
    for index in range(240):
        low, high = regions[index % len(regions)]
        copy = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            copy[rng.randrange(low, high)] ^= rng.randrange(1, 256)
        cases.append((f"flipped bytes {index} in [{low}, {high})", bytes(copy)))
    return cases


def test_every_damaged_file_reads_or_names_its_problem(small_gguf, tmp_path):
    raw, layout = small_gguf
    path = tmp_path / "case.gguf"
    path.write_bytes(raw)
    check_gguf_file(path)
    assert [t.name for t in read_gguf_file(path).tensors][:1] == ["token_embd.weight"]
    cases = _cases(raw, layout)
    assert len(cases) > 300
    refused = 0
    for label, data in cases:
        path.write_bytes(data)
        try:
            check_gguf_file(path)
            read_gguf_file(path)
        except GGUFError as error:
            refused += 1
            message = str(error)
            assert message.startswith(str(path)) and "\n" not in message, (label, message)
        except Exception as error:      # anything else is the bug this test looks for
            pytest.fail(f"{label}: {type(error).__name__}: {error}")
    assert refused > len(cases) // 3


@pytest.mark.parametrize("label", ["truncated at 23", "tensor count 18446744073709551615",
                                   "overlapping offsets"])
def test_the_server_ends_with_one_line(small_gguf, tmp_path, label):
    raw, layout = small_gguf
    data = dict(_cases(raw, layout))[label]
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    done = subprocess.run([sys.executable, "-m", "server", "--model", str(path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("kvserve:")]
    assert len(lines) == 1 and str(path) in lines[0], done.stderr[-2000:]


REGRESSIONS = Path(__file__).with_name("gguf_regressions.json")
"""Cases of the mutation loop kept with the message each must give (F: the file's
path; a message may continue past what is kept): a change that makes any of them
vaguer, or lets one through, fails here by name."""


def test_the_regression_corpus_keeps_its_messages(small_gguf, tmp_path):
    import json

    raw, layout = small_gguf
    cases = dict(_cases(raw, layout))
    path = tmp_path / "case.gguf"
    for entry in json.loads(REGRESSIONS.read_text()):
        path.write_bytes(cases[entry["case"]])
        with pytest.raises(GGUFError) as refused:
            check_gguf_file(path)
            read_gguf_file(path)
        message = str(refused.value).replace(str(path), "F")
        assert message.startswith(entry["message"]), (entry["case"], message)


def test_an_unknown_architecture_names_the_ones_read(tmp_path):
    import gguf

    from engine.loading.model_files import resolve_model_dir

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "notafamily")
    writer.add_block_count(1)
    writer.add_token_list([f"t{i}" for i in range(8)])
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"notafamily.*architectures read are .*llama.*qwen3"):
        resolve_model_dir(str(path), tmp_path / "cache")


def test_string_arrays_are_skipped_whole_or_their_fault_is_named():
    """skip_strings walks a vocabulary in one loop and stops at the first string that
    runs past the end, so the checker's slow walk can name it."""
    from engine.loading.gguf_check import skip_strings

    strings = [b"a", b"", b"hello", b"x" * 300]
    packed = b"".join(struct.pack("<Q", len(s)) + s for s in strings)
    assert skip_strings(packed, 0, 4, len(packed)) == len(packed)
    assert skip_strings(packed, 0, 2, len(packed)) == 8 + 1 + 8
    assert skip_strings(packed, 0, 4, len(packed) - 1) is None       # the last runs past
    assert skip_strings(packed, 0, 5, len(packed)) is None           # a length past the end
    header = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1)
    key = struct.pack("<Q", 15) + b"tokenizer.ggml." + struct.pack("<IIQ", 9, 8, 4)
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.'s string needs 300 bytes at "
                                        r"offset 101; the file ends at 400: truncated\?"):
        check_gguf("bytes.gguf", header + key + packed[:-1])
