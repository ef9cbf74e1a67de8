"""CUDA C++ kernels of ``csrc/``: compiled at run time by NVRTC through cuda-python.

No build step and no CUDA toolkit: ``cuda.core`` compiles a source file for the GPU's
architecture, the cubin is cached on disk (keyed by source, architecture, options and the
NVRTC version), and kernels launch on torch's current stream, so they are ordered with torch's
work and can be captured in CUDA graphs. Imported lazily: ``import compiled_moe`` needs no
cuda-python.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import tempfile
import warnings
from pathlib import Path

import torch

# A wheel ships the sources inside the package; a source checkout has them beside it.
_CSRC_DIRS = (Path(__file__).resolve().parent / "csrc", Path(__file__).resolve().parent.parent / "csrc")
_OPTIONS = dict(std="c++17")


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """cuda-python (cuda.core with NVRTC) is installed; without it ops use their torch paths."""
    try:
        import cuda.core  # noqa: F401
    except ImportError:
        warnings.warn("compiled_moe: cuda-python is not installed, so the csrc/ kernels (routing) "
                      "fall back to pure-torch code; pip install 'compiled-moe[cuda]' for them",
                      stacklevel=3)
        return False
    return True


def csrc_dir() -> Path:
    for d in _CSRC_DIRS:
        if d.is_dir():
            return d
    raise FileNotFoundError(f"compiled_moe's csrc/ directory not found (looked in {_CSRC_DIRS})")


def source_files() -> list[Path]:
    """Every CUDA source of the package (CI compiles each of them)."""
    return sorted(csrc_dir().glob("*.cu"))


def cache_dir() -> Path:
    root = os.environ.get("COMPILED_MOE_CACHE_DIR")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "compiled_moe")
    return Path(root) / "nvrtc"


def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def compile_source(path: Path, arch: str) -> bytes:
    """Compile one .cu file to a cubin for ``arch`` (e.g. "sm_90"), through the on-disk cache."""
    from cuda.core import Program, ProgramOptions

    source = path.read_bytes()
    key = hashlib.sha256(b"\0".join([source, arch.encode(), repr(sorted(_OPTIONS.items())).encode(),
                                     _nvrtc_version().encode()])).hexdigest()
    cached = cache_dir() / f"{path.stem}-{arch}-{key[:32]}.cubin"
    if cached.exists():
        return cached.read_bytes()
    options = ProgramOptions(name=path.name, arch=arch, **_OPTIONS)
    cubin = bytes(Program(source.decode(), "c++", options=options).compile("cubin").code)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cached.parent, delete=False) as f:  # atomic publish
        f.write(cubin)
    os.replace(f.name, cached)
    return cubin


def device_arch(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def _module(name: str, device_index: int):
    from cuda.core import Device, ObjectCode

    Device(device_index).set_current()
    cubin = compile_source(csrc_dir() / f"{name}.cu", device_arch(device_index))
    return ObjectCode.from_cubin(cubin)


@functools.lru_cache(maxsize=None)
def kernel(name: str, function: str, device_index: int):
    """The ``extern "C"`` kernel ``function`` of ``csrc/<name>.cu``, loaded on a device."""
    return _module(name, device_index).get_kernel(function)


@functools.lru_cache(maxsize=None)
def _stream(handle: int):
    from cuda.core import Stream

    return Stream.from_handle(handle)


def int32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(v)


def int64(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(v)


def _current_raw_stream(device_index: int) -> int:
    # torch's private accessor (the one Triton and inductor launch with) costs ~1 us against
    # ~7 us for torch.cuda.current_stream().cuda_stream (H200 host).
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(device_index) if get is not None else torch.cuda.current_stream(device_index).cuda_stream


@functools.lru_cache(maxsize=None)
def _launch_config(grid: int, block: int, shared_bytes: int):
    from cuda.core import LaunchConfig

    return LaunchConfig(grid=grid, block=block, shmem_size=shared_bytes)


def launch(function, grid: int, block: int, shared_bytes: int, *args) -> None:
    """Launch on torch's current stream. Tensors pass as pointers; ints must be wrapped (int32/int64).

    The caller has just allocated its outputs with torch on the same device, so the device's
    primary context (which torch and cuda.core share) is current on this thread.
    """
    from cuda.core import launch as cuda_launch

    stream = _stream(_current_raw_stream(torch.cuda.current_device()))
    params = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    cuda_launch(stream, _launch_config(grid, block, shared_bytes), function, *params)
