"""Triton kernels (loaded lazily: importing compiled_moe needs no Triton)."""


def traceable(kernel):
    """``torch.library.wrap_triton(kernel)``, except for a kernel the Triton interpreter runs
    (``TRITON_INTERPRET=1``: the CPU tier), which launches as it is. torch 2.13 and later pass
    interpreted kernels through themselves; torch 2.11 and 2.12 raise for them."""
    from torch.library import wrap_triton
    from triton.runtime.interpreter import InterpretedFunction

    return kernel if isinstance(kernel, InterpretedFunction) else wrap_triton(kernel)
