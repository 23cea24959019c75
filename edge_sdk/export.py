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

What inference needs besides the graph is stored with it: the ONNX file's
``metadata_props`` hold ``fedmoe.objective``, ``fedmoe.labels`` (classification: JSON
list of class names by logit index), ``fedmoe.max_seq_len``, ``fedmoe.padding_side``,
``fedmoe.tokenizer`` (the tokenizer directory, relative to the ONNX file:
``{stem}.tokenizer/`` next to it, written by the tokenizer's ``save_pretrained``) and
whatever ``metadata`` the caller adds (task, round...), each under ``fedmoe.``.
:class:`OnnxClassifier` reads them back and runs the graph (``fedmoe predict``).

Uses ``torch.onnx.export`` (needs ``onnxscript``) and ``onnxruntime``: the ``export``
extra. optimum 2.3 has no exporter of its own. The exporters' notices (TracerWarnings,
onnxruntime's per-tensor "Quantization parameters ... not specified" lines) are silenced
for the export call only; errors still propagate.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

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


def export_onnx(model: SubMoE, out: str | Path, int8: bool = False, opset: int = 17,
                labels: Sequence[str] | None = None, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``model`` as ONNX to ``out`` with what inference needs (see the module docstring).

    Args:
        model: the sub-MoE with its adapter state loaded (fp32 base weights).
        out: output ``.onnx`` path (parent directories are created).
        int8: apply dynamic int8 quantization.
        opset: ONNX opset.
        labels: class names by logit index (default ``"0"``, ``"1"``, ...); stored for a
            ``classification`` objective only.
        metadata: further ``metadata_props`` (values JSON-encoded unless strings), each
            stored as ``fedmoe.{key}``.

    Returns:
        ``out``.

    Raises:
        ImportError: onnx / onnxscript / onnxruntime missing (``pip install fedmoe[export]``).
        ValueError: ``labels`` not one per logit.
    """
    import onnx

    out = Path(out)
    if labels is not None and len(labels) != model.num_labels:
        raise ValueError(f"{len(labels)} labels for a model with {model.num_labels} outputs")
    labels = [str(y) for y in labels] if labels is not None else [str(i) for i in range(model.num_labels)]
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
        with torch.no_grad(), _quiet_tracer():
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
        with _quiet_quantizer():
            quantize_dynamic(str(cleaned), str(out), weight_type=QuantType.QInt8)
        for p in (target, cleaned):
            p.unlink(missing_ok=True)
    props = {"objective": model.spec.objective, "max_seq_len": model.spec.max_seq_len,
             **({"labels": labels} if model.spec.objective == "classification" else {}), **(metadata or {})}
    tok = _tokenizer_of(model)
    if tok is not None:
        tok_dir = out.with_suffix(".tokenizer")
        tok.save_pretrained(str(tok_dir))
        props.update(tokenizer=tok_dir.name, padding_side=tok.padding_side)
    m = onnx.load(str(out), load_external_data=False)
    onnx.helper.set_model_props(m, {f"fedmoe.{k}": v if isinstance(v, str) else json.dumps(v)
                                    for k, v in props.items()})
    onnx.save(m, str(out))
    log.info("exported %s (%s, %.1f MiB)%s", out, "int8" if int8 else "fp32", out.stat().st_size / 2**20,
             f" with its tokenizer in {out.with_suffix('.tokenizer')}" if tok is not None else "")
    return out


def _tokenizer_of(model: SubMoE) -> Any | None:
    """The tokenizer ``model.collate`` uses (its family's), or None for a family without text input."""
    spec = model.spec
    name = spec.tokenizer or spec.base
    if name is None:
        return None
    if spec.family == "hf-moe":
        from moe_model.models.hf_moe import tokenizer
    elif spec.family == "bert-upcycled":
        from moe_model.models.bert_upcycled import tokenizer
    else:
        return None
    return tokenizer(str(name))


@contextlib.contextmanager
def _quiet_tracer() -> Iterator[None]:
    """Hide the TorchScript tracer's notices during ``torch.onnx.export``: TracerWarnings
    (Python values taken as constants: the dense-dispatch graph has no data-dependent
    control flow, and the parity tests check the graph against torch on other lengths)
    and the opset note on ``aten::index`` (no negative indices here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=r"Exporting aten::index operator", category=UserWarning)
        yield


class _OrtNotices(logging.Filter):
    """Drops onnxruntime.quantization's notices, which it logs on the root logger: INFO
    lines (one per tensor without calibration parameters, one per skipped MatMul) and
    the advice to pre-process; warnings of any other kind and errors pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and "pre-processing before quantization" not in record.getMessage()


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """Filter :class:`_OrtNotices` out of the root logger while onnxruntime quantizes."""
    root, notices = logging.getLogger(), _OrtNotices()
    root.addFilter(notices)  # a logger's filter sees only records logged on it: the root logger's own
    try:
        yield
    finally:
        root.removeFilter(notices)


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


class OnnxClassifier:
    """A model written by :func:`export_onnx`, run in onnxruntime with its stored
    tokenizer, maximum length and label names (``fedmoe predict``).

    Raises (constructor):
        FileNotFoundError: no such file, or its tokenizer directory is missing.
        ValueError: the file carries no ``fedmoe.labels`` (not written by this exporter,
            or by a version before labels were stored) or no tokenizer.
    """

    def __init__(self, path: str | Path, threads: int = 1):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        self.session = onnx_session(path, threads)
        meta = {k[len("fedmoe."):]: v for k, v in self.session.get_modelmeta().custom_metadata_map.items()
                if k.startswith("fedmoe.")}
        if meta.get("objective", "classification") != "classification":
            raise ValueError(f"{path}: a {meta['objective']} model, not a classifier")
        if "labels" not in meta or "tokenizer" not in meta:
            raise ValueError(f"{path}: no labels or tokenizer stored with the model (export it again with "
                             "`fedmoe export`)")
        self.metadata: dict[str, str] = meta
        """``fedmoe.*`` metadata, prefix removed, values as stored (JSON text or strings)."""
        self.labels: list[str] = json.loads(meta["labels"])
        self.max_seq_len = int(meta["max_seq_len"])
        tok_dir = path.parent / meta["tokenizer"]
        if not tok_dir.is_dir():
            raise FileNotFoundError(f"{tok_dir}: the tokenizer directory exported with {path.name} is missing "
                                    "(copy it along with the .onnx file)")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = meta.get("padding_side", self.tokenizer.padding_side)

    def predict_proba(self, texts: Sequence[str], batch_size: int = 32):
        """Class probabilities (softmax of the logits), numpy float32 ``(N, len(labels))``."""
        import numpy as np

        outs = []
        for i in range(0, len(texts), batch_size):
            enc = self.tokenizer([str(t) for t in texts[i:i + batch_size]], truncation=True,
                                 max_length=self.max_seq_len, padding=True, return_tensors="np")
            feeds = {"input_ids": enc["input_ids"].astype(np.int64),
                     "attention_mask": enc["attention_mask"].astype(np.int64)}
            logits = self.session.run(["logits"], feeds)[0]
            z = np.exp(logits - logits.max(axis=1, keepdims=True))
            outs.append(z / z.sum(axis=1, keepdims=True))
        return np.concatenate(outs) if outs else np.zeros((0, len(self.labels)), np.float32)

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> list[tuple[str, dict[str, float]]]:
        """(label, {label: probability}) of each text."""
        probs = self.predict_proba(texts, batch_size)
        return [(self.labels[int(p.argmax())], {y: float(v) for y, v in zip(self.labels, p)}) for p in probs]
