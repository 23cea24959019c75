"""benchmarks/expert_choice.py: masking the router to the held experts is the sub-MoE that
holds just them (the measurement relies on it), and the mask is undone on exit."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import expert_choice as X  # noqa: E402
from moe_model.shards import shards_for  # noqa: E402
from moe_model.submoe import SubMoE  # noqa: E402
from tests.conftest import tiny_spec  # noqa: E402
from tests.test_models import TEXTS, shards  # noqa: E402


def test_held_only_equals_the_sub_moe_that_holds_those_experts():
    spec = tiny_spec(upcycle_noise=0.5, top_k=2)  # experts differ, so the subset matters
    sh = shards(spec)
    full = SubMoE(spec, {1: [0, 1, 2, 3]}, "t", 2, sh)
    before = X.pooled(full, TEXTS)
    for held in ([1, 3], [0, 2, 3], [2]):
        sub = SubMoE(spec, {1: held}, "t", 2, {k: sh[k] for k in shards_for({1: held})})
        with X.held_only(full, {1: held}):
            masked = X.pooled(full, TEXTS)
        assert torch.allclose(masked, X.pooled(sub, TEXTS), atol=1e-5), held
    assert torch.equal(X.pooled(full, TEXTS), before)  # the mask is gone
    assert X.rel_dev(masked, before) > 1e-3  # and holding fewer experts did change the function
    p = X.activation_prob(full, TEXTS)[1]
    assert p.shape == (4,) and abs(float(p.sum()) - 1) < 1e-9
