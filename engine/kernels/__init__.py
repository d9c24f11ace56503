"""Native CPU kernels compiled at run time (see build.py); every one is optional."""

from .build import BlockKernels, load_block_kernels

__all__ = ["BlockKernels", "load_block_kernels"]
