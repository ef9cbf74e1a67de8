"""torch.compile integration: graph rewrites onto compiled_moe's ops (installed as compiled_moe.lowering).

Two ways to turn it on, both off by default (they change which kernels run in a user's graph):

    torch.compile(model, backend="compiled_moe")      # a named backend: inductor + the rewrites;
                                                      # mode= and options= work as for inductor
    compiled_moe.lowering.enable()                    # the default backend ("inductor") runs the
    torch.compile(model)                              # rewrites as its pre-grad custom pass

What is rewritten (see :mod:`compiled_moe.lowering.passes`): ``torch._grouped_mm`` calls on
offsets (what Hugging Face's ``grouped_mm`` experts backend and torchtitan call) into
``compiled_moe.grouped_mm`` / ``grouped_mm_wgrad``, and the sort-based gather and combine around
them into ``moe_permute`` / ``moe_unpermute``. compiled_moe's own ops need nothing: they are
``triton_op``s, so inductor already emits their kernel launches in its generated code.

The inductor hooks used here are private and change between torch releases. :func:`supported`
checks that each is present in the form this module calls (not a list of version strings); on
a torch where one is missing the rewrites are skipped with one warning naming it, and both entry
points fall back to plain inductor. The tests run the rewrites on every torch release CI and
the GPU machine install.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings

import torch

from compiled_moe.lowering.passes import rewrite

__all__ = ["backend", "disable", "enable", "is_enabled", "missing_hooks", "rewrite", "supported"]

log = logging.getLogger(__name__)
_warned = False


@functools.cache
def missing_hooks() -> tuple[str, ...]:
    """The inductor hooks this module calls that this torch lacks, or has in another form
    (empty: every hook is there). Each is named as this module uses it."""
    try:
        from torch._inductor import config, list_mode_options  # noqa: F401
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.custom_graph_pass import (CustomGraphPass,  # noqa: F401
                                                       get_hash_for_files)
    except ImportError as e:
        return (f"import: {e}",)
    missing = []
    if not hasattr(config, "pre_grad_custom_pass"):
        missing.append("torch._inductor.config.pre_grad_custom_pass")
    if "config_patches" not in inspect.signature(compile_fx).parameters:
        missing.append("compile_fx(config_patches=)")
    if not callable(getattr(CustomGraphPass, "uuid", None)):
        missing.append("CustomGraphPass.uuid")
    return tuple(missing)


def supported() -> bool:
    """Whether this torch has the inductor hooks the rewrites use; warns once when it lacks one."""
    global _warned
    missing = missing_hooks()
    if not missing:
        return True
    if not _warned:
        warnings.warn(f"compiled_moe.lowering: torch {torch.__version__} lacks the inductor hooks "
                      f"{', '.join(missing)}: graph rewrites are off, the plain ops run",
                      stacklevel=3)
        _warned = True
    return False


def _apply(graph: torch.fx.Graph) -> None:
    if not supported():
        return
    try:
        counts = rewrite(graph)
    except Exception as e:  # a private IR that moved: keep the user's graph working
        warnings.warn(f"compiled_moe.lowering: graph rewrite skipped ({type(e).__name__}: {e})")
        return
    log.debug("compiled_moe rewrites: %s", counts)


def _graph_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class RewritePass(CustomGraphPass):
        """inductor's pre-grad custom pass; uuid() keys inductor's caches on this code."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            _apply(graph)

        def uuid(self):
            from compiled_moe.lowering import passes as module
            return get_hash_for_files((module.__file__, __file__))

    return RewritePass()


_PASS = None
_previous = None


def enable() -> bool:
    """Run the rewrites in every later ``torch.compile`` with the inductor backend.

    Returns False (and changes nothing) on an unsupported torch. An existing
    ``pre_grad_custom_pass`` keeps running, after ours.
    """
    global _PASS, _previous
    if not supported():
        return False
    from torch._inductor import config

    if _PASS is None:
        _PASS = _graph_pass()
    if is_enabled():
        return True
    _previous = config.pre_grad_custom_pass
    if _previous is None:
        config.pre_grad_custom_pass = _PASS
    else:
        config.pre_grad_custom_pass = _chain(_PASS, _previous)
    return True


def _chain(first, second):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Chain(CustomGraphPass):
        parts = (first, second)

        def __call__(self, graph):
            first(graph)
            second(graph)

        def uuid(self):
            return (first.uuid(), second.uuid() if hasattr(second, "uuid") else repr(second))

    return Chain()


def disable() -> None:
    """Undo :func:`enable` (restores any pass that was set before it)."""
    global _previous
    from torch._inductor import config

    if is_enabled():
        config.pre_grad_custom_pass = _previous
    _previous = None


def is_enabled() -> bool:
    from torch._inductor import config

    current = config.pre_grad_custom_pass
    return current is not None and (current is _PASS or _PASS in getattr(current, "parts", ()))


def backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None,
            options: dict | None = None, **_):
    """The ``"compiled_moe"`` torch.compile backend: the rewrites, then inductor."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = dict(list_mode_options(mode)) if mode else {}
    patches.update(options or {})
    _apply(gm.graph)
    gm.recompile()
    return compile_fx(gm, example_inputs, config_patches=patches)


def _register_backend() -> None:
    from torch._dynamo import list_backends, register_backend

    if "compiled_moe" not in list_backends(exclude_tags=()):
        register_backend(backend, name="compiled_moe")


_register_backend()
