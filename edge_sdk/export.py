"""Export a (sub-)MoE with its adapters for on-device inference with onnxruntime.

:func:`export_onnx` writes an ONNX graph ``(input_ids, attention_mask) -> logits``
(int64 ``(B, T)`` in, fp32 ``(B, num_labels)`` out; batch and sequence axes dynamic) of
a :class:`moe_model.submoe.SubMoE`, LoRA included, routing included: every MoE block
runs in its dense-dispatch form (all held experts on all tokens, combined by the
zero-padded top-k gates), which computes the same function without data-dependent
control flow, so one graph serves every input. Tokenization stays outside the graph.

``int8=True`` then applies onnxruntime's dynamic int8 quantization
(``quantize_dynamic``, weights int8 per tensor, activations quantized at run time),
after dropping ``graph.value_info`` (stale shape annotations make it fail).

Uses ``torch.onnx.export`` (needs ``onnxscript``) and ``onnxruntime``: the ``export``
extra. optimum 2.3 has no exporter of its own.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from moe_model.submoe import SubMoE

log = logging.getLogger(__name__)


class _Logits(nn.Module):
    def __init__(self, model: SubMoE):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model({"input_ids": input_ids, "attention_mask": attention_mask})


def export_onnx(model: SubMoE, out: str | Path, int8: bool = False, opset: int = 17) -> Path:
    """Write ``model`` as ONNX to ``out`` (see the module docstring).

    Args:
        model: the sub-MoE with its adapter state loaded (fp32 base weights).
        out: output ``.onnx`` path (parent directories are created).
        int8: apply dynamic int8 quantization.
        opset: ONNX opset.

    Returns:
        ``out``.

    Raises:
        ImportError: onnx / onnxscript / onnxruntime missing (``pip install fedmoe[export]``).
    """
    import onnx

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    blocks = list(model.model.moe_blocks().values())
    before = [b.dense_dispatch for b in blocks]
    was_training = model.training
    model.eval()
    for b in blocks:
        b.dense_dispatch = True
    try:
        batch, _ = model.collate([("export example sentence", 0), ("a second, longer example sentence here", 0)])
        args = (batch["input_ids"], batch["attention_mask"])
        target = out if not int8 else Path(tempfile.mkdtemp(prefix="fedmoe-export-")) / "fp32.onnx"
        with torch.no_grad():
            torch.onnx.export(
                _Logits(model), args, str(target), input_names=["input_ids", "attention_mask"],
                output_names=["logits"], opset_version=opset, dynamo=False,
                dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                              "logits": {0: "batch"}},
            )
    finally:
        for b, d in zip(blocks, before):
            b.dense_dispatch = d
        model.train(was_training)
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        m = onnx.load(str(target))
        del m.graph.value_info[:]
        cleaned = target.with_name("fp32-clean.onnx")
        onnx.save(m, str(cleaned))
        quantize_dynamic(str(cleaned), str(out), weight_type=QuantType.QInt8)
        for p in (target, cleaned):
            p.unlink(missing_ok=True)
    log.info("exported %s (%s, %.1f MiB)", out, "int8" if int8 else "fp32", out.stat().st_size / 2**20)
    return out


def onnx_session(path: str | Path, threads: int = 1) -> Any:
    """An onnxruntime CPU session with bounded threads (torch may share the process)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def onnx_logits(session: Any, model: SubMoE, texts: Sequence[str], batch_size: int = 32) -> torch.Tensor:
    """Logits ``(N, num_labels)`` of ``texts`` from an exported graph (``model`` tokenizes)."""
    outs = []
    for i in range(0, len(texts), batch_size):
        batch, _ = model.collate([(t, 0) for t in texts[i:i + batch_size]])
        feeds = {"input_ids": batch["input_ids"].numpy(), "attention_mask": batch["attention_mask"].numpy()}
        outs.append(torch.from_numpy(session.run(["logits"], feeds)[0]))
    return torch.cat(outs)
