"""The fused output layer and next-token loss (``moe_model.lm_head_loss``): torch's
cross-entropy through the dequantized int8 output embedding, its gradient, and its refusals.
(The native kernel is checked against torch in ``tests/test_training_program.py``.)"""

import pytest
import torch
import torch.nn.functional as F

from moe_model.lm_head_loss import lm_head_loss
from moe_model.objectives import IGNORE
from protocol.codec import quantize_int8


def test_loss_correctness_and_gradient_equal_cross_entropy_through_the_dequantized_weight():
    torch.manual_seed(0)
    q, s = quantize_int8(torch.randn(50, 16))
    w = q.float() * s[:, None]
    h = torch.randn(7, 16, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    targets[3] = IGNORE
    targets[5] = int((h.detach() @ w.t())[5].argmax())  # one token predicted right
    weights = torch.arange(7.0)
    loss, correct = lm_head_loss(h, q, s, targets)
    grad, = torch.autograd.grad((loss * weights).sum(), h)
    h2 = h.detach().clone().requires_grad_()
    want = F.cross_entropy(h2 @ w.t(), targets, reduction="none", ignore_index=IGNORE)
    want_grad, = torch.autograd.grad((want * weights).sum(), h2)
    assert torch.allclose(loss, want, atol=1e-5) and torch.allclose(grad, want_grad, atol=1e-5)
    assert loss[3] == 0 and correct[3] == 0 and correct[5] == 1
    assert torch.equal(correct, (((h2 @ w.t()).argmax(-1) == targets) & (targets != IGNORE)).float())


def test_an_output_layer_that_is_not_int8_or_shapes_that_do_not_fit_are_refused():
    q, s = quantize_int8(torch.randn(50, 16))
    with pytest.raises(ValueError, match="int8 weight"):
        lm_head_loss(torch.randn(3, 16), q.float(), s, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="int8 weight"):
        lm_head_loss(torch.randn(3, 8), q, s, torch.zeros(3, dtype=torch.int64))
