"""A GGUF file's weights under transformers' names, read in place: no conversion
through a transformers model, no copy written to disk.

Each tensor of the file (tensor table: gguf_tensors.py) is matched to its
transformers name by gguf-py's tensor-name map, as transformers' own GGUF loader
matches them (`get_gguf_hf_weights_map` over the model's parameter names: for the
families we have code for, the names their checkpoints hold; for others, those of a
transformers model built on the meta device), and passed through the same per-architecture
processor (llama.cpp stores Llama's q and k rows permuted for its RoPE layout, Gemma's
norms as 1 + weight). Then:

- tensors of a type the block kernels read (block_formats.py) become `Blocks`, with
  the processor's row order applied to the blocks' rows (parsed in one pass by the
  native parser where the kernels are built, block_parse.c, else by torch's ops; for
  dtype int8-activations straight into its forms, int8_blocks.py); a dense value is made only
  for a weight the model needs dense (`dense_state`): the blocks dequantized, which
  equal gguf-py's dequantization bit for bit (block_formats.py);
- every other tensor (F32 norms, F16 or BF16 weights, K types the kernels do not
  read) is dequantized by gguf-py and processed as transformers processes it.

Whether a processor only reorders a tensor's rows is asked of the processor itself:
it processes a column of row indices, and the answer is either a permutation of them
(applied to the blocks) or not (the tensor is dequantized instead).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..loading.model_files import return_freed_memory
from .block_formats import FORM_OF, Blocks, empty_blocks, parse_blocks, parse_blocks_into
from .gguf_tensors import GGUFTensor, read_gguf_file
from .int8_blocks import LANES, empty_int8_blocks, int8_form_for


@dataclass
class GGUFCheckpoint:
    dense: dict[str, torch.Tensor]
    """transformers name -> fp32 tensor, for the tensors not held as blocks."""
    blocks: dict[str, Blocks] = field(default_factory=dict)
    """transformers name -> the weight as kernel blocks, for the tensors of a type the
    block kernels read (projections, embeddings, LM head)."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """transformers name -> the tensor's shape, for the blocks."""

    def take(self, name: str) -> torch.Tensor | None:
        """The fp32 value of tensor `name` (transformers' name, tried with `model.`
        first): a dense one leaves the checkpoint, blocks are dequantized and stay (a
        BlockLinear may hold them too); None where the file has no such tensor."""
        for key in ("model." + name, name):
            if key in self.dense:
                return self.dense.pop(key)
            if key in self.blocks:
                return self.blocks[key].dequantize().reshape(self.shapes[key])
        return None

    def dense_state(self, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Every tensor as a dense fp32 value (blocks dequantized: gguf-py's values bit
        for bit) but those in `skip`, which the model serves from their blocks."""
        state = dict(self.dense)
        for name, blocks in self.blocks.items():
            if name not in skip:
                state[name] = blocks.dequantize().reshape(self.shapes[name])
        return state


@dataclass(frozen=True)
class BlockParsing:
    """How a checkpoint's blocks are parsed: by the native parser of `kernels` (else
    torch's ops), into the int8-activation forms where `int8_activations` (the
    kernels must be given) and the rows come in whole groups of 16."""
    kernels: Any = None
    int8_activations: bool = False

    def empty(self, kind: str, row_counts: list[int], row_length: int) -> Blocks:
        """Unwritten blocks for parts of `row_counts` rows of GGUF type `kind`."""
        rows = sum(row_counts)
        if self.int8_activations and all(count % LANES == 0 for count in row_counts):
            return empty_int8_blocks(int8_form_for(kind, self.kernels.int8_path), rows,
                                     row_length)
        return empty_blocks(FORM_OF[kind], rows, row_length)

    def form_of(self, kind: str) -> str:
        """The form a tensor of GGUF type `kind` is read into (whole groups of rows)."""
        if self.int8_activations:
            return int8_form_for(kind, self.kernels.int8_path)
        return FORM_OF[kind]

    def parse_into(self, kind: str, raw: torch.Tensor, out: Blocks, start: int,
                   order: torch.Tensor | None) -> None:
        if self.kernels is not None:
            self.kernels.parse_gguf(kind, raw, out, start, order)
        else:
            parse_blocks_into(kind, raw, out, start, order)


def _processing(architecture: str, config: Any):
    """(the tensor processor for this architecture, GGUF name -> HF name).
    The names are mapped as transformers maps them, in one pass over the parameter
    names (transformers' own `get_gguf_hf_weights_map` rebuilds gguf-py's name table
    for every submodule, and that dominated reading the default model's weights)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    processor = _processor(architecture, config)
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ValueError(f"gguf-py knows no architecture {architecture!r}")
    table = get_tensor_name_map(arch, config.num_hidden_layers)
    mapping = {}
    for hf_name in _parameter_names(config):
        stem, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        gguf_name = table.get_name(stem) if suffix in ("weight", "bias") else None
        if gguf_name is not None:
            mapping[f"{gguf_name}.{suffix}"] = hf_name
    return processor, mapping


def _processor(architecture: str, config: Any):
    """Our processor (gguf_processors.py) for our families' architectures, else
    transformers' for this architecture."""
    from . import has_own_code
    from .gguf_processors import OWN_PROCESSORS, GGUFProcessor

    if has_own_code(config) and architecture in OWN_PROCESSORS:
        return GGUFProcessor(architecture, config.to_dict())
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def _parameter_names(config: Any) -> list[str]:
    """The transformers parameter names of a model of `config`: for our families their
    fixed layout (no transformers model is built: importing and building one was a
    tenth of a 1.7B model's start), else a meta-device transformers model's."""
    from . import has_own_code
    from .model_parts import hf_weight_names

    if has_own_code(config):
        return hf_weight_names(config.num_hidden_layers)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return list(AutoModelForCausalLM.from_config(config).state_dict())


def _processed(processor, tensor: GGUFTensor, values: np.ndarray, mapping: dict) -> np.ndarray:
    return processor.process(weights=values, name=tensor.name, tensor_key_mapping=mapping,
                             parsed_parameters={}).weights


def _row_order(processor, tensor: GGUFTensor, mapping: dict) -> torch.Tensor | None:
    """The processor's output rows as indices of the input rows, when all it does to
    this tensor is reorder its rows; else None."""
    rows = tensor.data.shape[0]
    index = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    out = _processed(processor, tensor, index, mapping)
    if out.shape != index.shape or not np.array_equal(np.sort(out[:, 0]), index[:, 0]):
        return None
    return torch.from_numpy(out[:, 0].astype(np.int64))


def _dequantized(processor, tensor: GGUFTensor, mapping: dict) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(tensor.data, GGMLQuantizationType(tensor.ggml_type))
    values = _processed(processor, tensor, values.reshape(tensor.shape), mapping)
    return torch.from_numpy(np.array(values, dtype=np.float32))     # a copy: the file is read-only


def read_gguf_checkpoint(path: Path, config: Any,
                         parsing: BlockParsing = BlockParsing()) -> GGUFCheckpoint:
    """The weights of `path` for a model of `config` (the config the file's metadata
    gives). Tensors the model has no parameter for are skipped, as transformers skips
    them. The parts of a fused projection (q, k, v; gate, up) of one kernel form are
    parsed into one buffer, so joining them later copies nothing (block_formats.concat)."""
    gguf_file = read_gguf_file(path)
    processor, mapping = _processing(gguf_file.architecture, config)
    named = {mapping[t.name]: t for t in gguf_file.tensors if t.name in mapping}
    checkpoint = GGUFCheckpoint({})
    joined = _joined_groups(named, processor, mapping, parsing)
    for parts in joined.values():
        _read_joined(checkpoint, parts, named, parsing)
        for name, _ in parts:
            _done_with(gguf_file, named[name])
    for name, tensor in named.items():
        if name not in checkpoint.blocks:
            _read_tensor(checkpoint, name, tensor, processor, mapping, parsing)
            _done_with(gguf_file, tensor)
    return_freed_memory()
    return checkpoint


def _done_with(gguf_file, tensor: GGUFTensor) -> None:
    gguf_file.drop_pages(tensor)
    if tensor.data.nbytes >= TRIM_AFTER_BYTES:
        return_freed_memory()


def _joined_groups(named: dict[str, GGUFTensor], processor, mapping: dict,
                   parsing: BlockParsing) -> dict:
    """fused projection name -> [(part name, row order or None), ...] for the fused
    projections whose parts are all present, all read into one form, and only
    reordered by the processor (else their parts are read one by one)."""
    from .model_parts import FUSED_PARTS

    groups = {}
    for name in named:
        stem, _, layer_part = name.partition(".layers.")
        index, _, part = layer_part.partition(".")
        fused = next((f for f, parts in FUSED_PARTS.items() if f"{parts[0]}.weight" == part), None)
        if fused is None:
            continue
        names = [f"{stem}.layers.{index}.{p}.weight" for p in FUSED_PARTS[fused]]
        tensors = [named.get(n) for n in names]
        if any(t is None or t.kind not in FORM_OF for t in tensors) or len(
                {parsing.form_of(t.kind) for t in tensors}) != 1 or len(
                {t.shape[1] for t in tensors}) != 1:
            continue
        orders = [_row_order(processor, t, mapping) for t in tensors]
        if any(order is None for order in orders):
            continue
        groups[f"{stem}.layers.{index}.{fused}"] = [
            (n, None if torch.equal(o, torch.arange(o.shape[0])) else o)
            for n, o in zip(names, orders)]
    return groups


def _read_joined(checkpoint: GGUFCheckpoint, parts: list, named: dict,
                 parsing: BlockParsing) -> None:
    tensors = [named[name] for name, _ in parts]
    out = parsing.empty(tensors[0].kind, [t.shape[0] for t in tensors], tensors[0].shape[1])
    start = 0
    for (name, order), tensor in zip(parts, tensors):
        parsing.parse_into(tensor.kind, _mapped(tensor), out, start, order)
        checkpoint.blocks[name] = out.row_range(start, start + tensor.shape[0])
        checkpoint.shapes[name] = tensor.shape
        start += tensor.shape[0]


def _mapped(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor's bytes [rows, row bytes] as a torch view of the mapped file: read
    only (parsing writes nothing to it)."""
    with warnings.catch_warnings():               # torch warns that the view is read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(tensor.data)


def _read_tensor(checkpoint: GGUFCheckpoint, name: str, tensor: GGUFTensor, processor,
                 mapping: dict, parsing: BlockParsing) -> None:
    order = _row_order(processor, tensor, mapping) if tensor.kind is not None else None
    if order is None:
        checkpoint.dense[name] = _dequantized(processor, tensor, mapping)
        return
    reordered = not torch.equal(order, torch.arange(order.shape[0]))
    if parsing.kernels is not None:
        blocks = parsing.empty(tensor.kind, [tensor.shape[0]], tensor.shape[1])
        parsing.parse_into(tensor.kind, _mapped(tensor), blocks, 0, order if reordered else None)
    else:
        blocks = _parsed_in_place(tensor)
        blocks = blocks.rows(order) if reordered else blocks
    checkpoint.blocks[name] = blocks
    checkpoint.shapes[name] = tensor.shape


def _parsed_in_place(tensor: GGUFTensor) -> Blocks:
    """The tensor's blocks, parsed straight from the mapped file (no copy of its bytes
    first). Parsing only reads its input; any output that still views the file's
    read-only pages is copied, so no block outlives the mapping or writes to it."""
    raw = _mapped(tensor)
    blocks = parse_blocks(tensor.kind, raw)
    start, end = raw.data_ptr(), raw.data_ptr() + raw.numel()

    def owned(part: torch.Tensor | None) -> torch.Tensor | None:
        inside = part is not None and start <= part.untyped_storage().data_ptr() < end
        return part.clone() if inside else part

    return Blocks(blocks.kind, owned(blocks.codes), owned(blocks.scales), owned(blocks.minima))


TRIM_AFTER_BYTES = 16 << 20
"""After a tensor this large, the converter's temporary buffers go back to the system
at once. glibc keeps freed buffers of up to 32 MB for reuse, and a large file's
tensor-by-tensor conversion would leave many of them behind, raising the peak RSS."""

