"""FX rewrites that move stock MoE code onto compiled_moe's ops.

They run on the graph dynamo hands to the backend (torch-level, "pre-grad" IR), before autograd
is traced, so the backward comes from our ops' autograd formulas too:

- ``torch._grouped_mm`` / ``F.grouped_mm`` (and transformers' ``grouped_mm_fallback``):
  2-D x 3-D with offsets -> ``compiled_moe.grouped_mm``; 2-D x 2-D with offsets (the
  weight-gradient form) -> ``compiled_moe.grouped_mm_wgrad``.
- The sort-based dispatch that Hugging Face's ``grouped_mm`` experts backend writes:
  ``hidden[perm // k]`` (a gather whose backward is an atomic scatter-add) -> ``moe_permute``;
  ``(y * w[perm, None])[inverse(perm)].view(T, k, H).sum(1)`` -> ``moe_unpermute`` (weights and
  combine in one deterministic pass). ``perm`` must be the indices of a 1-D ``sort``/``argsort``:
  that is what makes it a permutation, so the rewrite is exact.
- That backend's routing itself, ``torch.sort`` of the (T, k) ids flattened and
  ``cumsum(histc(...))`` of the sorted ids, -> one ``moe_route`` where nothing else reads the
  sort (its stable order is one valid order of the sort).
- Zero-fills of rows at or past offs[-1] around our grouped_mm (the expert-parallel sentinel
  masks of that backend) are dropped: our kernels already write zeros there and read nothing.
- The gated activation of that backend (and of transformers' expert loops),
  ``silu(gate) * up`` with ``gate, up = x.chunk(2, dim=-1)`` -> ``moe_activation(x, "swiglu")``:
  one kernel each way that reads x once (inductor's fusion of the same ops, forward and
  backward, took 0.27 ms per Qwen3 step against 0.19 ms). It computes in fp32 and rounds
  once, as inductor's fused kernel does.
- torchtitan's routing (a stable ``argsort`` of the flattened ids and one-hot counts) ->
  ``moe_route``; its score-weighted scatter-add combine (``deterministic_scatter_add`` too) ->
  ``moe_unpermute``; its experts, ``grouped_mm(silu(grouped_mm(x, w1^T)) *
  grouped_mm(x, w3^T), w2^T)`` with w1 and w3 two weights -> one ``moe_mlp(..., w3=w3)`` that
  reads both as they are (and the gather before it through the routing map).

Every match is checked on the nodes' example values (shapes, dtypes) without adding guards;
anything that does not match is left alone. The rewrite is idempotent.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import torch
from torch.fx import Graph, Node
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------- node helpers


def _val(x: Any):
    """The example value dynamo recorded for a node (a FakeTensor), or None."""
    if not isinstance(x, Node):
        return None
    return x.meta.get("example_value", x.meta.get("val"))


def _tensor(x: Any):
    v = _val(x)
    return v if isinstance(v, torch.Tensor) else None


def _known(cond) -> bool:
    """True only when cond holds for every value of its symbols (never adds a guard)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return bool(statically_known_true(cond))


def _arg(node: Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_call(node: Any, targets, methods=()) -> bool:
    if not isinstance(node, Node):
        return False
    if node.op == "call_function":
        return node.target in targets
    return node.op == "call_method" and node.target in methods


def _emit(graph: Graph, before: Node, fn: Callable, *args) -> Node:
    """Insert fn(*args) before a node, with its example value computed on the fake inputs."""
    with graph.inserting_before(before):
        node = graph.call_function(fn, args)
    vals = [_val(a) if isinstance(a, Node) else a for a in args]
    modes = [v.fake_mode for v in pytree.tree_leaves(vals) if hasattr(v, "fake_mode")]
    if modes:
        with modes[0]:
            node.meta["example_value"] = fn(*vals)
    return node


_PURE_FUNCTIONS = {operator.getitem, operator.floordiv, operator.mul, operator.ge, torch.mul,
                   torch.div, torch.ge, torch.reshape, torch.unsqueeze, torch.sum}
_PURE_METHODS = {"view", "reshape", "unsqueeze", "sum", "mul", "div", "ge", "to"}


def _replace(graph: Graph, node: Node, new: Node) -> None:
    """Point node's users at new, then erase node and the pure inputs only it used."""
    node.replace_all_uses_with(new)
    dead = [node]
    while dead:
        n = dead.pop()
        if n.users or n.graph is not graph:
            continue
        inputs = [a for a in n.all_input_nodes]
        graph.erase_node(n)
        dead += [a for a in inputs if (a.op == "call_function" and a.target in _PURE_FUNCTIONS)
                 or (a.op == "call_method" and a.target in _PURE_METHODS)]


# ---------------------------------------------------------------------------- grouped GEMMs


def _grouped_mm_targets() -> set:
    targets = {torch.ops.aten._grouped_mm.default, torch.ops.aten._grouped_mm}
    if hasattr(torch, "_grouped_mm"):
        targets.add(torch._grouped_mm)
    try:  # transformers' fallback op for dtypes inductor's grouped mm does not take
        fallback = torch.ops.transformers.grouped_mm_fallback
        targets |= {fallback, fallback.default}
    except (AttributeError, RuntimeError):
        pass
    return targets


def _wgrad_form(a: Node, grad_out: Node, offs: Node, out_dtype):
    """torch's 2-D x 2-D form, out[g] = a[:, rows_g] @ b[rows_g, :], in our op's (M, K) layout."""
    return torch.ops.compiled_moe.grouped_mm_wgrad(a.t(), grad_out, offs, out_dtype)


def rewrite_grouped_mm(graph: Graph) -> int:
    """Replace grouped GEMM calls on offsets with compiled_moe's ops. Returns the count."""
    targets = _grouped_mm_targets()
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        a, b = node.args[0], node.args[1]
        offs, bias = _arg(node, 2, "offs"), _arg(node, 3, "bias")
        out_dtype = _arg(node, 4, "out_dtype")
        av, bv, ov = _tensor(a), _tensor(b), _tensor(offs)
        if av is None or bv is None or ov is None or bias is not None:
            continue
        if av.dtype != bv.dtype or av.dtype not in _FLOATS or ov.dtype != torch.int32 or ov.dim() != 1:
            continue
        if out_dtype not in (None, av.dtype, torch.float32):
            continue
        if av.dim() == 2 and bv.dim() == 3:
            if not (_known(av.shape[1] == bv.shape[1]) and _known(ov.shape[0] == bv.shape[0])):
                continue
            new = _emit(graph, node, torch.ops.compiled_moe.grouped_mm.default, a, b, offs, None, out_dtype)
        elif av.dim() == 2 and bv.dim() == 2:
            if not _known(av.shape[1] == bv.shape[0]):
                continue
            new = _emit(graph, node, _wgrad_form, a, b, offs, out_dtype)
        else:
            continue
        _replace(graph, node, new)
        count += 1
    return count


# ---------------------------------------------------------------------------- sort-based dispatch


def _sort_indices_length(perm: Node):
    """If perm is the indices of sorting a 1-D tensor (so a permutation of range(n)), n."""
    src = None
    if _is_call(perm, {operator.getitem}) and perm.args[1] == 1:
        sort = perm.args[0]
        if _is_call(sort, {torch.sort}, ("sort",)):
            src = sort.args[0]
    elif _is_call(perm, {torch.argsort}, ("argsort",)):
        src = perm.args[0]
    sv, pv = _tensor(src), _tensor(perm)
    if sv is None or pv is None or sv.dim() != 1 or pv.dim() != 1:
        return None
    return pv.shape[0]


def routing_layout(perm: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_of, source) of compiled_moe's routing ops from a sort permutation of the T*k pairs."""
    source = perm.to(torch.int32)
    rows = torch.arange(perm.shape[0], device=perm.device, dtype=torch.int32)
    row_of = torch.empty_like(source).scatter(0, perm, rows)
    return row_of.view(-1, top_k), source


def _layout_of(graph: Graph, cache: dict, perm: Node, top_k, before: Node):
    """One routing_layout per (perm, k), inserted before its first use."""
    key = (perm, top_k)
    if key not in cache:
        layout = _emit(graph, before, routing_layout, perm, top_k)
        cache[key] = tuple(_emit(graph, before, operator.getitem, layout, i) for i in (0, 1))
    return cache[key]


def _int_like(x) -> bool:
    """A Python int, or a graph node holding a symbolic int (a size under dynamic shapes)."""
    return isinstance(x, int) or isinstance(_val(x), torch.SymInt)


def _floordiv_by_int(node: Any):
    """(p, k) if node is p // k with k an int (or a symbolic size)."""
    if _is_call(node, {operator.floordiv}) and _int_like(node.args[1]):
        return node.args[0], node.args[1]
    if (_is_call(node, {torch.div}, ("div",)) and len(node.args) > 1 and _int_like(node.args[1])
            and node.kwargs.get("rounding_mode") == "floor"):
        return node.args[0], node.args[1]
    return None


def _rewrite_gathers(graph: Graph, cache: dict) -> int:
    count = 0
    for node in list(graph.nodes):
        if not _is_call(node, {operator.getitem}) or not isinstance(node.args[1], Node):
            continue
        hidden, index = node.args
        pk = _floordiv_by_int(index)
        hv = _tensor(hidden)
        if pk is None or hv is None or hv.dim() != 2 or hv.dtype not in _FLOATS:
            continue
        perm, top_k = pk
        n = _sort_indices_length(perm)
        k = top_k if isinstance(top_k, int) else _val(top_k)
        if n is None or not _known(k >= 1) or not _known(n == hv.shape[0] * k):
            continue
        row_of, source = _layout_of(graph, cache, perm, top_k, node)
        new = _emit(graph, node, torch.ops.compiled_moe.moe_permute.default, hidden, row_of, source)
        _replace(graph, node, new)
        count += 1
    return count


def _inverse_of(node: Any):
    """perm if node is ``inv = empty_like(perm); inv[perm] = arange(n)``, else None."""
    if not _is_call(node, {torch.empty_like}):
        return None
    perm = node.args[0]
    for user in node.users:
        if _is_call(user, {operator.setitem}) and user.args[0] is node and user.args[1] is perm:
            ar = user.args[2]
            if (_is_call(ar, {torch.arange}) and len(ar.args) == 1
                    and ar.kwargs.get("start", 0) == 0 and ar.kwargs.get("step", 1) == 1):
                return perm
    return None


def _view_size(view: Node, dim: int):
    """The size argument (an int or a symbolic-size node) of a view/reshape at dim."""
    sizes = view.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = sizes[0]
    if len(sizes) <= dim or not _int_like(sizes[dim]):
        return None
    return sizes[dim]


def _sum_over_dim1(node: Node):
    """x if node is x.sum(1) / torch.sum(x, dim=1) of a 3-D x, without keepdim."""
    if not _is_call(node, {torch.sum}, ("sum",)) or node.kwargs.get("keepdim", False):
        return None
    x = node.args[0]
    dim = _arg(node, 1, "dim")
    xv = _tensor(x)
    if xv is None or xv.dim() != 3 or dim not in (1, -2, (1,), [1]):
        return None
    return x


def _routing_weights(graph: Graph, y: Node, perm: Node, top_k: int, before: Node):
    """(y', weights (T, k)) if y = y' * w[perm].unsqueeze(-1) with w the flat (T*k,) weights."""
    if not _is_call(y, {operator.mul, torch.mul}, ("mul",)):
        return y, None
    for rows, scale in (y.args[:2], y.args[1::-1]):
        if not (_is_call(scale, {torch.unsqueeze}, ("unsqueeze",)) and _arg(scale, 1, "dim") in (-1, 1)):
            continue
        gathered = scale.args[0]
        if not (_is_call(gathered, {operator.getitem}) and gathered.args[1] is perm):
            continue
        rv, wv = _tensor(rows), _tensor(gathered.args[0])
        if rv is None or wv is None or rv.dim() != 2 or wv.dim() != 1 or not wv.is_floating_point():
            continue
        weights = _emit(graph, before, torch.Tensor.view, gathered.args[0], -1, top_k)
        return rows, weights
    return y, None


def _rewrite_combines(graph: Graph, cache: dict) -> int:
    count = 0
    for node in list(graph.nodes):
        x = _sum_over_dim1(node)
        if x is None or not _is_call(x, {torch.reshape}, ("view", "reshape")):
            continue
        gathered = x.args[0]
        if not _is_call(gathered, {operator.getitem}):
            continue
        y, inverse = gathered.args
        perm = _inverse_of(inverse)
        n = _sort_indices_length(perm) if perm is not None else None
        xv, yv, out = _tensor(x), _tensor(y), _tensor(node)
        if n is None or yv is None or yv.dim() != 2 or yv.dtype not in _FLOATS or out is None:
            continue
        top_k = _view_size(x, 1)
        if top_k is None or not _known(yv.shape[0] == n):
            continue
        rows, weights = _routing_weights(graph, y, perm, top_k, node)
        if _tensor(rows).dtype not in _FLOATS:
            continue
        row_of, source = _layout_of(graph, cache, perm, top_k, node)
        new = _emit(graph, node, torch.ops.compiled_moe.moe_unpermute.default, rows, row_of, source,
                    weights)
        if _tensor(new).dtype != out.dtype:  # the sum ran in the promoted dtype of y * w
            new = _emit(graph, node, torch.Tensor.to, new, out.dtype)
        _replace(graph, node, new)
        _erase_unread_inverse(graph, inverse)
        count += 1
    return count


def _erase_unread_inverse(graph: Graph, inverse: Node) -> None:
    """Erase ``inv = empty_like(perm); inv[perm] = arange(n)`` when only its own setitem uses
    inv any more (a write into a tensor nobody reads: one scatter kernel a call otherwise)."""
    writes = list(inverse.users)
    if not all(_is_call(w, {operator.setitem}) and w.args[0] is inverse and not w.users
               for w in writes):
        return
    values = [w.args[2] for w in writes]
    for w in writes:
        graph.erase_node(w)
    graph.erase_node(inverse)
    _erase_unused(graph, [v for v in values if isinstance(v, Node)])


def _is_scatter_add_op(target) -> bool:
    """torchtitan's ``torchtitan::deterministic_scatter_add(out, index, src)`` (a custom op:
    matched by name, so torchtitan need not be importable here)."""
    return str(target) in ("torchtitan.deterministic_scatter_add.default",
                           "torchtitan.deterministic_scatter_add")


def _scatter_add_parts(node: Node):
    """(out, index, src) of a functional scatter-add of src's rows into out along dim 0:
    ``out.scatter_add(0, index, src)``, ``torch.scatter_add(out, 0, index, src)`` or
    torchtitan's deterministic op. In-place forms are left alone."""
    if node.op == "call_function" and _is_scatter_add_op(node.target) and len(node.args) == 3:
        return tuple(node.args)
    if _is_call(node, {torch.scatter_add}, ("scatter_add",)) and len(node.args) == 4:
        out, dim, index, src = node.args
        return (out, index, src) if dim == 0 else None
    return None


def _zeros_like_rows(out: Any) -> bool:
    """out is a fresh all-zero tensor: ``zeros_like(x)``, ``x.new_zeros(...)``, ``zeros(...)``."""
    return _is_call(out, {torch.zeros_like, torch.zeros}, ("new_zeros",))


def _row_token_index(index: Any):
    """(perm, k) if index is ``(perm // k)`` broadcast along the columns: ``.reshape(-1, 1)`` /
    ``.view(-1, 1)`` / ``.unsqueeze(-1)`` then ``.expand(...)`` / ``.expand_as(...)``."""
    if not _is_call(index, {torch.Tensor.expand}, ("expand", "expand_as")):
        return None
    column = index.args[0]
    if _is_call(column, {torch.reshape}, ("view", "reshape")):
        if tuple(column.args[1:]) not in ((-1, 1), ((-1, 1),)):
            return None
    elif not (_is_call(column, {torch.unsqueeze}, ("unsqueeze",)) and _arg(column, 1, "dim") in (-1, 1)):
        return None
    return _floordiv_by_int(column.args[0])


_CAST_METHODS = {"bfloat16": torch.bfloat16, "half": torch.float16, "float": torch.float32}


def _cast_source(node: Any):
    """(src, dtype) when node is one cast of src to a floating dtype (``x.to(dtype)``,
    ``x.float()``, ``x.bfloat16()``, ``x.half()``), else (node, None)."""
    if isinstance(node, Node) and node.op == "call_method" and node.args:
        if node.target in _CAST_METHODS and len(node.args) == 1 and not node.kwargs:
            return node.args[0], _CAST_METHODS[node.target]
        if (node.target == "to" and len(node.args) == 2 and isinstance(node.args[1], torch.dtype)
                and node.args[1].is_floating_point):
            return node.args[0], node.args[1]
    return node, None


def _without_cast(node: Any, to_fp32: bool = False) -> Any:
    """node's input if node is one dtype cast (with to_fp32 only a cast to float32), else
    node."""
    src, dtype = _cast_source(node)
    return src if dtype is not None and (not to_fp32 or dtype == torch.float32) else node


def _scaled_rows(graph: Graph, src: Node, perm: Node, top_k, before: Node):
    """(rows, weights (T, k) or None): src is rows, or rows times the routing weights gathered
    in sorted order as a column (``w_flat[perm].reshape(-1, 1)``, ``.view(-1, 1)``,
    ``.unsqueeze(-1)``); torchtitan's ``(rows.to(float32) * w).to(dtype)`` too (one upcast of
    the rows, one cast of the product: moe_unpermute multiplies and sums in fp32 and rounds
    once to the rows' dtype). (None, None) where src is another product."""
    product = _without_cast(src)
    if not _is_call(product, {operator.mul, torch.mul}, ("mul",)):
        return (src, None) if product is src else (None, None)
    for rows, scale in (product.args[:2], product.args[1::-1]):
        if _is_call(scale, {torch.reshape}, ("view", "reshape")):
            if tuple(scale.args[1:]) not in ((-1, 1), ((-1, 1),)):
                continue
        elif not (_is_call(scale, {torch.unsqueeze}, ("unsqueeze",)) and _arg(scale, 1, "dim") in (-1, 1)):
            continue
        gathered = scale.args[0]
        if not (_is_call(gathered, {operator.getitem}) and gathered.args[1] is perm):
            continue
        rows = _without_cast(rows, to_fp32=True)  # the rows' dtype: the result's, as there
        rv, wv = _tensor(rows), _tensor(gathered.args[0])
        if rv is None or wv is None or rv.dim() != 2 or wv.dim() != 1 or not wv.is_floating_point():
            continue
        return rows, _emit(graph, before, torch.Tensor.view, gathered.args[0], -1, top_k)
    return None, None


def _rewrite_scatter_combines(graph: Graph, cache: dict) -> int:
    """The combine as a scatter-add of the (weighted) expert rows into zeros at each row's token
    (torchtitan's form) -> ``moe_unpermute``: one deterministic pass that sums a token's k rows
    in fp32 and rounds once (the scatter-add rounds each product to the rows' dtype and adds in
    out's dtype, so the rewrite is as exact or more)."""
    count = 0
    for node in list(graph.nodes):
        parts = _scatter_add_parts(node)
        if parts is None:
            continue
        out, index, src = parts
        found = _row_token_index(index)
        ov, sv = _tensor(out), _tensor(src)
        if (found is None or not _zeros_like_rows(out) or ov is None or sv is None
                or ov.dim() != 2 or sv.dim() != 2 or ov.dtype not in _FLOATS):
            continue
        perm, top_k = found
        n = _sort_indices_length(perm)
        k = top_k if isinstance(top_k, int) else _val(top_k)
        iv = _tensor(index)  # (a narrower index would add only its first columns)
        if (n is None or iv is None or not _known(k >= 1) or not _known(ov.shape[0] * k == n)
                or not _known(sv.shape[0] == n) or not _known(sv.shape[1] == ov.shape[1])
                or not _known(iv.shape[0] == n) or not _known(iv.shape[1] == sv.shape[1])):
            continue
        rows, weights = _scaled_rows(graph, src, perm, top_k, node)
        if rows is None or _tensor(rows) is None or _tensor(rows).dtype not in _FLOATS:
            continue
        row_of, source = _layout_of(graph, cache, perm, top_k, node)
        new = _emit(graph, node, torch.ops.compiled_moe.moe_unpermute.default, rows, row_of, source,
                    weights)
        if _tensor(new).dtype != ov.dtype:
            new = _emit(graph, node, torch.Tensor.to, new, ov.dtype)
        _replace(graph, node, new)
        _erase_unused(graph, [index, index.args[0], index.args[0].args[0], out])
        count += 1
    return count


def rewrite_sorted_dispatch(graph: Graph) -> int:
    """Replace the sort-based gather and combine of an experts block. Returns the count."""
    cache: dict = {}
    return (_rewrite_gathers(graph, cache) + _rewrite_combines(graph, cache)
            + _rewrite_scatter_combines(graph, cache))


# ---------------------------------------------------------------------------- row masks


def _is_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


def _int_arg(node: Node, index: int, name: str):
    value = _arg(node, index, name)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _sorted_values(node: Any):
    """The sort node if node is ``sort(x)[0]`` of a 1-D x in ascending order, else None."""
    if not (_is_call(node, {operator.getitem}) and node.args[1] == 0):
        return None
    sort = node.args[0]
    if not _is_call(sort, {torch.sort}, ("sort",)) or _arg(sort, 2, "descending", False):
        return None
    xv = _tensor(sort.args[0])
    return sort if xv is not None and xv.dim() == 1 else None


def _mask_past_offsets(mask: Node, offs: Node) -> bool:
    """Whether every row that mask selects lies at or past offs[-1].

    True for the expert-parallel sentinel mask of Hugging Face's ``grouped_mm`` experts backend:
    ``mask = (ids_sorted >= E).unsqueeze(-1)`` with
    ``offs = cumsum(histc(ids_sorted, bins, min=lo, max=hi))``, ``E > hi``, over the same
    ascending sort. histc counts ids in [lo, hi] only, so offs[-1] rows hold them and the ids
    >= E, which sort last, fill rows from offs[-1] on. The values must not change between the
    reads: every in-place use of the sorted ids (the backend clamps them) must come later.
    """
    if not (_is_call(mask, {torch.unsqueeze}, ("unsqueeze",)) and _arg(mask, 1, "dim") in (-1, 1)):
        return False
    ge = mask.args[0]
    if not _is_call(ge, {operator.ge, torch.ge}, ("ge",)):
        return False
    ids, bound = ge.args[0], _int_arg(ge, 1, "other")
    if _sorted_values(ids) is None or bound is None:
        return False
    if not (_is_call(offs, {torch.cumsum}, ("cumsum",)) and _arg(offs, 1, "dim") in (0, -1)):
        return False
    histc = offs.args[0]
    if not _is_call(histc, {torch.histc}, ("histc",)):
        return False
    source = histc.args[0]
    while _is_call(source, {torch.Tensor.to}, ("to", "float", "int", "long", "double")):
        source = source.args[0]  # a cast of integer ids keeps their values
    hi = _int_arg(histc, 3, "max")
    if source is not ids or hi is None or not bound > hi:
        return False
    order = {n: i for i, n in enumerate(ids.graph.nodes)}
    last_read = max(order[ge], order[histc])
    return all(order[u] > last_read for u in ids.users
               if u.op == "call_method" and u.target.endswith("_"))


def _mutated(x: Node) -> bool:
    """Whether an in-place method or a setitem writes into x somewhere in the graph."""
    return any((u.op == "call_method" and u.target.endswith("_") and u.args[0] is x)
               or (_is_call(u, {operator.setitem}) and u.args[0] is x) for u in x.users)


def _row_consumers_offsets(x: Node, skip: Node):
    """The offsets node if every user of x but ``skip`` is the rows operand of
    compiled_moe.grouped_mm over that one offs, directly or through ``.to`` (so x's rows at or
    past offs[-1] are never read); else None."""
    found = set()
    pending = [(u, x) for u in x.users if u is not skip]
    while pending:
        user, via = pending.pop()
        if user.args[0] is not via:
            return None
        if _is_call(user, {torch.Tensor.to}, ("to",)):
            pending += [(u, user) for u in user.users]
        elif _is_call(user, {torch.ops.compiled_moe.grouped_mm.default}):
            found.add(user.args[2])
        else:
            return None
    return found.pop() if len(found) == 1 else None


def remove_row_masks(graph: Graph) -> int:
    """Drop zero-fills of rows at or past offs[-1] around compiled_moe.grouped_mm.

    Our grouped_mm writes zeros past offs[-1] and reads no rows there (its backward neither),
    so ``masked_fill(grouped_mm(...), mask, 0)`` is its input, and an in-place fill of rows
    that only grouped_mm reads changes nothing, values or gradients. Hugging Face's backend
    (transformers 5.17, and later ones under expert parallelism) writes three such fills, each
    a full pass over the activations.
    """
    count = 0
    for node in list(graph.nodes):
        if not _is_call(node, {torch.masked_fill}, ("masked_fill", "masked_fill_")):
            continue
        x, mask, value = node.args[0], _arg(node, 1, "mask"), _arg(node, 2, "value")
        if not isinstance(x, Node) or not isinstance(mask, Node) or not _is_zero(value):
            continue
        if node.target == "masked_fill_":
            offs = None if node.users else _row_consumers_offsets(x, node)
        elif _is_call(x, {torch.ops.compiled_moe.grouped_mm.default}) and not _mutated(x):
            offs = x.args[2]  # (HF adds biases in place first: then the fill is real work)
        else:
            offs = None
        if not isinstance(offs, Node) or not _mask_past_offsets(mask, offs):
            continue
        _replace(graph, node, x)
        count += 1
    return count


# ---------------------------------------------------------------------------- sort-based routing


def _dead_writes(vals: Node) -> list:
    """The in-place methods on vals whose results nothing reads (the backend's clamp_ of the
    sorted ids, for a bias gather that is not there)."""
    return [u for u in vals.users
            if u.op == "call_method" and u.target.endswith("_") and u.args[0] is vals
            and not u.users]


def _offsets_of_sorted(vals: Node):
    """(cumsum node, E) if the sorted ids feed nothing but
    ``cumsum(histc(ids_sorted[.int()], bins=E, min=0, max=E - 1), 0, dtype=torch.int32)``,
    the offsets of Hugging Face's ``grouped_mm`` experts backend, and in-place writes after it
    that nothing reads; else None. With these bounds histc puts id j in bin j for every j in
    [0, E) and counts no other id."""
    dead = _dead_writes(vals)
    node, readers = vals, [u for u in vals.users if u not in dead]
    while (len(readers) == 1 and readers[0].args[0] is node
           and _is_call(readers[0], {torch.Tensor.to}, ("to", "float", "int", "long", "double"))):
        node = readers[0]  # a cast of integer ids keeps their values
        readers = list(node.users)
    if len(readers) != 1:
        return None
    histc = readers[0]
    if not _is_call(histc, {torch.histc}, ("histc",)) or histc.args[0] is not node:
        return None
    bins, lo, hi = _int_arg(histc, 1, "bins"), _int_arg(histc, 2, "min"), _int_arg(histc, 3, "max")
    if bins is None or bins < 2 or lo != 0 or hi != bins - 1 or len(histc.users) != 1:
        return None  # (min == max would make histc take the data's own range)
    (cumsum,) = histc.users
    if not (_is_call(cumsum, {torch.cumsum}, ("cumsum",)) and cumsum.args[0] is histc
            and _arg(cumsum, 1, "dim") in (0, -1) and _arg(cumsum, 2, "dtype") == torch.int32):
        return None
    order = {n: i for i, n in enumerate(vals.graph.nodes)}
    if any(order[w] < order[histc] for w in dead):  # a write before histc changes the counts
        return None
    return cumsum, int(bins)


def _sort_outputs(sort: Node):
    """(values node, indices node) of a sort whose only users take its two outputs; else None
    (either may be None when unused)."""
    outs = {0: None, 1: None}
    for user in sort.users:
        if not (_is_call(user, {operator.getitem}) and user.args[1] in outs):
            return None
        outs[user.args[1]] = user
    return outs[0], outs[1]


def _erase_unused(graph: Graph, nodes) -> None:
    """Erase the given nodes that nothing uses any more, users before inputs."""
    pending = list(nodes)
    while pending:
        unused = [n for n in pending if not n.users]
        if not unused:
            return
        for n in unused:
            graph.erase_node(n)
            pending.remove(n)


def _equals(x: Any, size) -> bool:
    """Whether x (an int, or a node holding a symbolic int) is known to equal size."""
    v = _val(x) if isinstance(x, Node) else x
    return v is not None and _known(v == size)


def rewrite_sort_routing(graph: Graph) -> int:
    """Replace the sort of a (T, k) routing's expert ids, and the offsets counted from it, by
    one ``moe_route`` when nothing else reads them. Returns the count.

    Runs after the dispatch rewrite: the permutation must be read only by its routing_layout
    nodes, the sorted ids only by the offsets' histc, both then come from moe_route (its
    stable order is one valid order of the sort). Ids outside [0, E), which histc does not
    count either, moe_route drops; the backend's results for them (rows past offs[-1]) were
    never defined. It saves torch.sort's kernels and memsets, histc, cumsum and the layout's
    scatter: H200, HF's backend at Qwen3 T = 8192, same process, forward 1.409 against 1.495
    ms, forward+backward 4.242 against 4.274 ms.
    """
    from compiled_moe.ops.routing import MAX_EXPERTS

    count = 0
    for sort in list(graph.nodes):
        if not _is_call(sort, {torch.sort}, ("sort",)) or _arg(sort, 2, "descending", False):
            continue
        flat = sort.args[0]
        if not _is_call(flat, {torch.reshape}, ("view", "reshape")):
            continue
        ids, iv, fv = flat.args[0], _tensor(flat.args[0]), _tensor(flat)
        if iv is None or fv is None or iv.dim() != 2 or fv.dim() != 1:
            continue
        if isinstance(fv.shape[0], int) and fv.shape[0] >= 2**31:
            continue  # more pairs than moe_route takes
        outputs = _sort_outputs(sort)
        if iv.dtype not in (torch.int32, torch.int64) or outputs is None or outputs[0] is None:
            continue
        vals, perm = outputs
        found = _offsets_of_sorted(vals)
        layouts = list(perm.users) if perm is not None else []
        if found is None or found[1] > MAX_EXPERTS or not all(
                _is_call(u, {routing_layout}) and _equals(u.args[1], iv.shape[1]) for u in layouts):
            continue
        cumsum, num_experts = found
        route = _emit(graph, sort, torch.ops.compiled_moe.moe_route.default, ids, num_experts)
        offs, row_of, source = (_emit(graph, sort, operator.getitem, route, i) for i in range(3))
        for layout in layouts:
            for out in list(layout.users):
                out.replace_all_uses_with(row_of if out.args[1] == 0 else source)
        histc = cumsum.args[0]
        cumsum.replace_all_uses_with(offs)
        casts, node = [], histc.args[0]
        while node is not vals:
            casts.append(node)
            node = node.args[0]
        for write in _dead_writes(vals):
            graph.erase_node(write)
        _erase_unused(graph, [out for layout in layouts for out in layout.users] + layouts
                      + [cumsum, histc, *casts, vals] + ([perm] if perm is not None else [])
                      + [sort, flat])
        count += 1
    return count


def _base_of_views(node: Any) -> Any:
    """node with its view/reshape/flatten chain peeled."""
    while _is_call(node, {torch.reshape, torch.flatten}, ("view", "reshape", "flatten")):
        node = node.args[0]
    return node


def _expert_counts(counts: Any, ids_base: Node):
    """E if counts is a per-expert count (E,) of the ids whose views all lead to ids_base: a
    one-hot ``zeros(..., E, dtype=bool).scatter_(-1, ids, True)`` summed over every other dim
    (torchtitan). (A ``bincount(minlength=E)`` is not taken: its length is E only where every
    id is below E, which the graph does not say.)"""
    cv = _tensor(counts)
    if cv is None or cv.dim() != 1:
        return None
    if not _is_call(counts, {torch.sum}, ("sum",)) or counts.kwargs.get("keepdim", False):
        return None
    one_hot = counts.args[0]
    if not (_is_call(one_hot, set(), ("scatter_", "scatter")) and len(one_hot.args) == 4
            and one_hot.args[1] in (-1,) and one_hot.args[3] is True):
        return None
    hv = _tensor(one_hot)
    if hv is None or hv.dtype != torch.bool or not _zeros_like_rows(one_hot.args[0]):
        return None
    if _base_of_views(one_hot.args[2]) is not ids_base:
        return None
    dims = _arg(counts, 1, "dim")
    dims = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
    if sorted(d % hv.dim() for d in dims) != list(range(hv.dim() - 1)):
        return None
    return hv.shape[-1] if isinstance(hv.shape[-1], int) else None


def rewrite_argsort_routing(graph: Graph) -> int:
    """Replace a stable argsort of a (T, k) routing's flattened expert ids, and the offsets
    ``cumsum`` of per-expert counts of the same ids (a one-hot sum: torchtitan's form), by one ``moe_route`` where the permutation is read only by the
    gather and combine rewrites' layouts. The counts stay where something else reads them
    (torchtitan adds them to its load-balancing buffer). moe_route's order is the stable
    sort's; ids outside [0, E), which the counts do not count either, it drops. Returns the
    count."""
    from compiled_moe.ops.routing import MAX_EXPERTS

    count = 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for perm in list(graph.nodes):
        if not (_is_call(perm, {torch.argsort}, ("argsort",)) and perm.kwargs.get("stable") is True
                and not _arg(perm, 2, "descending", False)):
            continue
        flat = perm.args[0]
        if not _is_call(flat, {torch.reshape, torch.flatten}, ("view", "reshape", "flatten")):
            continue
        ids, iv = flat.args[0], _tensor(flat.args[0])
        if iv is None or iv.dim() != 2 or iv.dtype not in (torch.int32, torch.int64):
            continue
        layouts = list(perm.users)
        if not layouts or not all(_is_call(u, {routing_layout}) and _equals(u.args[1], iv.shape[1])
                                  for u in layouts):
            continue
        ids_base = _base_of_views(ids)
        found = [(c, _expert_counts(c.args[0], ids_base)) for c in graph.nodes
                 if _is_call(c, {torch.cumsum}, ("cumsum",)) and _arg(c, 1, "dim") == 0]
        found = [(c, e) for c, e in found if e]
        if len(found) != 1 or found[0][1] > MAX_EXPERTS:
            continue
        cumsum, num_experts = found[0]
        first = min([perm, cumsum], key=order.get)
        if order.get(ids, -1) >= order[first]:
            continue
        route = _emit(graph, first, torch.ops.compiled_moe.moe_route.default, ids, num_experts)
        offs, row_of, source = (_emit(graph, first, operator.getitem, route, i) for i in range(3))
        for layout in layouts:
            for out in list(layout.users):
                out.replace_all_uses_with(row_of if out.args[1] == 0 else source)
        cv = _tensor(cumsum)
        new_offs = offs if cv.dtype == torch.int32 else _emit(graph, cumsum, torch.Tensor.to, offs, cv.dtype)
        counts = cumsum.args[0]
        cumsum.replace_all_uses_with(new_offs)
        dead = [out for layout in layouts for out in layout.users] + layouts + [cumsum, perm, flat]
        dead += [counts, counts.args[0], counts.args[0].args[0]]
        _erase_unused(graph, dead)
        count += 1
        order = {n: i for i, n in enumerate(graph.nodes)}
    return count


# ---------------------------------------------------------------------------- gated activations


def _silu_targets() -> set:
    return {torch.nn.functional.silu, torch.ops.aten.silu.default, torch.ops.aten.silu}


def _half_of(node: Any, index: int):
    """(x, chunk) when node is x.chunk(2, dim=-1)[index] of a 2-D float x, else (None, None)."""
    if not (_is_call(node, {operator.getitem}) and node.args[1] == index):
        return None, None
    chunk = node.args[0]
    if not _is_call(chunk, {torch.chunk}, ("chunk",)):
        return None, None
    x, chunks, dim = chunk.args[0], _arg(chunk, 1, "chunks"), _arg(chunk, 2, "dim", 0)
    xv = _tensor(x)
    if chunks != 2 or dim not in (1, -1) or xv is None or xv.dim() != 2 or xv.dtype not in _FLOATS:
        return None, None
    if not _known(xv.shape[1] % 2 == 0):  # an odd width splits unevenly
        return None, None
    return x, chunk


def rewrite_gated_activations(graph: Graph) -> int:
    """Replace silu(gate) * up of (gate, up) = x.chunk(2, dim=-1) with moe_activation. Returns
    the count."""
    silu = _silu_targets()
    count = 0
    for node in list(graph.nodes):
        if not _is_call(node, {operator.mul, torch.mul}, ("mul",)) or len(node.args) != 2 or node.kwargs:
            continue
        for act, up in (node.args, node.args[::-1]):
            if not _is_call(act, silu, ("silu",)) or len(act.args) != 1 or act.kwargs.get("inplace"):
                continue
            x, chunk = _half_of(act.args[0], 0)
            _, chunk_up = _half_of(up, 1)
            if x is None or chunk_up is not chunk:
                continue
            gate = act.args[0]
            new = _emit(graph, node, torch.ops.compiled_moe.moe_activation.default, x, "swiglu")
            _replace(graph, node, new)
            for dead in (act, gate, up, chunk):  # (silu and chunk are not in _PURE_FUNCTIONS)
                if not getattr(dead, "_erased", False) and not dead.users:
                    graph.erase_node(dead)
            count += 1
            break
    return count


def _same_rows(a: Node, b: Node) -> bool:
    """a and b hold the same values: one node, or casts of one node to one dtype."""
    if a is b:
        return True
    (sa, da), (sb, db) = _cast_source(a), _cast_source(b)
    return da is not None and da == db and sa is sb


def _plain_grouped_mm(node: Any, offs=None):
    """(rows, b, offs) when node is compiled_moe's grouped_mm on a 2-D rows operand and a 3-D
    weight, without a bias or an out_dtype (and on `offs`, when given), else None."""
    if not _is_call(node, {torch.ops.compiled_moe.grouped_mm.default}):
        return None
    a, b, node_offs = node.args[0], node.args[1], _arg(node, 2, "offs")
    if _arg(node, 3, "bias") is not None or _arg(node, 4, "out_dtype") is not None:
        return None
    if offs is not None and node_offs is not offs:
        return None
    av, bv = _tensor(a), _tensor(b)
    if av is None or bv is None or av.dim() != 2 or bv.dim() != 3:
        return None
    return a, b, node_offs


def _is_dtype_reference(user: Node, node: Node) -> bool:
    """user is y.type_as(node): it reads node's dtype only."""
    return user.op == "call_method" and user.target == "type_as" and user.args[1:] == (node,)


def _gathered_rows(rows: Node):
    """(permute, dtype) when FC1's rows are permute = moe_permute(hidden, row_of, source),
    unscaled, cast to dtype or not, and used by nothing else (or for its dtype); else None."""
    src, dtype = _cast_source(rows)
    if not _is_call(src, {torch.ops.compiled_moe.moe_permute.default}) or len(src.args) != 3:
        return None
    if any(not (u is rows or _cast_source(u) == (src, dtype) or _is_dtype_reference(u, src))
           for u in src.users):
        return None
    return src, dtype


def _gated_grouped_mm(mul: Node, silu: set):
    """(act, gate, up) when mul is silu(gate) * up (either order) of two of compiled_moe's
    grouped GEMMs, else None."""
    if not _is_call(mul, {operator.mul, torch.mul}, ("mul",)) or len(mul.args) != 2 or mul.kwargs:
        return None
    for act, up in (mul.args, mul.args[::-1]):
        if (_is_call(act, silu, ("silu",)) and len(act.args) == 1 and not act.kwargs.get("inplace")
                and _plain_grouped_mm(act.args[0]) is not None and _plain_grouped_mm(up) is not None):
            return act, act.args[0], up
    return None


def _why_not_one_mlp(mul: Node, act: Node, gate: Node, up: Node):
    """Why silu(gate) * up of two grouped GEMMs cannot become one moe_mlp, or None (then
    (fc2, rows, weights, offs) are read off the nodes by the caller)."""
    (rows, b1, offs), (rows_up, b3, offs_up) = _plain_grouped_mm(gate), _plain_grouped_mm(up)
    if offs_up is not offs:
        return "the gate and up GEMMs run on different offsets"
    if not _same_rows(rows, rows_up):
        return "the gate and up GEMMs read different rows"
    if len(gate.users) != 1 or len(act.users) != 1 or len(up.users) != 1 or len(mul.users) != 1:
        return "a GEMM's output or the activation is read elsewhere too"
    fc2 = next(iter(mul.users))
    fc2_args = _plain_grouped_mm(fc2, offs)
    if fc2_args is None or fc2_args[0] is not mul:
        return "no grouped GEMM on the same offsets reads the activation (no FC2)"
    rv, b1v, b3v, b2v = (_tensor(n) for n in (rows, b1, b3, fc2_args[1]))
    if b1v.shape != b3v.shape or not (rv.dtype == b1v.dtype == b3v.dtype == b2v.dtype):
        return "the gate and up weights differ in shape, or the operands in dtype"
    if rv.dtype not in _FLOATS:
        return f"{rv.dtype} operands"
    if not (_known(b2v.shape[1] == b1v.shape[2]) and _known(b2v.shape[2] == rv.shape[1])):
        return "FC2's weight does not fit the activation and the rows"
    return None


def rewrite_gated_grouped_mm(graph: Graph) -> int:
    """Replace ``grouped_mm(silu(grouped_mm(x, w1^T)) * grouped_mm(x, w3^T), w2^T)`` on one
    offs (torchtitan's experts: the gate and up projections as two weights) with moe_mlp on
    w1 and w3 as they are: one FC1 kernel reads both, the activation in its epilogue. Rows
    gathered by moe_permute just before are read through the routing map instead. A gated
    product of two grouped GEMMs left as written is logged with the reason. Returns the
    count."""
    silu = _silu_targets()
    count = 0
    for mul in list(graph.nodes):
        if getattr(mul, "_erased", False):
            continue
        found = _gated_grouped_mm(mul, silu)
        if found is None:
            continue
        act, gate, up = found
        why = _why_not_one_mlp(mul, act, gate, up)
        if why is not None:
            log.debug("silu(grouped_mm) * grouped_mm at %s left as written: %s", mul.name, why)
            continue
        fc2 = next(iter(mul.users))
        (rows, b1, offs), (rows_up, b3, _) = _plain_grouped_mm(gate), _plain_grouped_mm(up)
        b2 = fc2.args[1]
        weights = [_emit(graph, fc2, torch.transpose, b, -2, -1) for b in (b1, b2, b3)]
        gathered = _gathered_rows(rows)
        if gathered is not None:
            permute, dtype = gathered
            hidden, row_of, source = permute.args
            for u in [u for u in permute.users if _is_dtype_reference(u, permute)]:
                u.args = (u.args[0], hidden)  # (moe_permute keeps hidden's dtype)
            if dtype is not None:
                hidden = _emit(graph, fc2, torch.Tensor.to, hidden, dtype)
            x, route = hidden, (source, row_of)
        else:
            x, route = rows, (None, None)
        from compiled_moe.reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT

        mlp = _emit(graph, fc2, torch.ops.compiled_moe.moe_mlp.default, x, offs, weights[0],
                    weights[1], "swiglu", "stacked", None, None, None, *route,
                    GPT_OSS_ALPHA, GPT_OSS_LIMIT, True, weights[2])
        _replace(graph, fc2, _emit(graph, fc2, operator.getitem, mlp, 0))
        dead = [mul, act, gate, up, rows, rows_up, b1, b3]
        dead += [_cast_source(n)[0] for n in (rows, rows_up, b1, b3)]
        _erase_unused(graph, [n for n in dict.fromkeys(dead) if not getattr(n, "_erased", False)])
        count += 1
    return count


def rewrite(graph: Graph) -> dict[str, int]:
    """Every rewrite of this module, in order; returns how many nodes each replaced."""
    import compiled_moe  # noqa: F401  (registers torch.ops.compiled_moe)

    counts = {"sorted_dispatch": rewrite_sorted_dispatch(graph),
              "grouped_mm": rewrite_grouped_mm(graph)}
    counts["row_masks"] = remove_row_masks(graph)  # (reads the sort: before sort_routing)
    counts["sort_routing"] = rewrite_sort_routing(graph) + rewrite_argsort_routing(graph)
    counts["gated_activation"] = rewrite_gated_activations(graph) + rewrite_gated_grouped_mm(graph)
    if any(counts.values()):
        graph.lint()
    return counts
