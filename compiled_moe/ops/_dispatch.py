"""What every op shares: argument checks (host metadata only) and the kernel/reference choice."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch
from torch import Tensor

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# float64 runs on the reference path only (gradcheck on CPU).
OP_DTYPES = KERNEL_DTYPES + (torch.float64,)

_interpret_on_cpu = False
_trace_state = threading.local()


@contextlib.contextmanager
def tracing_kernels():
    """An op's traced body runs in here (KernelOp.register_traced): its Triton launches become
    ``wrap_triton`` nodes of the graph. Everywhere else the kernels launch directly, as a
    dispatcher kernel only ever sees real tensors."""
    old = getattr(_trace_state, "on", False)
    _trace_state.on = True
    try:
        yield
    finally:
        _trace_state.on = old


def tracing() -> bool:
    return getattr(_trace_state, "on", False)


@contextlib.contextmanager
def kernels_on_cpu():
    """Run the Triton kernels on CPU tensors (needs TRITON_INTERPRET=1): the CPU test tier."""
    global _interpret_on_cpu
    old, _interpret_on_cpu = _interpret_on_cpu, True
    try:
        yield
    finally:
        _interpret_on_cpu = old


def use_kernel(*tensors: Tensor) -> bool:
    """True when the Triton kernels serve these tensors; the reference serves the rest."""
    t = tensors[0]
    if any(x.dtype == torch.float64 for x in tensors):
        return False
    if t.device.type == "cuda":
        return True
    return _interpret_on_cpu and t.device.type == "cpu"


def is_real_tensor(t: Tensor) -> bool:
    """t holds data: not a fake or functional tensor of a trace."""
    return type(t) is Tensor or type(t) is torch.nn.Parameter


def on_tensor_device(op_body):
    """Run an op's body with its first argument's GPU current, as ATen's CUDA ops do through
    their generated device guard, which Python-registered ops do not get.

    The Triton launcher and the NVRTC launchers (compiled_moe.native) take the current
    device's stream and context; tensors on another GPU (Hugging Face's device_map="auto"
    puts layers on several GPUs of one process) would otherwise be launched on the wrong
    one. The common case (already current) costs one device query; traced tensors (fake or
    functional) launch nothing and pass straight through.
    """
    @functools.wraps(op_body)
    def body(*args, **kwargs):
        t = args[0]
        if (t.device.type == "cuda" and is_real_tensor(t)
                and t.device.index != torch.cuda.current_device()):
            with torch.cuda.device(t.device):
                return op_body(*args, **kwargs)
        return op_body(*args, **kwargs)

    # torch.library infers the schema from the signature, evaluating string annotations in
    # the function's module; give it the body's annotations already evaluated.
    body.__signature__ = inspect.signature(op_body, eval_str=True)
    return body


_LIBRARY = torch.library.Library("compiled_moe", "FRAGMENT")
_KERNEL_OPS: dict = {}  # name -> KernelOp
_DISPATCH_KEYS = {"cuda": "CUDA", "cpu": "CPU"}


class KernelOp:
    """An op registered by kernel_op: call it, or register its fake as with custom_op."""

    def __init__(self, name: str, body):
        self.qualname, self._body = f"compiled_moe::{name}", body
        self.host_keys = frozenset()  # dispatch keys whose kernels the C++ host layer registered
        self._kernel = body
        functools.update_wrapper(self, body)

    def __call__(self, *args, **kwargs):
        return self._body(*args, **kwargs)

    def register_fake(self, fake):
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        return fake

    def register_autograd(self, backward, *, setup_context=None):
        """The op's autograd formula, as custom_op's register_autograd (for ops registered with
        autograd="formula"). Where the C++ host layer registered the op's kernels, its C++ copy
        of the formula serves instead (one dispatcher layer, no Python)."""
        if "Autograd" in self.host_keys:
            return
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context,
                                        lib=_LIBRARY)

    def register_traced(self, traced):
        """What torch.compile's graph holds instead of the opaque op: ``traced`` runs under
        AOTAutograd's functional trace, as a triton_op's body does, so inductor sees the Triton
        kernels it launches (and launches them itself, from C++ under cpp_wrapper). Eager
        calls keep the plain kernel, without triton_op's custom_op wrapper. ``traced`` returns
        NotImplemented to keep the opaque op; torch.export always keeps it, as for triton_ops.

        The rule is registered for FunctionalTensorMode, a class of a private torch module:
        torch.library's only public form of this rule is triton_op, whose custom_op layers
        cost an eager call about 20 us of host time (see kernel_op). torch's own triton_op
        registers the same rule for the same class; tests/test_lowering.py's
        test_kernel_op_traced_body runs it on every torch version CI installs (2.11, 2.15).
        """
        from torch._subclasses.functional_tensor import FunctionalTensorMode

        def rule(mode, op, types, args, kwargs):
            if not torch.compiler.is_exporting():
                with mode, tracing_kernels():
                    out = traced(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            return mode.__torch_dispatch__(op, types, args, kwargs)

        torch.library.register_torch_dispatch(self.qualname, FunctionalTensorMode, rule,
                                              lib=_LIBRARY)
        return traced


def kernel_op(name: str, *, device_types=("cuda",), traced: bool = False,
              autograd: str = "raise", host=None):
    """Register the decorated function as ``torch.ops.compiled_moe.<name>``, an op without
    mutation whose kernel on ``device_types`` is the function itself.

    Every op of the package without a mutated argument: their calls sit on a MoE block's host
    path. torch.library.custom_op (and triton_op, a custom_op) wraps its kernel in an autograd
    layer, an aliasing check and dynamo's disable; a kernel_op has only the autograd layer it
    asks for. Same-process A/Bs on the H200's host (medians of 5 rounds, us per eager call,
    custom_op against kernel_op): grouped_mm_sm90 66.3 against 44.0 (its body alone 37.6);
    moe_route 79.6 against 48.4 on one machine, 59.1 against 53.0 on another. Ops that mutate
    an argument stay custom_ops/triton_ops (custom_op bumps its version counter).

    traced: the body also runs under AOTAutograd's functional trace (``register_traced``), as
        a triton_op's body does: compiled graphs see and launch the Triton kernels it launches
        through ``wrap_triton``. Eager calls launch them directly, as triton_op's do.
    autograd: "raise": a backward through the op raises, as through a custom_op without an
        autograd formula (torch's fallback for ops without one warns and drops the gradient);
        "formula": the op registers its own (``register_autograd``); "none": no autograd layer,
        whose Python call costs about 10 us of host time: for ops without float inputs (the
        route) and the CUDA kernels' ops, which other ops' bodies call below autograd and
        compiled graphs call as opaque nodes.
    host: ``host(module)`` registers the op's kernels of the C++ host layer (compiled_moe.host)
        and returns the dispatch keys it took ("Autograd": the formula and checks for every
        device; "CUDA": the kernel, where the layer has CUDA). Where the layer loads, those
        replace the Python ones; elsewhere the Python ones serve.
    """
    if autograd not in ("raise", "formula", "none"):
        raise ValueError(f"autograd must be 'raise', 'formula' or 'none', got {autograd!r}")

    def register(body) -> KernelOp:
        _LIBRARY.define(name + torch.library.infer_schema(body, mutates_args=()))
        op = _KERNEL_OPS[name] = KernelOp(name, body)
        host_module = host_layer() if host is not None else None
        if host_module is not None:
            op.host_keys = frozenset(host(host_module))
        for device_type in device_types:
            if _DISPATCH_KEYS[device_type] not in op.host_keys:
                _LIBRARY.impl(name, op._kernel, _DISPATCH_KEYS[device_type])
        if traced:
            op.register_traced(body)
        if autograd == "raise":
            op.register_autograd(functools.partial(_no_backward, name))
        return op

    return register


def host_row_op(name: str):
    """kernel_op's ``host`` for the row ops whose CUDA kernel the C++ host layer has
    (csrc/host/rows.cpp): its checks and the launch of csrc/moe_rows.cu's kernels; the op's
    Python kernel serves what those do not take (float64, GPUs before sm_80: see
    host_rows_serve). Needs NVRTC (cuda-python) for the kernels."""
    def register(module) -> list[str]:
        from compiled_moe import native

        if not (module.has_cuda and native.available()):
            return []
        return module.register_row_op(name, lambda *args: _KERNEL_OPS[name]._kernel(*args))

    return register


def host_rows_serve(t: Tensor) -> bool:
    """Whether the C++ layer's row kernels (csrc/moe_rows.cu) are the kernel for t: a CUDA
    tensor, not float64, on sm_80 or later. They are their ops' only CUDA kernels, eager and
    compiled; the ops' Python kernels serve the rest with the reference."""
    return (t.device.type == "cuda" and t.dtype != torch.float64
            and torch.cuda.get_device_capability(t.device) >= (8, 0))


def host_layer():
    """The C++ host layer's module (compiled_moe.host), or None where it is off or not built."""
    from compiled_moe import host

    return host.module()


def _no_backward(name: str, ctx, *grads):
    raise RuntimeError(f"torch.ops.compiled_moe.{name} is not differentiable: nothing can "
                       "backpropagate through it (the package's autograd functions, such as "
                       "fp8_grouped_mm and moe_mlp, call it where a gradient is needed)")


def is_transposed_weight(b: Tensor) -> bool:
    """b is the (G, K, N) transposed view of a contiguous (G, N, K) weight: its gradient is
    written in the weight's own storage order (else autograd hands the weight a transposed
    gradient, which every later add and optimizer step reads with a strided kernel)."""
    return b.stride(1) == 1 and b.stride(2) != 1


def check_tensor(name: str, t, ndim: int, dtypes=OP_DTYPES) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")


def check_same_device(ref_name: str, ref: Tensor, **others: Tensor | None) -> None:
    device = ref.device  # each .device builds a torch.device
    for name, t in others.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {device}")


def check_same_dtype(ref_name: str, ref: Tensor, **others: Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != ref.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; "
                            f"they must match")


def check_offs(offs, num_groups=None) -> None:
    """offs: int32 (G,) cumulative end rows (G = num_groups when given).

    Values are not read (that would sync): kernels clamp them on the device.
    """
    if not isinstance(offs, Tensor):
        raise TypeError(f"offs must be a torch.Tensor, got {type(offs).__name__}")
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be int32 (cumulative end row of each group), got {offs.dtype}")
    if num_groups is None and offs.dim() == 1:
        num_groups = offs.shape[0]
    if offs.dim() != 1 or offs.shape[0] != num_groups:
        want = "(G,)" if num_groups is None else f"({num_groups},)"
        raise ValueError(f"offs must have shape {want}, one entry per group, "
                         f"got {tuple(offs.shape)}")
    if num_groups < 1:
        raise ValueError("need at least one group")


def check_bias(bias, num_groups: int, n: int) -> None:
    """bias: None, or a (G, N) float tensor, one row per group."""
    if bias is None:
        return
    check_tensor("bias", bias, 2)
    if tuple(bias.shape) != (num_groups, n):
        raise ValueError(f"bias must have shape (G, N) = {(num_groups, n)}, "
                         f"got {tuple(bias.shape)}")


def check_out_dtype(out_dtype) -> None:
    if out_dtype is not None and out_dtype not in OP_DTYPES:
        raise TypeError(f"out_dtype must be one of {OP_DTYPES} or None, got {out_dtype}")
