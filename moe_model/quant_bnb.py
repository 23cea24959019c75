"""The bitsandbytes backend for quantized expert linears (``quant_backend="bitsandbytes"``).

The plain-torch :class:`moe_model.quant.QuantLinear` dequantizes per matmul and runs
everywhere torch does; this backend hands the same stored weights to bitsandbytes'
own layers instead, for platforms where its kernels are faster (and for parity with
QLoRA stacks): ``int8`` becomes ``bnb.nn.Linear8bitLt`` (our per-row ``scale`` is
bitsandbytes' ``SCB / 127``; the int8 matrix is its ``CB``), ``nf4`` becomes
``bnb.nn.Linear4bit`` (our packed bytes and block absmax are bitsandbytes' nf4 layout,
blocksize 64, tested bit-identical). No tensor is re-quantized, so both backends compute
with exactly the weights the cloud shipped. ``bf16`` stays a ``QuantLinear``, and so
does an nf4 layer whose ``in_features`` is not a multiple of 64: bitsandbytes 0.50's CPU
``dequantize_4bit`` then reads the wrong block's absmax (its own quantize/dequantize
round trip errs by 0.10 on a 40x96 N(0, 0.05²) matrix where ours errs by 0.023;
measured here). peft's
LoRA wrapper keeps the bitsandbytes layer as its frozen ``base_layer`` (the layer is
swapped in after injection, as for ``QuantLinear``), and the input gradient flows
through it on the CPU (bitsandbytes >= 0.45).

Memory held per layer is the same as ``QuantLinear.held_bytes`` (the same tensors),
so ``moe_model.budget.plan`` applies unchanged.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from protocol.codec import NF4_BLOCK

from .notices import quiet_kernels_notice  # noqa: F401  (its former home)
from .quant import QuantLinear

log = logging.getLogger(__name__)

BACKENDS = ("torch", "bitsandbytes")
"""Quantized-linear backends a device can choose (``EdgeClient(quant_backend=...)``)."""


def check_backend(backend: str) -> None:
    """Fail early (at configuration, not in the first round) when ``backend`` cannot run here.

    Raises:
        ValueError: unknown backend.
        ImportError: ``bitsandbytes`` chosen but the package does not import.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown quantization backend {backend!r}; use one of {BACKENDS}")
    if backend == "bitsandbytes":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # ImportError, or a broken native library
            raise ImportError("quant_backend='bitsandbytes' needs bitsandbytes (pip install 'fedmoe[quant]')") from e


def to_bitsandbytes(q: QuantLinear) -> nn.Module:
    """The bitsandbytes layer computing with ``q``'s stored weight (``bf16``: ``q`` itself).

    ``forward``: ``(..., in)`` fp32 -> ``(..., out)`` fp32.

    Raises:
        ImportError: bitsandbytes is not installed.
    """
    import bitsandbytes as bnb

    bias = q.bias is not None
    if q.fmt == "int8":
        layer = bnb.nn.Linear8bitLt(q.in_features, q.out_features, bias=bias, has_fp16_weights=False,
                                    threshold=0.0)
        w = bnb.nn.Int8Params(q.qweight_data, requires_grad=False, has_fp16_weights=False)
        w.CB, w.SCB = q.qweight_data, (q.qweight_scale * 127.0).float()
        layer.weight = w
    elif q.fmt == "nf4" and q.in_features % NF4_BLOCK == 0:
        from bitsandbytes.functional import QuantState, get_4bit_type

        state = QuantState(absmax=q.qweight_scale.float(), shape=torch.Size((q.out_features, q.in_features)),
                           code=get_4bit_type("nf4", device="cpu"), blocksize=NF4_BLOCK, quant_type="nf4",
                           dtype=torch.float32)
        layer = bnb.nn.Linear4bit(q.in_features, q.out_features, bias=bias, quant_type="nf4",
                                  compute_dtype=torch.float32)
        layer.weight = bnb.nn.Params4bit(q.qweight_data.reshape(-1, 1), requires_grad=False, quant_state=state,
                                         blocksize=NF4_BLOCK, quant_type="nf4", bnb_quantized=True)
        # In eval mode on an AVX512-BF16 CPU, bitsandbytes repacks the weight for inference
        # (a second copy) and its repacked path then fails under autograd: a device alternates
        # evaluation and training, so keep the one layout.
        layer.support_avx512bf16_for_cpu = False
    else:
        if q.fmt == "nf4":
            log.warning("nf4 linear with in_features %d (not a multiple of %d) kept on the torch backend",
                        q.in_features, NF4_BLOCK)
        return q
    if bias:
        layer.bias = nn.Parameter(q.bias.detach(), requires_grad=False)
    return layer


def convert(layers: dict[str, QuantLinear], backend: str) -> dict[str, nn.Module]:
    """``layers`` for ``backend`` (``torch``: unchanged).

    Raises:
        ValueError: unknown backend. ImportError: ``bitsandbytes`` without the package.
    """
    check_backend(backend)
    if backend == "torch":
        return dict(layers)
    return {path: to_bitsandbytes(q) for path, q in layers.items()}
