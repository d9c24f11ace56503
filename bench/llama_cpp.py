"""Build llama.cpp's `llama-server` (and `llama-quantize`, which writes the K-quant
types gguf-py cannot) for side-by-side benchmarks, from the sources inside the PyPI
sdist of `llama-cpp-python` (the only registry this kind of host reaches). Never part
of `make test`: about 15 minutes on 2 cores, once; later calls return the built binary.

    python -m bench.llama_cpp                 # prints the path of llama-server
    python -m bench.llama_cpp --tool llama-quantize
    python -m bench.startup --label llama.cpp --port 8041 --health /health -- \\
        $(python -m bench.llama_cpp) -m model.gguf --port 8041 -np 8 -c 8192 -t 2

Needs cmake, ninja and a C++ compiler. The build is native (`GGML_NATIVE`): the
binary uses this CPU's vector extensions, as kvserve's kernels do. `--no-amx` builds
without AMX tiles (in `build-no-amx/`), for hosts whose CPU lists AMX but whose
virtual machine faults on the tile instructions (llama.cpp then crashes in its first
matrix product). `--isa avx2` builds for AVX2 CPUs instead (`GGML_NATIVE=OFF` with AVX2,
FMA, F16C and BMI2, in `build-avx2/`): the llama.cpp an AVX2-only host runs, beside
kvserve's `KVSERVE_CPU_ISA=avx2`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

import httpx

DEFAULT_VERSION = "0.3.36"


def build_root() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "kvserve-bench" / "llama.cpp"


def _sdist_url(version: str) -> str:
    """The sdist's URL from PyPI's simple index, JSON form (`pip download` would build
    the sdist's build dependencies from source just to read its metadata)."""
    index = httpx.get("https://pypi.org/simple/llama-cpp-python/", timeout=60,
                      headers={"Accept": "application/vnd.pypi.simple.v1+json"},
                      follow_redirects=True).json()
    name = f"llama_cpp_python-{version}.tar.gz"
    return next(entry["url"] for entry in index["files"] if entry["filename"] == name)


TOOLS = ("llama-server", "llama-quantize")


NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"""Explicit -mno flags win over what -march=native turns on, in either order."""

AVX2_OPTIONS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"]
"""An AVX2 build's options (ggml's x86 feature switches)."""


def llama_server(version: str = DEFAULT_VERSION, jobs: int = 2,
                 tool: str = "llama-server", amx: bool = True, isa: str = "native") -> Path:
    """The path of `tool` (one of TOOLS) from llama-cpp-python `version`'s sources,
    built on first use (without AMX tiles unless `amx`; for AVX2 CPUs with isa "avx2")."""
    target = build_root() / version
    build = target / ("build-avx2" if isa == "avx2" else "build" if amx else "build-no-amx")
    binary = build / "bin" / tool
    if binary.is_file():
        return binary
    target.mkdir(parents=True, exist_ok=True)
    if not any(target.glob("llama_cpp_python-*")):
        _download(version, target)
    sources = next(target.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
    flags = [] if amx else [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]
    flags += AVX2_OPTIONS if isa == "avx2" else ["-DGGML_NATIVE=ON"]
    subprocess.run(["cmake", "-S", str(sources), "-B", str(build), "-G", "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", *flags], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(jobs)],
                   check=True)
    return binary


def _download(version: str, target: Path) -> None:
    with tempfile.TemporaryDirectory() as download:
        archive = Path(download) / "sources.tar.gz"
        archive.write_bytes(httpx.get(_sdist_url(version), follow_redirects=True,
                                      timeout=300).content)
        with tarfile.open(archive) as tar:
            tar.extractall(target, filter="data")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python version")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--tool", choices=TOOLS, default="llama-server")
    parser.add_argument("--no-amx", action="store_true", help="build without AMX tiles")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="avx2: build for AVX2 CPUs (no AVX-512), not this one")
    args = parser.parse_args(argv)
    print(llama_server(args.version, args.jobs, args.tool, amx=not args.no_amx, isa=args.isa))


if __name__ == "__main__":
    main()
