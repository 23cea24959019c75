"""A device process keeps libraries it does not use out (edge_sdk.lean): the modules it
imports while training a round, checked in a fresh process as `fedmoe device` runs."""

import json
import subprocess
import sys

import pytest

ROUND = r"""
import json, sys
from edge_sdk.lean import keep_out_unused
kept = keep_out_unused(sys.argv[1])
import torch
import edge_sdk.client  # noqa: F401  (what a device imports)
from moe_model.submoe import SubMoE
from moe_model.train import train_local
from protocol.messages import TrainConfig
from tests.conftest import tiny_spec
m = SubMoE(tiny_spec(), {1: [0, 1]}, "bbc", 2, None)
r = train_local(m, [("some text", 0), ("other words", 1)] * 4, TrainConfig(max_steps=2, batch_size=4), seed=0)
mods = {k for k, v in sys.modules.items() if v is not None}
print(json.dumps({"kept": kept, "loss": r.loss, "top": sorted({k.split(".")[0] for k in mods}),
                  "inductor": sum(1 for k in mods if k.startswith("torch._inductor"))}))
"""


def _device_round(backend: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ROUND, backend], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_device_round_imports_neither_scipy_nor_bitsandbytes():
    got = _device_round("torch")
    assert got["kept"] == ["scipy", "bitsandbytes"]
    assert not {"scipy", "bitsandbytes"} & set(got["top"]), got["top"]
    assert got["inductor"] < 40, got["inductor"]  # bitsandbytes' torch.compile decorators loaded ~160
    assert got["loss"] == got["loss"]  # trained: a finite loss came back


@pytest.mark.slow
def test_the_bitsandbytes_backend_keeps_bitsandbytes():
    pytest.importorskip("bitsandbytes")
    got = _device_round("bitsandbytes")
    assert got["kept"] == ["scipy"]
