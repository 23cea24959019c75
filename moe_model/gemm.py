"""One matrix product with its operands' transposes folded in: the operator
``fedmoe::gemm(a, b, trans_a, trans_b) = op(a) @ op(b)`` of training programs with the
project's operators (:mod:`moe_model.training_program`, ``ops="fedmoe"``).

An exported training step computes every linear layer as ``mm(x, permute(w, [1, 0]))``, its
input's gradient as ``mm(g, w)`` through a second ``permute`` and its weight's gradient as
``mm(permute(g, [1, 0]), x)``. ExecuTorch's runtime makes each ``permute`` a copy
(``permute_copy``: 14% of a demo-model step on 2 cores, 2026-12-07) and runs each ``mm`` on
one thread. :func:`fold_transposes` rewrites every 2-D ``aten.mm`` of a program's graph as
``fedmoe::gemm`` on the untransposed tensors, with the transposes as flags that the BLAS call
takes (a column-major ``sgemm``'s ``transa``/``transb``); the native training core's kernel
(``native/src/gemm.cpp``) splits the product's rows or columns among ExecuTorch's thread pool.
The function is ``aten.mm``'s, exactly.
"""

from __future__ import annotations

import torch

from .grouped import out_variant

_lib = torch.library.Library("fedmoe", "FRAGMENT")
_lib.define("gemm(Tensor a, Tensor b, bool trans_a=False, bool trans_b=False) -> Tensor")
_lib.define("gemm.out(Tensor a, Tensor b, bool trans_a=False, bool trans_b=False, *, Tensor(a!) out) -> Tensor(a!)")


def _shape(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool) -> tuple[int, int]:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gemm takes 2-D a and b, got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = (a.shape[1], a.shape[0]) if trans_a else tuple(a.shape)
    k2, n = (b.shape[1], b.shape[0]) if trans_b else tuple(b.shape)
    if k != k2:
        raise ValueError(f"gemm: op(a) is {m} x {k}, op(b) is {k2} x {n}")
    return m, n


def _gemm(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False) -> torch.Tensor:
    _shape(a, b, trans_a, trans_b)
    return (a.t() if trans_a else a) @ (b.t() if trans_b else b)


def _gemm_fake(a, b, trans_a=False, trans_b=False):
    m, n = _shape(a, b, trans_a, trans_b)
    return a.new_empty(m, n)


_lib.impl("gemm", _gemm, "CompositeExplicitAutograd")
_lib.impl("gemm.out", out_variant(_gemm), "CompositeExplicitAutograd")
torch.library.register_fake("fedmoe::gemm", _gemm_fake)


def gemm(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False) -> torch.Tensor:
    """``op(a) @ op(b)``, ``op`` the transpose where its flag is set.

    Args:
        a: ``(M, K)``, or ``(K, M)`` with ``trans_a``; fp32.
        b: ``(K, N)``, or ``(N, K)`` with ``trans_b``; fp32.

    Returns:
        ``(M, N)``.

    Raises:
        ValueError: operands that are not 2-D or whose inner sizes differ.
    """
    return torch.ops.fedmoe.gemm(a, b, trans_a, trans_b)


def _transposed(node: torch.fx.Node) -> bool:
    """``node`` is ``aten.permute(t, [1, 0])`` of a 2-D ``t``."""
    return (node.op == "call_function" and node.target is torch.ops.aten.permute.default and not node.kwargs
            and len(node.args) == 2 and list(node.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])
            and getattr(node.args[0], "meta", {}).get("val") is not None and node.args[0].meta["val"].dim() == 2)


def fold_transposes(graph: torch.fx.Graph) -> int:
    """Every fp32 ``aten.mm(a, b)`` of ``graph`` as ``fedmoe::gemm`` on ``a`` and ``b`` with
    their chains of 2-D transposes (``aten.permute(t, [1, 0])``) folded into its flags; each
    transpose left without a user is removed. In place; the graph's nodes need their
    ``meta["val"]`` (as an exported program's have), and an ``mm`` without it, of another
    dtype, or with keyword arguments is left as it is.

    Args:
        graph: an exported program's graph (``ep.graph_module.graph``; recompile the module
            after).

    Returns:
        The number of products rewritten.
    """
    made = 0
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if (node.op != "call_function" or node.target is not torch.ops.aten.mm.default or node.kwargs
                or val is None or val.dtype != torch.float32):
            continue
        operands, passed = [], []
        for arg in node.args[:2]:
            flip = False
            while _transposed(arg):
                passed.append(arg)
                arg, flip = arg.args[0], not flip
            operands += [arg, flip]
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.fedmoe.gemm.default, (operands[0], operands[2], operands[1],
                                                                     operands[3]))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for t in dict.fromkeys(passed):  # outermost first: each inner one loses its last user with the one before it
            if not t.users:
                graph.erase_node(t)
        made += 1
    return made
