"""A GGUF file's weights under transformers' names, read in place: no conversion
through a transformers model, no copy written to disk.

Each tensor of the file (tensor table: gguf_tensors.py) is matched to its
transformers name by gguf-py's tensor-name map, as transformers' own GGUF loader
matches them (`get_gguf_hf_weights_map` over the model's parameter names, taken
from a model built on the meta device), and passed through the same per-architecture
processor (llama.cpp stores Llama's q and k rows permuted for its RoPE layout, Gemma's
norms as 1 + weight). Then:

- tensors of a type the block kernels read (block_formats.py) become `Blocks`, with
  the processor's row order applied to the blocks' rows; a dense value is made only
  for a weight the model needs dense (`dense_state`): the blocks dequantized, which
  equal gguf-py's dequantization bit for bit (block_formats.py);
- every other tensor (F32 norms, F16 or BF16 weights, K types the kernels do not
  read) is dequantized by gguf-py and processed as transformers processes it.

Whether a processor only reorders a tensor's rows is asked of the processor itself:
it processes a column of row indices, and the answer is either a permutation of them
(applied to the blocks) or not (the tensor is dequantized instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..loading import return_freed_memory
from .block_formats import Blocks, parse_blocks
from .gguf_tensors import GGUFTensor, read_gguf_file


@dataclass
class GGUFCheckpoint:
    dense: dict[str, torch.Tensor]
    """transformers name -> fp32 tensor, for the tensors not held as blocks."""
    blocks: dict[str, Blocks] = field(default_factory=dict)
    """transformers name -> the weight as kernel blocks, for the tensors of a type the
    block kernels read (projections, embeddings, LM head)."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """transformers name -> the tensor's shape, for the blocks."""

    def dense_state(self, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Every tensor as a dense fp32 value (blocks dequantized: gguf-py's values bit
        for bit) but those in `skip`, which the model serves from their blocks."""
        state = dict(self.dense)
        for name, blocks in self.blocks.items():
            if name not in skip:
                state[name] = blocks.dequantize().reshape(self.shapes[name])
        return state


def _processing(architecture: str, config: Any):
    """(transformers' tensor processor for this architecture, GGUF name -> HF name).
    The names are mapped as transformers maps them, in one pass over the parameter
    names (transformers' own `get_gguf_hf_weights_map` rebuilds gguf-py's name table
    for every submodule, and that dominated reading the default model's weights)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ValueError(f"gguf-py knows no architecture {architecture!r}")
    table = get_tensor_name_map(arch, config.num_hidden_layers)
    with torch.device("meta"):
        names_model = AutoModelForCausalLM.from_config(config)
    mapping = {}
    for hf_name in names_model.state_dict():
        stem, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        gguf_name = table.get_name(stem) if suffix in ("weight", "bias") else None
        if gguf_name is not None:
            mapping[f"{gguf_name}.{suffix}"] = hf_name
    return processor, mapping


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


def read_gguf_checkpoint(path: Path, config: Any) -> GGUFCheckpoint:
    """The weights of `path` for a model of `config` (the config the file's metadata
    gives). Tensors the model has no parameter for are skipped, as transformers skips
    them."""
    gguf_file = read_gguf_file(path)
    processor, mapping = _processing(gguf_file.architecture, config)
    checkpoint = GGUFCheckpoint({})
    for tensor in gguf_file.tensors:
        name = mapping.get(tensor.name)
        if name is not None:
            _read_tensor(checkpoint, name, tensor, processor, mapping)
            gguf_file.drop_pages(tensor)
            if tensor.data.nbytes >= TRIM_AFTER_BYTES:
                return_freed_memory()
    return_freed_memory()
    return checkpoint


def _read_tensor(checkpoint: GGUFCheckpoint, name: str, tensor: GGUFTensor, processor,
                 mapping: dict) -> None:
    order = _row_order(processor, tensor, mapping) if tensor.kind is not None else None
    if order is None:
        checkpoint.dense[name] = _dequantized(processor, tensor, mapping)
        return
    blocks = parse_blocks(tensor.kind, torch.from_numpy(tensor.data.copy()))
    if not torch.equal(order, torch.arange(order.shape[0])):
        blocks = blocks.rows(order)
    checkpoint.blocks[name] = blocks
    checkpoint.shapes[name] = tensor.shape


TRIM_AFTER_BYTES = 16 << 20
"""After a tensor this large, the converter's temporary buffers go back to the system
at once. glibc keeps freed buffers of up to 32 MB for reuse, and a large file's
tensor-by-tensor conversion would leave many of them behind, raising the peak RSS."""

