"""A device's configuration schema: what ``fedmoe device`` runs with.

``fedmoe device --config device.yaml`` reads a :class:`DeviceConfig` from YAML (every
field; see ``examples/device.yaml``), and its command-line options, one per field
(``--budget`` for ``budget``, ``--device-id`` for ``device_id``, ...), override the
file; :meth:`DeviceConfig.client` builds the :class:`edge_sdk.EdgeClient`.
:class:`DeviceSettings` is the part that is not specific to one device: ``fedmoe
simulate`` sets it once for all its devices (its ``device`` section).

Byte sizes (``budget``, ``cache_max``, ``headroom``) are written ``1.5GiB``, ``800MB`` or
as a number of bytes (:data:`protocol.config.Bytes`). Imports nothing heavy: torch is
loaded by :meth:`DeviceConfig.client`, not by the schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.config import BrokerSettings, Bytes, PositiveBytes
from protocol.messages import WeightFormat

if TYPE_CHECKING:
    from .client import EdgeClient

DEFAULT_WEIGHT_FORMATS: tuple[str, ...] = ("int8", "nf4", "fp32")
"""Base-shard formats a device loads unless told otherwise, preferred first: int8, then
nf4 (half int8's bytes), then fp32; an aggregator serving any of them can use the device."""


class DeviceSettings(BaseModel):
    """How a device trains, caches and stops, whichever federation it joins. Each field's
    docstring is also its command-line help."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    threads: int | None = Field(None, ge=1)
    """torch intra-op threads (default: torch's)"""
    seed: int = 0
    """seed of the local shuffling and train/validation split"""
    val_fraction: float = Field(0.2, ge=0, lt=1, allow_inf_nan=False)
    """share of the local data held out for validation"""
    formats: list[WeightFormat] = Field(default_factory=lambda: list(DEFAULT_WEIGHT_FORMATS), min_length=1)
    """weight formats this device loads, preferred first"""
    headroom: Bytes | None = None
    """memory kept free below the plan for allocator growth, e.g. 32MiB (bytes; default:
    moe_model.budget.DEFAULT_HEADROOM_BYTES)"""
    quant_backend: Literal["torch", "bitsandbytes"] = "torch"
    """kernels for int8/nf4 expert linears (bitsandbytes needs the quant extra)"""
    cache_max: PositiveBytes | None = None
    """shard cache size limit, e.g. 2GiB (bytes; least recently used evicted)"""
    max_rounds: int | None = Field(None, ge=1)
    """return after this many rounds (default: until the aggregator says stop)"""
    idle_timeout: float | None = Field(None, gt=0, allow_inf_nan=False)
    """return if no assignment arrives for this many seconds (default: no limit)"""
    hello_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    """seconds to wait for an aggregator of the federation to answer the hello"""
    on_no_aggregator: Literal["exit", "wait"] = "exit"
    """when no aggregator answered the hello in hello_timeout_s: exit (status 1) or log it and wait"""
    on_aggregator_stop: Literal["exit", "wait"] = "exit"
    """when the aggregator says it shuts down (SIGTERM/SIGINT): exit, or wait for its restart"""
    allocator: Literal["mmap", "default"] = "mmap"
    """mmap: glibc serves allocations above 64 KiB by mmap, so freed activations go back to
    the OS (moe_model.budget.tune_allocator): a lower peak, slower steps; default: glibc's
    own setting (faster steps, a higher peak). The trade is measured in results/allocator/"""
    update_precision: Literal["fp32", "fp16", "bf16", "int8", "nf4"] = "fp32"
    """precision the update is uploaded in (edge_sdk.filters.UpdateEncoding; fp16/bf16 halve
    the upload, int8 quarters it, nf4 (with update_delta and update_error_feedback) cuts it
    about 7x)"""
    update_delta: bool = False
    """upload the update as its difference from the state the cloud sent (fewer bits lost
    at fp16/int8)"""
    update_error_feedback: bool = False
    """carry each update's encoding error over to the next round (error feedback; needs
    update_delta and fp16/bf16/int8/nf4)"""
    update_compression: bool = False
    """zlib-compress the update payload where the aggregator reads compressed payloads
    (protocol minor 8, Assignment.compressed_updates): an nf4 LoRA update shrinks by about a seventh,
    mostly its safetensors header"""
    model_dir: str | None = None
    """local copy of the checkpoint directory of an hf-moe model (its config.json and
    tokenizer; the weights still come as shards from the cloud), used instead of the path
    in the assignment"""

    @model_validator(mode="after")
    def _error_feedback_needs_a_lossy_delta(self) -> "DeviceSettings":
        if self.update_error_feedback and (not self.update_delta or self.update_precision == "fp32"):
            raise ValueError("update_error_feedback needs update_delta and update_precision fp16, bf16, int8 or nf4")
        return self


class DeviceConfig(DeviceSettings, BrokerSettings):
    """Everything ``fedmoe device`` needs (module docstring); loadable from YAML
    (:meth:`load`). The MQTT account and TLS files are
    :class:`protocol.config.BrokerSettings`; with ``credentials`` (a device file of
    ``fedmoe provision``) the device id, account and signing key come from that file."""

    broker: str
    """broker URL, e.g. mqtt://HOST:1883 or mqtts://HOST:8883"""
    device_id: str | None = None
    """device id (or take it from credentials)"""
    budget: PositiveBytes
    """memory budget, e.g. 1.5GiB (bytes)"""
    data: str
    """CSV or JSONL file with text,label"""
    task: str = "default"
    """task name (selects the classification head)"""
    federation: str = "default"
    """federation name (topic root fl/v1/FEDERATION)"""
    cache_dir: str | None = None
    """where base shards are cached (default ~/.cache/fedmoe/DEVICE_ID)"""

    @model_validator(mode="after")
    def _identity(self) -> "DeviceConfig":
        if not self.device_id and not self.credentials:
            raise ValueError("give device_id or credentials (--device-id, --credentials)")
        return self

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "DeviceConfig":
        """Read YAML and apply top-level overrides (None values are ignored).

        Raises:
            pydantic.ValidationError: a bad or missing field; OSError, yaml.YAMLError.
        """
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a device config is a mapping of fields, not {type(data).__name__}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)

    def check_paths(self) -> "DeviceConfig":
        """Check that ``data`` and the ``credentials``/TLS files exist (relative paths:
        relative to the working directory). Returns ``self``.

        Raises:
            ValueError: every missing file, in one line.
        """
        bad = [] if Path(self.data).is_file() else [f"data: no such file {self.data!r}"]
        bad += self.missing_files()
        if bad:
            raise ValueError("; ".join(bad))
        return self

    def filters(self) -> list:
        """The outgoing filters these settings ask for: an
        :class:`edge_sdk.filters.UpdateEncoding` unless the update goes as plain fp32 state."""
        if self.update_precision == "fp32" and not self.update_delta and not self.update_compression:
            return []
        from .filters import UpdateEncoding

        return [UpdateEncoding(self.update_precision, delta=self.update_delta,
                               error_feedback=self.update_error_feedback, compress=self.update_compression)]

    def client(self) -> EdgeClient:
        """Load ``data`` and build the :class:`edge_sdk.EdgeClient` (imports torch); run
        it with ``client.run(max_rounds=cfg.max_rounds, idle_timeout=cfg.idle_timeout)``.

        Raises:
            ValueError: the data file is unreadable or lacks text and label; a bad
                credentials file or setting (``EdgeClient``'s checks).
        """
        from protocol.transport import TlsConfig

        from .client import EdgeClient
        from .data import load_text_file

        tls = TlsConfig(self.tls_ca, self.tls_cert, self.tls_key) if self.tls_ca else None
        common: dict[str, Any] = dict(
            federation=self.federation, budget_bytes=int(self.budget), task=self.task, cache_dir=self.cache_dir,
            val_fraction=self.val_fraction, seed=self.seed, threads=self.threads, protocol=self.protocol, tls=tls,
            weight_formats=list(self.formats), quant_backend=self.quant_backend,
            cache_max=int(self.cache_max) if self.cache_max is not None else None,
            headroom_bytes=int(self.headroom) if self.headroom is not None else None, filters=self.filters(),
            model_dir=self.model_dir, low_memory=self.allocator == "mmap", hello_timeout_s=self.hello_timeout_s,
            on_no_aggregator=self.on_no_aggregator, on_aggregator_stop=self.on_aggregator_stop)
        data = load_text_file(self.data)
        if self.credentials:
            return EdgeClient.from_credentials(self.broker, self.credentials, data, **common)
        return EdgeClient(self.broker, self.device_id, data, username=self.username, password=self.password,
                          **common)
