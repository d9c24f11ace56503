"""Native CPU kernels compiled at run time (see build.py); every one is optional."""

from .build import default_kernels, load_native_kernels
from .native import NativeKernels

__all__ = ["NativeKernels", "default_kernels", "load_native_kernels"]
