"""Edge SDK: what a device application embeds to take part in a federation.

>>> from edge_sdk import EdgeClient
>>> EdgeClient("mqtt://broker:1883", "dev-7", dataset, budget_bytes="1.5GiB", task="bbc").run()

``EdgeClient`` and its companions are imported on first use (PEP 562), so that
``edge_sdk.config`` (the device's configuration schema) loads without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moe_model.notices import quiet_kernels_notice

quiet_kernels_notice()  # before peft (moe_model.submoe) imports bitsandbytes

if TYPE_CHECKING:
    from .client import SDK_VERSION, EdgeClient, Notice, RoundSummary  # noqa: F401

__all__ = ["EdgeClient", "Notice", "RoundSummary", "SDK_VERSION"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
