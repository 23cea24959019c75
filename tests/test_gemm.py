"""``fedmoe::gemm`` (``moe_model.gemm``): the product with its operands' transposes as flags,
the rewrite of a graph's ``aten.mm`` into it, and the native core's kernel on ExecuTorch's
runtime against torch."""

import pytest
import torch

from moe_model.gemm import fold_transposes, gemm


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_gemm_is_the_product_of_the_transposed_operands(trans_a, trans_b):
    torch.manual_seed(0)
    a, b = torch.randn(5, 3), torch.randn(3, 7)
    got = gemm(a.t().contiguous() if trans_a else a, b.t().contiguous() if trans_b else b, trans_a, trans_b)
    assert torch.allclose(got, a @ b, atol=1e-6)


def test_gemm_refuses_operands_whose_inner_sizes_differ():
    with pytest.raises(ValueError, match="op\\(a\\) is 5 x 3"):
        gemm(torch.randn(5, 3), torch.randn(4, 7))
    with pytest.raises(ValueError, match="2-D"):
        gemm(torch.randn(2, 5, 3), torch.randn(3, 7))


class _Linear(torch.nn.Module):
    def forward(self, x, w, g):
        y = x @ w.t()  # mm(x, permute(w))
        return y, g.t() @ x, (g @ w.t().t())  # weight gradient form; a double transpose


def test_every_mm_becomes_gemm_with_its_transposes_folded_and_the_graph_computes_the_same():
    torch.manual_seed(0)
    x, w, g = torch.randn(6, 4), torch.randn(5, 4), torch.randn(6, 5)
    ep = torch.export.export(_Linear(), (x, w, g)).run_decompositions()
    gm = ep.module()
    want = gm(x, w, g)
    graph = ep.graph_module.graph
    assert fold_transposes(graph) == 3
    ep.graph_module.recompile()
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.mm.default not in targets and torch.ops.aten.permute.default not in targets
    flags = sorted((n.args[2], n.args[3]) for n in graph.nodes if n.target is torch.ops.fedmoe.gemm.default)
    assert flags == [(False, False), (False, True), (True, False)]
    for got, ref in zip(ep.module()(x, w, g), want):
        assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("shape", [(300, 40, 20), (20, 40, 300), (1, 5, 1)])
def test_the_native_kernel_equals_torch_on_either_split_and_every_transpose(shape):
    """The kernel splits C's rows (M >= N) or columns among the thread pool."""
    pytest.importorskip("executorch")
    from executorch.exir import to_edge
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    from fedmoe.native import load_kernels

    load_kernels()
    m, k, n = shape

    class M(torch.nn.Module):
        def forward(self, a, b, at, bt):
            return gemm(a, b), gemm(at, bt, True, True), gemm(a, bt, False, True), gemm(at, b, True, False)

    torch.manual_seed(0)
    a, b = torch.randn(m, k), torch.randn(k, n)
    args = (a, b, a.t().contiguous(), b.t().contiguous())
    prog = to_edge(torch.export.export(M(), args)).to_executorch()
    got = _load_for_executorch_from_buffer(prog.buffer).forward(list(args))
    for out in got:
        assert torch.allclose(out, a @ b, atol=1e-4)


def test_a_product_of_another_dtype_is_left_to_aten():
    class IntMM(torch.nn.Module):
        def forward(self, a, b):
            return a @ b.t()

    ep = torch.export.export(IntMM(), (torch.ones(3, 2, dtype=torch.int64), torch.ones(4, 2, dtype=torch.int64)))
    ep = ep.run_decompositions()
    assert fold_transposes(ep.graph_module.graph) == 0
    assert torch.ops.aten.mm.default in [n.target for n in ep.graph_module.graph.nodes]
