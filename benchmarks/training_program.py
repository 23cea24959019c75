"""The sub-MoE training step as an ExecuTorch program (``moe_model.training_program``) on the
demo model: export time, program size, step time and numerical parity against torch.

For one shape (model, experts per MoE layer, batch, sequence length, weight format) it
exports the program once, then runs the same batch through

- ExecuTorch's runtime (its Python bindings: the portable and optimized kernels a native
  device links, called from Python),
- torch eager in the program's mode (evaluation mode, dense dispatch, eager attention:
  the same function, hence the parity figures),
- torch eager as the Python device trains (training mode, sparse dispatch, its default
  attention): the step time a native device is compared with (issue "a phone-class
  device": at most 3x),

and reports the median step time of each over ``--steps`` steps (forward + backward; no
optimizer step), the loss difference and the largest relative L2 error of a gradient.
The native C++ device's memory is measured by its own benchmark, once it exists.

    python -m benchmarks.training_program                       # MiniLM, 2 experts per layer, int8, B 8, T 64
    python -m benchmarks.training_program --experts 8 --format fp32

Writes ``results/native/training_program.{json,md,png}`` (``--name`` changes the stem).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, write_result

WORK = ROOT / "runs" / "training_program"


def _median_s(f, steps: int) -> float:
    f()  # warm-up (first-call allocations)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(experts: int, batch: int, seq: int, fmt: str, steps: int) -> dict[str, Any]:
    """One shape's measurements (module docstring)."""
    import torch
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
    from executorch.extension.training import TrainingModule

    from cloud.global_model import GlobalModel
    from cloud.programs import ProgramCache
    from fedmoe.datasets import bbc_news
    from moe_model import objectives
    from moe_model.training_program import exportable, export_training_program, frozen_tensors, pad_batch, \
        slot_shape
    from protocol.messages import ModelSpec

    torch.manual_seed(0)
    items, labels = bbc_news()
    spec = ModelSpec(max_seq_len=seq)
    gm = GlobalModel(spec, {"bbc": labels}, fmt)
    held = slot_shape({layer: list(range(experts)) for layer in gm.all_experts})
    model = ProgramCache(gm, WORK).model_for("bbc", held)[0]
    t0 = time.perf_counter()
    program = export_training_program(model, batch, seq, fmt)
    export_s = time.perf_counter() - t0
    padded = pad_batch(*model.collate([(x, labels.index(c)) for x, c in items[:batch]]), seq)
    ids, mask, y = padded["input_ids"], padded["attention_mask"], padded["labels"]
    inputs = (ids, mask, y, *[t.detach() for t in frozen_tensors(model).values()])
    tm = TrainingModule(_load_for_executorch_from_buffer(program.pte))
    et_step = lambda: tm.forward_backward("forward", inputs)  # noqa: E731
    et_s = _median_s(et_step, steps)
    et_loss = tm.forward_backward("forward", inputs)[0].item()
    et_grads = {program.trainable[n]: g for n, g in tm.named_gradients().items()}

    def torch_step(dense: bool, train: bool) -> float:
        for blk in model.model.moe_blocks().values():
            blk.dense_dispatch = dense
        model.train(train)
        model.zero_grad()
        loss = objectives.sample_loss(model.objective, model({"input_ids": ids, "attention_mask": mask}), y).mean()
        loss.backward()
        return loss.item()

    with exportable(model):
        same_s = _median_s(lambda: torch_step(True, False), steps)
        ref_loss = torch_step(True, False)
        ref = {k: p.grad.clone() for k, p in model.trainable().items()}
    device_s = _median_s(lambda: torch_step(False, True), steps)
    grad_err = max(((et_grads[k] - g).norm() / g.norm().clamp_min(1e-12)).item() for k, g in ref.items())
    return {"experts_per_layer": experts, "batch": batch, "seq_len": seq, "weight_format": fmt,
            "moe_layers": sorted(held), "frozen_inputs": len(program.frozen), "trainable": len(program.trainable),
            "pte_bytes": len(program.pte), "export_s": export_s, "steps": steps,
            "step_s": {"executorch": et_s, "torch, program mode": same_s, "torch, Python device": device_s},
            "loss": {"executorch": et_loss, "torch": ref_loss}, "max_rel_grad_error": grad_err}


def markdown(r: dict[str, Any]) -> str:
    """The result page."""
    s = r["step_s"]
    lines = [f"# The training step as an ExecuTorch program: {r['model']}", "",
             f"Measured {r['date']} on {r['machine']}. {r['note']}", "",
             f"Command: `{r['command']}`", "",
             f"Shape: {r['experts_per_layer']} experts in each of the MoE layers {r['moe_layers']}, batch "
             f"{r['batch']}, sequence {r['seq_len']}, {r['weight_format']} weights; {r['frozen_inputs']} frozen "
             f"inputs, {r['trainable']} trainable tensors.", "",
             "| | value |", "|---|---|",
             f"| program size | {r['pte_bytes'] / 1024:.0f} KiB (weights are inputs, not in the program) |",
             f"| export time | {r['export_s']:.1f} s |",
             *[f"| step time, {k} (median of {r['steps']}, forward + backward) | {v * 1000:.0f} ms |"
               for k, v in s.items()],
             f"| ExecuTorch / Python device step time | {s['executorch'] / s['torch, Python device']:.2f}x |",
             f"| loss, ExecuTorch vs torch | {r['loss']['executorch']:.6f} vs {r['loss']['torch']:.6f} |",
             f"| largest relative L2 error of a gradient | {r['max_rel_grad_error']:.1e} |", ""]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    """Step time per runtime (bar chart)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names, vals = list(r["step_s"]), [v * 1000 for v in r["step_s"].values()]
    ax.barh(names, vals, color=["#4c72b0", "#8c8c8c", "#dd8452"])
    ax.set_xlabel("step time (ms, median; forward + backward)")
    ax.set_title(f"{r['experts_per_layer']} experts/layer, B {r['batch']}, T {r['seq_len']}, {r['weight_format']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=2, help="experts held per MoE layer (default 2)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--format", default="int8", choices=["fp32", "bf16", "int8"])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per runtime (median)")
    ap.add_argument("--note", default="", help="what else ran on the machine (recorded)")
    ap.add_argument("--out", default=str(ROOT / "results" / "native"))
    ap.add_argument("--name", default="training_program")
    args = ap.parse_args(argv)
    r = run(args.experts, args.batch, args.seq, args.format, args.steps)
    r.update(model="all-MiniLM-L6-v2 upcycled (the demo model)", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             machine=f"{platform.machine()}, {__import__('os').cpu_count()} CPU cores", note=args.note,
             command="python -m benchmarks.training_program " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(write_result(args.out, args.name, r, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
