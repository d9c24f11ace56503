"""The one table of block types: the GGUF types the loader reads and the kernel forms
they are read into, with the codes the C kernels know them by.

Python reads it through the derived dicts below (gguf_tensors.py, block_formats.py,
int8_blocks.py, native.py import them from here); C reads `block_types.h`, written
from this table (`python -m engine.kernels.block_types` rewrites it;
tests/engine/test_block_types.py fails when the two differ). Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GgufType:
    """A GGUF block type: its name, the file's type id (ggml's), weights and bytes per
    block, the kernel form it is read into, block_parse.c's code for it, and the
    int8-activation form that keeps the file's width where the build's int8 loop has
    a tile for it (None: the int8 form of `form` serves; see int8_blocks.py)."""

    name: str
    ggml_type: int
    weights: int
    bytes: int
    form: str
    code: int
    int8_at_width: str | None = None


@dataclass(frozen=True)
class KernelForm:
    """A form the block kernels multiply: its name, block_gemm's code and C name
    (kernels.h), the weights one scale covers, whether it has minima, the
    int8-activation form it is repacked into (None: it is one), and the bits a code
    takes in memory (4: two codes a byte, the low nibbles first in each block)."""

    name: str
    code: int
    c_name: str
    scale_group: int
    minima: bool
    int8_form: str | None
    code_bits: int
    bytes_per_256: int
    """Bytes 256 weights take in memory, codes, scales and minima together: what a
    token reads of them (docs/cpu-kernels.md, "Memory layout")."""
    super_block: int = 0
    """Weights per super-block whose fp32 scales the block's integer scales multiply
    (0: every block holds fp32 scales); with minima a super-block holds two (d, dmin)."""
    panels: bool = True
    """block_panels.c has tiles for it: it serves steps of any row count."""
    scale_bits: int = 32
    """32: fp32 scales and minima; 16: the file's fp16 ones, widened in the kernel."""
    implied_minimum: int = 0
    """Where not 0, a block's minimum is this times its scale, formed in the kernel and
    not stored (the forms of GGUF's types without minima)."""


GGUF_TYPES = (
    GgufType("Q4_0", 2, 32, 18, "Q4_1", 1, "I8_Q4_0"),
    GgufType("Q4_1", 3, 32, 20, "Q4_1", 2, "I8_Q4_1"),
    GgufType("Q5_0", 6, 32, 22, "Q8_0", 3, "I8_Q8_0"),
    GgufType("Q5_1", 7, 32, 24, "Q5_1", 4),
    GgufType("Q8_0", 8, 32, 34, "Q8_0", 5, "I8_Q8_0"),
    GgufType("Q4_K", 12, 256, 144, "Q4_1", 6, "I8_Q4K"),
    GgufType("Q5_K", 13, 256, 176, "Q5_1", 7),
    GgufType("Q6_K", 14, 256, 210, "Q8_16", 8, "I8_Q6K"),
)
"""Every GGUF block type read here; the K types' blocks are super-blocks of 256."""

KERNEL_FORMS = (
    KernelForm("Q4_1", 1, "BLOCKS_Q4", 32, True, "I8_Q4", 4, 192),
    KernelForm("Q8_0", 2, "BLOCKS_Q8", 32, False, "I8_U8", 8, 288),
    KernelForm("Q8_16", 3, "BLOCKS_Q8_HALVES", 16, False, "I8_U8_16", 8, 320),
    KernelForm("Q5_1", 4, "BLOCKS_Q5", 32, True, "I8_U8", 8, 320, panels=False),
    KernelForm("I8_Q4", 5, "BLOCKS_I8_Q4", 32, True, None, 4, 192),
    KernelForm("I8_U8", 6, "BLOCKS_I8_U8", 32, True, None, 8, 320),
    KernelForm("I8_U8_16", 7, "BLOCKS_I8_U8_HALVES", 16, True, None, 8, 384),
    KernelForm("I8_Q4K", 8, "BLOCKS_I8_Q4K", 32, True, None, 4, 152, 256),
    KernelForm("I8_Q6K", 9, "BLOCKS_I8_Q6K", 16, False, None, 6, 212, 256),
    KernelForm("I8_Q4_0", 10, "BLOCKS_I8_Q4_0", 32, True, None, 4, 144, scale_bits=16,
               implied_minimum=-8),
    KernelForm("I8_Q4_1", 11, "BLOCKS_I8_Q4_1", 32, True, None, 4, 160, scale_bits=16),
    KernelForm("I8_Q8_0", 12, "BLOCKS_I8_Q8_0", 32, True, None, 8, 272, scale_bits=16,
               implied_minimum=-128),
)
"""Q4_1: 4-bit codes, a scale and a minimum per 32 (GGUF's Q4_0, Q4_1, Q4_K); Q8_0:
int8 codes and a scale per 32 (Q8_0, Q5_0); Q8_16: int8 codes and a scale per 16
(Q6_K); Q5_1: codes 0..31 a byte each with a scale and minimum per 32 (Q5_1, Q5_K);
the I8_* forms of dtype int8-activations (block_int8.c's header): I8_Q4K and I8_Q6K
keep Q4_K's and Q6_K's widths (integer sub-scales under fp32 super-block scales),
I8_Q4_0, I8_Q4_1 and I8_Q8_0 those of GGUF's types of one fp16 scale a block (Q5_0's
codes take I8_Q8_0's bytes)."""

GGML_TYPES = {t.ggml_type: (t.name, t.weights, t.bytes) for t in GGUF_TYPES}
"""ggml type id -> (name, weights per block, bytes per block)."""
BYTES_PER_BLOCK = {t.name: t.bytes for t in GGUF_TYPES}
FORM_OF = {t.name: t.form for t in GGUF_TYPES}
"""GGUF type -> the kernel form it is read into."""
PARSE_CODES = {t.name: t.code for t in GGUF_TYPES}
"""GGUF type -> block_parse.c's code (parse_gguf_rows)."""
BLOCK_KINDS = {form.name: form.code for form in KERNEL_FORMS}
"""Kernel form -> block_gemm's code."""
INT8_FORM_OF = {form.name: form.int8_form for form in KERNEL_FORMS if form.int8_form}
"""Kernel form -> the int8-activation form it is repacked into."""
INT8_AT_WIDTH = {t.name: t.int8_at_width for t in GGUF_TYPES if t.int8_at_width}
"""GGUF type -> the int8-activation form that keeps its width."""
FORMS = {form.name: form for form in KERNEL_FORMS}
"""Kernel form name -> its traits."""

HEADER = Path(__file__).with_name("block_types.h")


def c_header() -> str:
    """block_types.h's text: the C codes of the kernel forms and GGUF types."""
    lines = ["/* Written from engine/kernels/block_types.py (python -m engine.kernels.block_types):",
             " * the codes of the kernel forms (block_gemm's kind) and of the GGUF types",
             " * (parse_gguf_rows' type). Edit the table there, not this file. */",
             "#ifndef KVSERVE_BLOCK_TYPES_H", "#define KVSERVE_BLOCK_TYPES_H", ""]
    lines += [f"#define {form.c_name} {form.code}   /* {form.name} */" for form in KERNEL_FORMS]
    lines.append("")
    lines += [f"#define GGUF_{t.name} {t.code}" for t in GGUF_TYPES]
    by_code = {t.code: t for t in GGUF_TYPES}
    codes = range(max(by_code) + 1)
    lines += ["", f"#define BLOCKS_FIRST {min(f.code for f in KERNEL_FORMS)}",
              f"#define BLOCKS_LAST {max(f.code for f in KERNEL_FORMS)}",
              f"#define GGUF_FIRST {min(by_code)}", f"#define GGUF_LAST {max(by_code)}",
              "/* per GGUF code: weights and bytes of one of its blocks */",
              "#define GGUF_BLOCK_WEIGHTS {"
              + ", ".join(str(by_code[c].weights if c in by_code else 0) for c in codes) + "}",
              "#define GGUF_BLOCK_BYTES {"
              + ", ".join(str(by_code[c].bytes if c in by_code else 0) for c in codes) + "}"]
    forms = {form.code: form for form in KERNEL_FORMS}
    form_codes = range(max(forms) + 1)

    def per_form(name: str, value) -> str:
        return (f"#define {name} {{"
                + ", ".join(str(value(forms[c]) if c in forms else 0) for c in form_codes) + "}")

    lines += ["/* per form code: the bits of a scale (16: fp16 scales and minima), and the",
              " * multiple of the scale that is a block's minimum where none is stored */",
              per_form("FORM_SCALE_BITS", lambda form: form.scale_bits),
              per_form("FORM_IMPLIED_MINIMUM", lambda form: form.implied_minimum)]
    lines += ["", "#endif", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    HEADER.write_text(c_header())
    print(f"wrote {HEADER}")
