"""Keep libraries a device does not use out of its process (torch-free; call it first).

Installed next to the SDK (the ``test`` and cloud extras bring them), two libraries are
imported by others' availability checks although a device never calls them:
``scipy`` (transformers' modelling utilities import its optimizer for object-detection
losses) and ``bitsandbytes`` (peft imports it whenever it is installed; its
``torch.compile`` decorators load ~160 ``torch._inductor`` modules). Measured in a device
process training the upcycled MiniLM (torch 2.13, transformers 5.24, peft 0.18): resident
memory after imports 478 -> 394 MiB, unique memory at the end of a round 477 -> 413 MiB;
every MiB is room for experts.

:func:`keep_out_unused` marks them absent (``sys.modules[name] = None``): the libraries'
``importlib.util.find_spec`` checks then report them missing, and any import of them
raises ``ImportError``. It must run before ``transformers`` or ``peft`` is imported;
``fedmoe device`` calls it after reading its configuration, and a device application
embedding the SDK calls it first thing.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)

UNUSED_ON_DEVICES = ("scipy", "bitsandbytes")
"""Libraries no device feature imports, except ``bitsandbytes`` for ``quant_backend="bitsandbytes"``."""


def keep_out_unused(quant_backend: str = "torch") -> list[str]:
    """Mark :data:`UNUSED_ON_DEVICES` absent from this process (``bitsandbytes`` stays
    available with ``quant_backend="bitsandbytes"``).

    Returns:
        The libraries kept out (those already imported are left alone, with a warning:
        call this before transformers/peft are imported).
    """
    kept = []
    for name in UNUSED_ON_DEVICES:
        if name == "bitsandbytes" and quant_backend == "bitsandbytes":
            continue
        if sys.modules.get(name, False) is None:
            kept.append(name)
        elif name in sys.modules:
            log.warning("%s is already imported; keep_out_unused() runs too late to keep it out", name)
        else:
            sys.modules[name] = None  # type: ignore[assignment]  (find_spec -> None, import -> ImportError)
            kept.append(name)
    if kept:
        log.debug("kept out of this device process: %s", ", ".join(kept))
    return kept
