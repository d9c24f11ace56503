"""Native CPU kernels compiled at run time (see build.py); every one is optional."""

from .build import NativeKernels, load_native_kernels

__all__ = ["NativeKernels", "load_native_kernels"]
