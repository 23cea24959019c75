"""Edge SDK: what a device application embeds to take part in a federation.

>>> from edge_sdk import EdgeClient
>>> EdgeClient("mqtt://broker:1883", "dev-7", dataset, budget_bytes="1.5GiB", task="bbc").run()
"""

from moe_model.quant_bnb import quiet_kernels_notice

quiet_kernels_notice()  # before peft (moe_model.submoe) imports bitsandbytes

from .client import SDK_VERSION, EdgeClient, Notice, RoundSummary  # noqa: E402

__all__ = ["EdgeClient", "Notice", "RoundSummary", "SDK_VERSION"]
