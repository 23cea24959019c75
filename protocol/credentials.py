"""Reading the credential files ``fedmoe provision`` writes (device and aggregator side).

They live here, below both ``edge_sdk`` and ``cloud``, so neither imports the CLI
package that writes them (:mod:`fedmoe.provision`).
"""

from __future__ import annotations

import json
from pathlib import Path


def load_credentials(path: str | Path) -> dict:
    """Read a credentials file written by :func:`provision`. Raises ValueError if malformed."""
    try:
        info = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read credentials {path}: {e}") from None
    if not isinstance(info, dict) or "username" not in info:
        raise ValueError(f"credentials {path} lack a username")
    return info


def load_device_keys(path: str | Path) -> dict[str, str]:
    """Read ``device_keys.json`` (device id -> base64 public key). Raises ValueError."""
    try:
        keys = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read device keys {path}: {e}") from None
    if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
        raise ValueError(f"device keys {path} must map device ids to base64 keys")
    return keys
