"""Embedding the edge SDK in a device application.

Run an aggregator first (``fedmoe aggregator --config examples/aggregator.yaml``, which
prints the broker URL when it starts its own), then::

    python examples/embed_device.py mqtt://127.0.0.1:PORT my-device-1
"""

import logging
import sys

from edge_sdk import EdgeClient
from edge_sdk.data import LabeledDataset


def local_samples():
    """Your application's private data: (text, label) pairs. They never leave the device."""
    return [
        ("Shares in the carmaker rose after record quarterly profits", "business"),
        ("The band's new album went straight to number one", "entertainment"),
        ("The minister announced a new bill on immigration", "politics"),
        ("The striker scored twice as United won the derby", "sports"),
        ("The chipmaker unveiled a faster mobile processor", "tech"),
    ] * 20


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    broker, device_id = sys.argv[1], sys.argv[2]
    client = EdgeClient(broker, device_id, LabeledDataset(local_samples()), federation="bbc-demo",
                        budget_bytes="1.5GiB", task="bbc", threads=1)
    for summary in client.run():
        print(f"round {summary.round}: val acc {summary.val_accuracy:.3f}, "
              f"{summary.bytes_down / 2**20:.2f} MiB down, {summary.bytes_up / 2**20:.2f} MiB up")
