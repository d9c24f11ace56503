"""Damaged model directories (engine/loading/hf_check.py): a tiny checkpoint's config.json and
safetensors header cut short, flipped and given extreme values, each case either
loading or raising ModelLoadError in one line naming the file, never another
exception; two of them through `python -m server`, each ending with exit 1 and one
line."""

from __future__ import annotations

import json
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import load_model
from engine.errors import ModelLoadError
from tests.helpers import save_head16_llama

REPO_ROOT = Path(__file__).resolve().parents[2]
SAFETENSORS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_head16_llama(path, seed=0, max_position_embeddings=128)
    return path


def _config_cases(config: dict) -> list[tuple[str, object]]:
    text = json.dumps(config)
    cases = [(f"config cut at {at}", text[:at]) for at in (0, 1, len(text) // 2, len(text) - 1)]
    cases += [("config is a list", "[1, 2]"), ("config is not UTF-8", b"\xff\xfe{}"),
              ("config nested deep", "[" * 100_000 + "]" * 100_000)]
    for key, value in (("hidden_size", 10**12), ("hidden_size", -64), ("hidden_size", "64"),
                       ("num_hidden_layers", 10**6), ("vocab_size", 0), ("vocab_size", True),
                       ("max_position_embeddings", 10**12), ("num_attention_heads", 3.5),
                       ("num_key_value_heads", None)):
        cases.append((f"config {key}={value!r}", json.dumps({**config, key: value})))
    return cases


def _header_cases(raw: bytes, seed: int = 0) -> list[tuple[str, bytes]]:
    length = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    name = next(key for key in header if key != "__metadata__")

    def with_header(values: dict) -> bytes:
        text = json.dumps(values).encode()
        return struct.pack("<Q", len(text)) + text + data

    cases = [(f"weights cut at {at}", raw[:at])
             for at in (0, 7, 8, 20, 8 + length - 1, 8 + length, len(raw) - 1)]
    cases += [("header length 2**63", struct.pack("<Q", 2**63) + raw[8:]),
              ("header not an object", struct.pack("<Q", 3) + b"[1]" + data)]
    entry = header[name]
    for label, changed in (("dtype", {**entry, "dtype": "Q4"}),
                           ("shape", {**entry, "shape": [-1, 4]}),
                           ("shape size", {**entry, "shape": [2**50]}),
                           ("offsets past the end", {**entry, "data_offsets": [0, 2**40]}),
                           ("offsets reversed", {**entry, "data_offsets": [8, 4]}),
                           ("offsets not numbers", {**entry, "data_offsets": ["a", "b"]}),
                           ("offsets short", {**entry, "data_offsets": [0, 4]})):
        cases.append((f"tensor {label}", with_header({**header, name: changed})))
    other = next(key for key in header if key not in ("__metadata__", name))
    cases.append(("tensors overlap", with_header(
        {**header, other: {**header[other], "data_offsets": header[name]["data_offsets"],
                           "shape": header[name]["shape"], "dtype": header[name]["dtype"]}})))
    rng = random.Random(seed)
    for index in range(40):
        copy = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            copy[rng.randrange(8, 8 + length)] ^= rng.randrange(1, 256)
        cases.append((f"header bytes flipped {index}", bytes(copy)))
    return cases


def _load_or_refuse(path: Path, label: str) -> bool:
    """True when the model loaded, False when refused with a good message."""
    try:
        load_model(str(path), progress=False)
        return True
    except ModelLoadError as error:
        message = str(error)
        assert "\n" not in message and str(path) in message, (label, message)
        return False
    except Exception as error:     # anything else is the bug this test looks for
        pytest.fail(f"{label}: {type(error).__name__}: {error}")


def test_every_damaged_directory_loads_or_names_its_problem(tiny_dir, tmp_path):
    config = json.loads((tiny_dir / "config.json").read_text())
    raw = (tiny_dir / SAFETENSORS).read_bytes()
    case_dir = tmp_path / "case"
    shutil.copytree(tiny_dir, case_dir)
    assert _load_or_refuse(case_dir, "intact")
    refused = 0
    for label, text in _config_cases(config):
        data = text if isinstance(text, bytes) else text.encode()
        (case_dir / "config.json").write_bytes(data)
        refused += not _load_or_refuse(case_dir, label)
    (case_dir / "config.json").write_text(json.dumps(config))
    for label, data in _header_cases(raw):
        (case_dir / SAFETENSORS).write_bytes(data)
        refused += not _load_or_refuse(case_dir, label)
    assert refused >= 40


@pytest.mark.parametrize("damage", ["config", "weights"])
def test_the_server_ends_with_one_line(tiny_dir, tmp_path, damage):
    case_dir = tmp_path / "case"
    shutil.copytree(tiny_dir, case_dir)
    if damage == "config":
        (case_dir / "config.json").write_text('{"model_type": "llama", "hidden_size": 1e400')
    else:
        raw = (case_dir / SAFETENSORS).read_bytes()
        (case_dir / SAFETENSORS).write_bytes(raw[:len(raw) // 2])
    done = subprocess.run([sys.executable, "-m", "server", "--model", str(case_dir)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("kvserve:")]
    assert len(lines) == 1 and str(case_dir) in lines[0], done.stderr[-2000:]


def test_an_intact_directory_gives_the_same_weights(tiny_dir):
    from safetensors.torch import load_file

    model = load_model(str(tiny_dir), progress=False)
    assert model.module.engine_spec().num_layers == 2
    saved = load_file(str(tiny_dir / SAFETENSORS))
    assert torch.equal(model.module.embed_tokens.weight, saved["model.embed_tokens.weight"])
