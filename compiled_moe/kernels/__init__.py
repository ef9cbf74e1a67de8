"""Triton kernels (loaded lazily: importing compiled_moe needs no Triton)."""


def traceable(kernel):
    """The kernel as an op's body launches it: ``torch.library.wrap_triton(kernel)`` while a
    compiled graph traces the body (``ops._dispatch.tracing``), so the graph holds the launch;
    else the kernel itself (eager calls: a direct launch, no higher-order op). A kernel the
    Triton interpreter runs (``TRITON_INTERPRET=1``: the CPU tier) always launches as it is:
    torch 2.13 and later pass interpreted kernels through wrap_triton, 2.11 and 2.12 raise."""
    from compiled_moe.ops._dispatch import tracing

    if not tracing():
        return kernel
    from torch.library import wrap_triton
    from triton.runtime.interpreter import InterpretedFunction

    return kernel if isinstance(kernel, InterpretedFunction) else wrap_triton(kernel)
