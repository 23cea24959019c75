"""Third-party log notices silenced; torch-free, so that a package can install the filter
first thing on import (``edge_sdk/__init__``) without loading torch."""

from __future__ import annotations

import logging

_KERNELS_NOTICE_LOGGER = "bitsandbytes.backends.cpu.ops"
_KERNELS_NOTICE = "gemm_4bit_forward from kernels-community"


class _NoKernelsNotice(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community"
    warning (logged when it is imported on a CPU with AVX512-BF16 and cannot take that kernel
    from the Hugging Face hub: the ``kernels`` package absent, offline, or the repository not
    trusted; it then uses its own kernel); passes everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _KERNELS_NOTICE not in str(record.msg)


def quiet_kernels_notice() -> None:
    """Silence that one bitsandbytes warning, which every process that imports ``peft``
    printed (``peft`` imports bitsandbytes whenever it is installed, at its first LoRA
    injection; ``moe_model.submoe`` imports it on import, so that the footprint a device
    measures before any model holds it). Idempotent; must run before bitsandbytes is
    imported (``edge_sdk/__init__`` and ``moe_model.submoe`` call it)."""
    logger = logging.getLogger(_KERNELS_NOTICE_LOGGER)
    if not any(isinstance(f, _NoKernelsNotice) for f in logger.filters):
        logger.addFilter(_NoKernelsNotice())
