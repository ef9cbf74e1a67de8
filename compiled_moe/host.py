"""The C++ host layer (``csrc/host/``): eager calls from the dispatcher to the driver without
Python.

It registers C++ kernels for ops the Python package defines (their autograd formula and
argument checks for every device, their CUDA kernel), encodes TMA descriptors and launches the
NVRTC-compiled kernels of ``csrc/*.cu`` on torch's current stream. Python keeps the schemas,
fake functions, traced bodies (what torch.compile sees), the CPU reference, and the choices made
once per problem shape (whether a kernel applies, its tile plan), which the C++ side asks for on
its first call at a shape and keeps.

Built at first use with torch's C++ extension builder into an on-disk cache keyed by the
sources, the torch version and the Python version (``COMPILED_MOE_CACHE_DIR``, default
``~/.cache/compiled_moe``), as the NVRTC cubins are: a wheel of compiled code would have to
match each torch release's C++ ABI (2.11-2.15 here), and a build at install time would need
the compiler at ``pip install`` and again for every torch upgrade. It needs a C++ compiler and
ninja, nothing of a CUDA toolkit: ``cuda.h`` comes from the ``nvidia-cuda-runtime`` wheel that
GPU builds of torch install (or ``CUDA_HOME``), and libcuda is opened at run time. Without
``cuda.h`` the layer builds without its CUDA kernels (checks and autograd only).

``COMPILED_MOE_HOST=0`` turns it off and ``=1`` on; by default it is on where torch is a CUDA
build. Where it cannot be built, importing the package warns once; CPU tensors then take the
Python ops, and on a GPU the ops whose kernels it launches raise (``missing``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

_NAME = "compiled_moe_host"


def enabled() -> bool:
    setting = os.environ.get("COMPILED_MOE_HOST")
    if setting is not None:
        return setting not in ("0", "")
    return torch.version.cuda is not None


def source_dir() -> Path:
    from compiled_moe.native import csrc_dir

    return csrc_dir() / "host"


def sources() -> list[Path]:
    return sorted(source_dir().glob("*.cpp"))


def cuda_include_dir() -> str | None:
    """The directory holding cuda.h: the nvidia-cuda-runtime wheel's (CUDA 13: nvidia/cu13,
    CUDA 12: nvidia/cuda_runtime), else CUDA_HOME's; None if there is none."""
    candidates = []
    try:
        import nvidia

        for root in nvidia.__path__:
            candidates += [Path(root) / "cu13" / "include", Path(root) / "cuda_runtime" / "include"]
    except ImportError:
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for d in candidates:
        if (d / "cuda.h").is_file():
            return str(d)
    return None


def build_dir() -> Path:
    """Where the build goes: one directory per sources, torch and Python version."""
    digest = hashlib.sha256()
    # The layer's sources, and the kernels' argument structs it includes (csrc/*.cuh).
    for path in sorted(source_dir().glob("*")) + sorted(source_dir().parent.glob("*.cuh")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(str(cuda_include_dir()).encode())
    root = os.environ.get("COMPILED_MOE_CACHE_DIR")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "compiled_moe")
    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / "host" / f"{tag}-{digest.hexdigest()[:16]}"


def build(verbose: bool = False):
    """Compile (or load from the cache) and import the extension module."""
    from torch.utils import cpp_extension

    include = cuda_include_dir()
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    fresh = not (directory / f"{_NAME}.so").exists()
    if fresh:  # a first import would otherwise pause silently
        print(f"compiled_moe: building the C++ host layer into {directory} (once per torch "
              f"version and source change)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    module = cpp_extension.load(
        name=_NAME, sources=[str(s) for s in sources()], build_directory=str(directory),
        extra_cflags=["-O2"], extra_include_paths=[include] if include else [],
        extra_ldflags=["-ldl"], verbose=verbose)
    if fresh:
        print(f"compiled_moe: C++ host layer built in {time.perf_counter() - start:.0f} s "
              "(the CUDA kernels compile at their first use, each once)", file=sys.stderr, flush=True)
    return module


def _handle(source: str, name: str, dev: int) -> int:
    from compiled_moe import native

    return native.function_handle(native.kernel(source, name, dev), dev)


def route_kernels(dev: int) -> dict:
    """The layer's question, once per device: {name: handle} of the route kernels
    (csrc/moe_route.cu; csrc/host/kernels.h's RouteKernels reads them by name)."""
    names = [f"moe_route_{step}_{ids}" for step in ("rank", "place") for ids in ("i32", "i64")]
    return {name: _handle("moe_route", name, dev) for name in names}


@functools.lru_cache(maxsize=None)
def plan_fields() -> dict[str, tuple[tuple[str, str], ...]]:
    """{plan name: ((C++ type, field name), ...)} of csrc/host/plans.h, the one definition of
    the plans Python hands the layer."""
    text = (source_dir() / "plans.h").read_text()
    lists = {m.group(1): re.findall(r"F\((\w+), (\w+)\)", m.group(2))
             for m in re.finditer(r"#define (COMPILED_MOE_\w+_PLAN)\(F\)((?:.*\\\n)*.*)", text)}
    plans = re.search(r"#define COMPILED_MOE_PLANS\(PLAN\)((?:.*\\\n)*.*)", text).group(1)
    return {name: tuple(lists[fields]) for name, fields in re.findall(r"PLAN\((\w+), (\w+)\)", plans)}


@functools.lru_cache(maxsize=None)
def plan_type(name: str) -> type:
    """The NamedTuple of plan `name`, its fields in csrc/host/plans.h's order. Build it by
    keyword: the fields are the layer's, read there by name."""
    return NamedTuple(name, [(field, int) for _, field in plan_fields()[name]])


def row_kernel_names() -> list[str]:
    """The kernels of csrc/moe_rows.cu (its ``extern "C"`` functions), which the layer reads
    by name (csrc/host/kernels.h's RowKernels)."""
    from compiled_moe.native import csrc_dir

    text = (csrc_dir() / "moe_rows.cu").read_text()
    return re.findall(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(\w+)\(', text)


def row_kernels(dev: int) -> dict | None:
    """The layer's question, once per device: {name: handle} of the row kernels
    (csrc/moe_rows.cu) and "sms", the SM count; None before sm_80, where they do not compile
    (bf16 conversions) and the row ops' Python kernels serve."""
    from compiled_moe.kernels.grouped_mm import _num_sms

    if torch.cuda.get_device_capability(dev) < (8, 0):
        return None
    return {**{name: _handle("moe_rows", name, dev) for name in row_kernel_names()},
            "sms": _num_sms(dev)}


@functools.lru_cache(maxsize=None)
def module():
    """The loaded extension, or None (switched off, or it could not be built: warned once)."""
    if not enabled():
        return None
    try:
        m = build()
        m.register_kernels(route_kernels, row_kernels)
        return m
    except Exception as e:  # no compiler, no ninja, a failed build
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"compiled_moe: the C++ host layer could not be built ({first_line}); CPU "
                      f"tensors take the Python ops, and on a GPU the ops whose kernels it "
                      f"launches will raise. Set COMPILED_MOE_HOST=0 to silence this.", stacklevel=2)
        return None


def cuda_module():
    """The extension where it has its CUDA kernels, else None."""
    m = module()
    return m if m is not None and m.has_cuda else None


def missing(name: str) -> RuntimeError:
    """The error of an op called on CUDA where this layer, which launches its CUDA kernels, is
    not loaded (one clear error rather than a slower second launcher to keep equal)."""
    from compiled_moe import native

    if not enabled():
        why = "COMPILED_MOE_HOST=0 turned it off"
    elif module() is None:
        why = "it could not be built: see the warning at import"
    elif not native.available():
        why = "cuda-python (NVRTC) is not installed"
    else:
        why = "torch has no CUDA support in it"
    return RuntimeError(
        f"torch.ops.compiled_moe.{name} runs its CUDA kernels through compiled_moe's C++ layer "
        f"(csrc/host), which is not loaded here ({why}). It needs a C++ compiler, ninja and "
        "cuda-python: pip install 'compiled-moe[cuda]' and a g++ or clang++ on PATH, with "
        "COMPILED_MOE_HOST unset")


def require_cuda_module(name: str):
    """The extension that launches op `name`'s CUDA kernels; raises ``missing(name)`` where it
    is not loaded."""
    m = cuda_module()
    if m is None:
        raise missing(name)
    return m
