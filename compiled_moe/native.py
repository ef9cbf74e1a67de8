"""CUDA C++ kernels of ``csrc/``: compiled at run time by NVRTC through cuda-python.

No build step and no CUDA toolkit: ``cuda.core`` compiles a source file for the GPU's
architecture, the cubin is cached on disk (keyed by source, architecture, options and the
NVRTC version), and kernels launch on torch's current stream, so they are ordered with torch's
work and can be captured in CUDA graphs. Imported lazily: ``import compiled_moe`` needs no
cuda-python.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import hashlib
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

# A wheel ships the sources inside the package; a source checkout has them beside it.
_CSRC_DIRS = (Path(__file__).resolve().parent / "csrc", Path(__file__).resolve().parent.parent / "csrc")
_OPTIONS = dict(std="c++17")
# Sources that use Hopper's arch-specific instructions (wgmma, setmaxnreg): compiled for sm_90a,
# which runs only on sm_90 parts.
_ARCH_SPECIFIC = {"fp8_grouped_mm", "grouped_mm"}


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


@functools.lru_cache(maxsize=None)
def launch_constants() -> dict[str, int]:
    """csrc/sm90_launch.cuh's constants ({name: value}): what the Hopper GEMMs' launches must
    agree on with their kernels, defined once there for the kernels, the C++ layer and here."""
    values: dict[str, int] = {}
    text = (csrc_dir() / "sm90_launch.cuh").read_text()
    for name, expr in re.findall(r"^constexpr int (\w+) = ([^;]+);", text, re.M):
        values[name] = _integer_expression(expr, values)
    return values


def _integer_expression(expr: str, names: dict[str, int]) -> int:
    """An integer expression of C (+, -, *, / toward zero, parentheses, earlier names)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _C_OPERATORS:
            return _C_OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"sm90_launch.cuh: not an integer expression of known names: {expr!r}")
    return value(ast.parse(expr.replace("/", "//"), mode="eval").body)


_C_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
                ast.Mult: lambda a, b: a * b,
                ast.FloorDiv: lambda a, b: abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)}


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


def _program_options(path: Path, arch: str, **extra):
    from cuda.core import ProgramOptions

    # Sources include the shared headers of their own directory (csrc/*.cuh).
    return ProgramOptions(name=path.name, arch=arch, include_path=[str(path.parent)], **_OPTIONS, **extra)


def compile_source(path: Path, arch: str) -> bytes:
    """Compile one .cu file to a cubin for ``arch`` (e.g. "sm_90"), through the on-disk cache."""
    from cuda.core import Program

    source = path.read_bytes()
    headers = [h.read_bytes() for h in sorted(path.parent.glob("*.cuh"))]
    key = hashlib.sha256(b"\0".join([source, *headers, arch.encode(),
                                     repr(sorted(_OPTIONS.items())).encode(),
                                     _nvrtc_version().encode()])).hexdigest()
    cached = cache_dir() / f"{path.stem}-{arch}-{key[:32]}.cubin"
    if cached.exists():
        return cached.read_bytes()
    # A first use compiles each source the process needs once (then it is cached for every later
    # process): say which, and how long it took, rather than pause silently.
    print(f"compiled_moe: compiling csrc/{path.name} for {arch} with NVRTC (first use; cached "
          f"under {cache_dir()})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    options = _program_options(path, arch)
    cubin = bytes(Program(source.decode(), "c++", options=options).compile("cubin").code)
    print(f"compiled_moe: csrc/{path.name} compiled in {time.perf_counter() - start:.1f} s",
          file=sys.stderr, flush=True)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cached.parent, delete=False) as f:  # atomic publish
        f.write(cubin)
    os.replace(f.name, cached)
    return cubin


def ptxas_report(path: Path, arch: str) -> str:
    """ptxas's verbose log for one source (registers, spills, and its performance warnings,
    such as wgmma serialization); not cached."""
    import io

    from cuda.core import Program

    options = _program_options(path, arch, ptxas_options=["-v"])
    log = io.StringIO()
    Program(path.read_text(), "c++", options=options).compile("cubin", logs=log)
    return log.getvalue()


def device_arch(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def source_arch(path: Path, arch: str) -> str:
    """The target a source compiles for on a device of ``arch``: sm_90a for the Hopper-only ones."""
    return f"{arch}a" if path.stem in _ARCH_SPECIFIC else arch


TMA_ALIGN = 16  # TMA: base addresses and strides, in bytes


@functools.lru_cache(maxsize=None)
def hopper(device_index: int) -> bool:
    """The device runs the sm_90a kernels (an H100/H200) and NVRTC is there to build them."""
    return torch.cuda.get_device_capability(device_index) == (9, 0) and available()


def tma_aligned(*tensors) -> bool:
    """Every tensor's address suits a TMA descriptor (checked at launch: fake tensors under
    torch.compile have no address)."""
    return all(t.data_ptr() % TMA_ALIGN == 0 for t in tensors)


_thread = threading.local()


def _ensure_context(device_index: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread, once per
    thread and device. A driver-API call runs on the calling thread's current context, and a
    thread that has only reused torch's cached memory may have none: autograd runs backward on
    its own thread, where a descriptor encode or a launch as the first GPU work failed with
    CUDA_ERROR_INVALID_CONTEXT."""
    done = getattr(_thread, "contexts", None)
    if done is None:
        done = _thread.contexts = set()
    if device_index in done:
        return
    from cuda.bindings import driver

    err, ctx = driver.cuDevicePrimaryCtxRetain(driver.CUdevice(device_index))
    if err == driver.CUresult.CUDA_SUCCESS:
        err, = driver.cuCtxSetCurrent(ctx)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"making device {device_index}'s primary context current failed: {err}")
    done.add(device_index)


def driver_entry(fn):
    """Every function of this module that calls the driver (module loads, attribute and
    occupancy queries, descriptor encodes, launches) goes through this: the current device's
    primary context is made current on the calling thread first (about 0.2 us once done).
    Under an lru_cache it runs on cache misses only, which are the calls that reach the driver."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _ensure_context(torch.cuda.current_device())
        return fn(*args, **kwargs)

    return call


@functools.lru_cache(maxsize=None)
@driver_entry
def _module(name: str, device_index: int):
    from cuda.core import ObjectCode

    path = csrc_dir() / f"{name}.cu"
    cubin = compile_source(path, source_arch(path, device_arch(device_index)))
    return ObjectCode.from_cubin(cubin)


@functools.lru_cache(maxsize=None)
@driver_entry
def kernel(name: str, function: str, device_index: int):
    """The ``extern "C"`` kernel ``function`` of ``csrc/<name>.cu``, loaded on a device."""
    return _module(name, device_index).get_kernel(function)


def int32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(v)


def int64(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(v)


def _current_raw_stream(device_index: int) -> int:
    # torch's private accessor (the one Triton and inductor launch with) costs ~1 us against
    # ~7 us for torch.cuda.current_stream().cuda_stream (H200 host).
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(device_index) if get is not None else torch.cuda.current_stream(device_index).cuda_stream


# ---------------------------------------------------------------------------------------------
# Launches from Python, through the driver API (cuda.bindings, stable across cuda.core
# releases). The C++ layer (csrc/host) launches the GEMM, route and row kernels; what launches
# here is what a compiled graph calls back into Python for (the columnwise quantize kernels).


@functools.lru_cache(maxsize=None)
@driver_entry
def _driver_function(function, device_index: int):
    """The kernel as a driver handle, allowed all the dynamic shared memory a block can have."""
    from cuda.bindings import driver

    kernel = driver.CUkernel(int(function.handle))
    attr = driver.CUfunction_attribute
    err, optin = driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        driver.CUdevice(device_index))
    if err == driver.CUresult.CUDA_SUCCESS:
        err, static = driver.cuKernelGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kernel,
                                                  driver.CUdevice(device_index))
    if err == driver.CUresult.CUDA_SUCCESS:
        err, = driver.cuKernelSetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           optin - static, kernel, driver.CUdevice(device_index))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"raising the kernel's dynamic shared memory limit failed: {err}")
    return driver.CUfunction(int(function.handle))


def function_handle(function, device_index: int) -> int:
    """A kernel's CUfunction handle as an int (for the C++ host layer and launch_function),
    allowed all the dynamic shared memory a block can have."""
    return int(_driver_function(function, device_index))


@functools.lru_cache(maxsize=None)
@driver_entry
def max_active_clusters(function, block: int, shared_bytes: int, grid: int) -> int:
    """How many clusters of a kernel compiled with __cluster_dims__ fit on the device at once: a
    persistent grid must not ask for more (the rest would run after the first ones finish). A
    cluster's CTAs share a GPC, so with one CTA per SM this can be below SMs / cluster size."""
    from cuda.bindings import driver

    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes = shared_bytes
    config.hStream = driver.CUstream(_current_raw_stream(torch.cuda.current_device()))
    config.numAttrs = 0
    err, count = driver.cuOccupancyMaxActiveClusters(_driver_function(function, torch.cuda.current_device()),
                                                     config)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed: {err}")
    return int(count)


@functools.lru_cache(maxsize=None)
def _driver():
    """cuda.bindings.driver, imported once: an import statement in a launcher costs about a
    microsecond per call (importlib's from-list handling)."""
    from cuda.bindings import driver

    return driver


def launch_driver(function, grid: int, block: int, shared_bytes: int, *args) -> None:
    """Launch on torch's current stream; args are ctypes values (TensorMap, c_int32, c_uint64...)
    or tensors (passed as pointers)."""
    launch_function(function_handle(function, torch.cuda.current_device()), grid, block,
                    shared_bytes, *args)


@driver_entry
def launch_function(handle: int, grid: int, block: int, shared_bytes: int, *args) -> None:
    """launch_driver with the kernel's handle (function_handle)."""
    driver = _driver()
    device_index = torch.cuda.current_device()
    values = [ctypes.c_uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args]
    pointers = (ctypes.c_void_p * len(values))(*map(ctypes.addressof, values))
    err, = driver.cuLaunchKernel(
        driver.CUfunction(handle), grid, 1, 1, block, 1, 1,
        shared_bytes, driver.CUstream(_current_raw_stream(device_index)),
        ctypes.addressof(pointers), 0)
    if err != 0:  # CUDA_SUCCESS
        raise RuntimeError(f"cuLaunchKernel failed: {err}")
