"""``fedmoe provision``: device credentials, signing keys, broker password file, ACL, TLS.

One directory holds a deployment's secrets (``examples/deploy/README.md``)::

    passwd              Mosquitto password file (PBKDF2-SHA512 ``$7$`` entries)
    acl                 Mosquitto ACL: each device confined to its own subtree
    device_keys.json    device id -> Ed25519 public key (the aggregator's --device-keys)
    aggregator.json     the aggregator's MQTT account (its --credentials)
    devices/{id}.json   one device's credentials: username, password, signing key
    tls/ca.crt, tls/ca.key, tls/server.crt, tls/server.key   (with --tls-host)
    mosquitto.conf      a ready broker config using the files above
    nats-users.conf     the same accounts and confinement for a NATS cluster (each node's
                        configuration includes it; ``examples/deploy/nats``)

Running it again adds devices and keeps existing ones (their keys and passwords).
Secrets are written with mode 0600.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import json
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from protocol.credentials import load_credentials, load_device_keys  # noqa: F401 (re-exported)
from protocol.signing import generate_key, private_key_b64, public_key_b64
from protocol.topics import check_id

log = logging.getLogger(__name__)

AGGREGATOR_USER = "fedmoe-aggregator"
ACL_HEAD = """\
# fedmoe broker ACL (Mosquitto acl_file), written by `fedmoe provision`.
# Every client (username = device id): publish only into its own up/ subtree
# (hello, stats, update, ack, status and its Last Will), read only its own down/
# subtree and the retained expert shards.
pattern write fl/v1/+/dev/%u/up/#
pattern read fl/v1/+/dev/%u/down/#

# The aggregator's own account: the whole protocol tree.
user {aggregator}
topic readwrite fl/v1/#

# Read-only access to the shards, granted to each provisioned device by name: a
# `pattern` without %u or %c would apply to every client, and Mosquitto warns about it.
"""


def acl_text(aggregator: str, device_users: Iterable[str]) -> str:
    """The Mosquitto ``acl_file``: ``pattern`` lines confine every client to its own
    ``fl/v1/+/dev/{username}/up/#`` (write) and ``.../down/#`` (read); the aggregator may
    use all of ``fl/v1/#``; each device in ``device_users`` may read ``fl/v1/+/shards/#``
    (a ``user`` block each, so Mosquitto 2 has no pattern without ``%u`` to warn about)."""
    blocks = [f"user {u}\ntopic read fl/v1/+/shards/#\n" for u in sorted(device_users)]
    return ACL_HEAD.format(aggregator=aggregator) + "\n".join(blocks)


def nats_subject(topic_filter: str) -> str:
    """The NATS subject of an MQTT topic filter without dots as NATS' MQTT gateway maps
    it: levels joined by ``.``, ``+`` as ``*``, a trailing ``#`` as ``>``."""
    return ".".join({"+": "*", "#": ">"}.get(lv, lv) for lv in topic_filter.split("/"))


def nats_users_conf(aggregator: dict, devices: dict[str, dict]) -> str:
    """The ``authorization`` block of a NATS cluster serving fedmoe over MQTT: the
    aggregator may use the whole ``fl/v1`` tree; each device (username = device id) may
    publish only below its own ``up`` and subscribe only to its own ``down`` and the
    shards, as the Mosquitto ``acl`` says. ``a/b/#`` needs ``a.b`` and ``a.b.>`` (``#``
    also matches the parent level); ``$MQTT.sub.>`` is where the gateway delivers QoS 1
    messages to the client's own consumer (an MQTT client cannot subscribe to
    ``$MQTT/...`` topics itself; tests/test_cluster.py checks that). A device whose id
    holds a dot gets no account (a comment says so): the gateway maps a dot inside a
    topic level to ``//``, and NATS refused every subscription of such a device under
    the matching permission (measured with nats-server 2.9). Passwords are in plain
    text (NATS accepts bcrypt too; we do not ship a bcrypt library): keep the file 0600,
    readable by the nats-server account only."""
    def tree(topic: str) -> list[str]:
        return [nats_subject(topic), nats_subject(topic + "/#")]

    def entry(user: str, password: str, publish: list[str], subscribe: list[str]) -> str:
        return (f'    {{user: {json.dumps(user)}, password: {json.dumps(password)}, permissions: '
                f'{{publish: {json.dumps(publish)}, subscribe: {json.dumps(subscribe + ["$MQTT.sub.>"])}}}}}')

    lines = [entry(aggregator["username"], aggregator["password"], tree("fl/v1"), tree("fl/v1"))]
    for _, i in sorted(devices.items()):
        user = i["username"]
        if "." in user:
            log.warning("device %s gets no NATS account: a dot in a device id cannot be confined on NATS", user)
            lines.append(f"    # {user}: no account (a dot in the id; NATS maps it to '//' and refuses its topics)")
            continue
        lines.append(entry(user, i["password"], tree(f"fl/v1/+/dev/{user}/up"),
                           tree(f"fl/v1/+/dev/{user}/down") + tree("fl/v1/+/shards")))
    return ("# NATS accounts for fedmoe's MQTT clients, written by `fedmoe provision`: add\n"
            '#   include "nats-users.conf"\n'
            "# to every node's configuration. Plain-text passwords: keep this file 0600.\n"
            "authorization {\n  users = [\n" + "\n".join(lines) + "\n  ]\n}\n")


DEFAULT_BROKER_USER = "mosquitto"
"""The account Debian's and the upstream Mosquitto packages run the broker as."""


def mosquitto_password_line(username: str, password: str, iterations: int = 101) -> str:
    """One Mosquitto 2.x password-file line: ``user:$7$iterations$salt$hash``.

    PBKDF2-HMAC-SHA512 with a 12-byte salt, the format ``mosquitto_passwd`` writes.
    """
    if ":" in username or "\n" in username or "\n" in password:
        raise ValueError("username must not contain ':' or newlines")
    salt = secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"{username}:$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def _write_secret(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def subject_alt_name(host: str):
    """``host`` as a subjectAltName entry of the server certificate: an IP address entry
    for an IPv4/IPv6 address (a client connecting to ``mqtts://10.0.0.5`` checks that
    one), else a DNS name entry (``*.example.org`` allowed).

    Raises:
        ValueError: empty, or not a host name (a URL, a port, spaces).
    """
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if not host or not all(lb and len(lb) <= 63 and all(c.isalnum() or c in "-_*" for c in lb) for lb in labels):
        raise ValueError(f"--tls-host {host!r} is neither an IP address nor a DNS name (give the broker's host "
                         "name or address without scheme or port, e.g. mqtt.example.org or 10.0.0.5)")
    return x509.DNSName(host)


def make_tls(out: Path, hosts: Iterable[str], days: int = 825) -> None:
    """Write a CA and a server certificate for ``hosts`` to ``out``: every host (DNS
    name or IP address, :func:`subject_alt_name`) is in the certificate's subjectAltName,
    the first is its common name. Nothing is added: a client on the broker's machine
    connecting to ``localhost`` or ``127.0.0.1`` needs those names among ``hosts``.

    Files: ``ca.crt``, ``ca.key``, ``server.crt``, ``server.key`` (PEM). An existing CA
    is reused (devices keep trusting it); the server certificate is rewritten.

    Raises:
        ValueError: no hosts, or a host that is not a name or address.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    hosts = list(dict.fromkeys(hosts))
    if not hosts:
        raise ValueError("a server certificate needs at least one host name or IP address")
    sans = [subject_alt_name(h) for h in hosts]
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)

    def pem_key(k) -> str:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption()).decode()

    ca_key_path, ca_crt_path = out / "ca.key", out / "ca.crt"
    if ca_key_path.exists() and ca_crt_path.exists():
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate(ca_crt_path.read_bytes())
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedmoe deployment CA")])
        ca_cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        _write_secret(ca_key_path, pem_key(ca_key))
        ca_crt_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_secret(out / "server.key", pem_key(key))
    (out / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def mosquitto_conf(out: Path, port: int = 8883, host: str = "", tls: bool = True, persistence: bool = True,
                   broker_user: str | None = None) -> str:
    """A Mosquitto 2.x config using the provisioned files in ``out`` (absolute paths).

    Args:
        out: the deployment directory.
        port: the listener's TCP port.
        host: the address the listener binds to (``""``: every interface).
        tls: serve TLS only, with ``out/tls/server.{crt,key}``.
        persistence: keep sessions and retained shards in ``out/broker-data``.
        broker_user: the account a broker started as root runs as (Mosquitto's ``user``
            option; ignored by a broker started as anyone else).
    """
    out = out.resolve()
    lines = [
        "# written by `fedmoe provision`; see examples/deploy/mosquitto.conf for the commented version",
        *([f"user {broker_user}"] if broker_user else []),
        "per_listener_settings false",
        "allow_anonymous false",
        f"password_file {out / 'passwd'}",
        f"acl_file {out / 'acl'}",
        "max_queued_messages 100000",
        "max_inflight_messages 64",
        f"persistence {'true' if persistence else 'false'}",
        f"persistence_location {out / 'broker-data'}/",
        "# the listener: port and bind address (`fedmoe provision --port N --bind ADDRESS`; without an",
        "# address Mosquitto listens on every interface)",
        f"listener {port}{' ' + host if host else ''}",
    ]
    if tls:
        lines += [f"certfile {out / 'tls' / 'server.crt'}", f"keyfile {out / 'tls' / 'server.key'}",
                  "tls_version tlsv1.2"]
    return "\n".join(lines) + "\n"


def _hand_to_broker(out: Path, broker_user: str | None) -> None:
    """As root: give ``broker_user`` the files a broker reads (the password file and the
    server key stay 0600: nobody else reads them) and its persistence directory; as anyone
    else nothing (the broker then runs as that same user and reads its files)."""
    (out / "broker-data").mkdir(exist_ok=True)
    if not broker_user or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return
    import pwd

    try:
        account = pwd.getpwnam(broker_user)
    except KeyError:
        raise ValueError(f"broker user {broker_user!r} is not a system account: create it, or pass the account "
                         "the broker runs as (--broker-user)") from None
    for p in [out / "passwd", out / "acl", out / "broker-data", out / "tls" / "server.key", out / "tls" / "server.crt"]:
        if p.exists():
            os.chown(p, account.pw_uid, account.pw_gid)
    def enterable(d: Path) -> bool:
        st = d.stat()
        return bool(st.st_mode & 0o001 or st.st_uid == account.pw_uid or (st.st_gid == account.pw_gid
                                                                         and st.st_mode & 0o010))

    tls = [out.resolve() / "tls"] if (out / "tls").is_dir() else []
    closed = [d for d in [*tls, out.resolve(), *out.resolve().parents] if not enterable(d)]
    if closed:
        log.warning("the broker's user %s cannot enter %s: keep the deployment directory where it can (e.g. "
                    "/etc/fedmoe), or mosquitto -c %s will not read its files", broker_user, closed[0],
                    out / "mosquitto.conf")


@dataclass
class Provisioned:
    """What :func:`provision` wrote."""

    out: Path
    devices: dict[str, dict]
    aggregator: dict
    new: list[str] = field(default_factory=list)
    """The device ids this call created (the others existed and were kept)."""

    def device_file(self, device_id: str) -> Path:
        """``{out}/devices/{device_id}.json``: that device's credentials (not checked to exist)."""
        return self.out / "devices" / f"{device_id}.json"

    @property
    def device_keys_file(self) -> Path:
        """``{out}/device_keys.json``: device id -> Ed25519 public key."""
        return self.out / "device_keys.json"

    @property
    def aggregator_file(self) -> Path:
        """``{out}/aggregator.json``: the aggregator's MQTT account."""
        return self.out / "aggregator.json"

    @property
    def ca_file(self) -> Path | None:
        """``{out}/tls/ca.crt`` if it exists (TLS provisioned), else None."""
        p = self.out / "tls" / "ca.crt"
        return p if p.exists() else None


def _previous_listener(conf: Path) -> tuple[int, str] | None:
    """(port, bind address) of the ``listener`` line of a ``mosquitto.conf`` this module
    wrote earlier, or None (no file, or no such line)."""
    if not conf.exists():
        return None
    for line in conf.read_text().splitlines():
        words = line.split()
        if len(words) in (2, 3) and words[0] == "listener" and words[1].isdigit():
            return int(words[1]), (words[2] if len(words) == 3 else "")
    return None


def provision(out: str | Path, device_ids: Iterable[str], tls_hosts: Iterable[str] = (),
              aggregator_user: str = AGGREGATOR_USER, port: int | None = None,
              broker_user: str | None = DEFAULT_BROKER_USER, bind: str | None = None) -> Provisioned:
    """Create (or extend) a deployment directory; see the module docstring.

    Args:
        out: the directory.
        device_ids: devices to provision (existing ones are kept unchanged).
        tls_hosts: every DNS name and IP address clients reach the broker by; all go into
            the server certificate's subjectAltName (:func:`make_tls`). None: no new TLS
            files (an existing ``tls/`` is kept).
        aggregator_user: the aggregator's MQTT username.
        port: listener port written into ``mosquitto.conf`` (None: the port of the
            ``mosquitto.conf`` already in ``out``, else 8883).
        bind: address the listener binds to (``""``: every interface; None: as the
            existing ``mosquitto.conf`` says, else every interface).
        broker_user: the system account the broker runs as when started as root
            (Mosquitto drops to it, default ``mosquitto``): written into ``mosquitto.conf``
            and, when provisioning as root, made owner of the files the broker reads
            (``passwd``, ``acl``, ``tls/server.*``) and of its persistence directory, so
            ``mosquitto -c {out}/mosquitto.conf`` works as written. None: neither.

    Raises:
        ValueError: an invalid device id, a device id equal to the aggregator's username,
            a TLS host that is not a name or address, a port outside 1..65535, or (as root)
            a ``broker_user`` that is not a system account.
    """
    out = Path(out)
    ids = list(dict.fromkeys(check_id(d, "device id") for d in device_ids))
    if aggregator_user in ids:
        raise ValueError(f"device id {aggregator_user!r} is reserved for the aggregator")
    previous = _previous_listener(out / "mosquitto.conf") or (8883, "")
    port = previous[0] if port is None else port
    bind = previous[1] if bind is None else bind
    if not 0 < port < 65536:
        raise ValueError(f"--port {port}: not a TCP port (1..65535)")
    tls_hosts = list(dict.fromkeys(tls_hosts))
    for h in tls_hosts:  # before anything is written
        subject_alt_name(h)
    out.mkdir(parents=True, exist_ok=True)
    devices: dict[str, dict] = {}
    for f in sorted((out / "devices").glob("*.json")):
        info = json.loads(f.read_text())
        devices[info["device_id"]] = info
    agg_path = out / "aggregator.json"
    aggregator = json.loads(agg_path.read_text()) if agg_path.exists() else {
        "username": aggregator_user, "password": secrets.token_urlsafe(24)}
    new = [d for d in ids if d not in devices]
    for d in new:
        key = generate_key()
        devices[d] = {"device_id": d, "username": d, "password": secrets.token_urlsafe(24),
                      "signing_key": private_key_b64(key), "public_key": public_key_b64(key)}
    if tls_hosts:
        make_tls(out / "tls", tls_hosts)
        log.info("server certificate tls/server.crt for %s", ", ".join(tls_hosts))
    ca = out / "tls" / "ca.crt"
    if ca.exists():
        aggregator["tls_ca"] = str(ca.resolve())
        for info in devices.values():
            info["tls_ca"] = str(ca.resolve())
    for d, info in devices.items():
        _write_secret(out / "devices" / f"{d}.json", json.dumps(info, indent=1))
    _write_secret(agg_path, json.dumps(aggregator, indent=1))
    lines = [mosquitto_password_line(aggregator["username"], aggregator["password"])]
    lines += [mosquitto_password_line(i["username"], i["password"]) for i in devices.values()]
    _write_secret(out / "passwd", "\n".join(lines) + "\n")
    _write_secret(out / "nats-users.conf", nats_users_conf(aggregator, devices))
    (out / "acl").write_text(acl_text(aggregator["username"], (i["username"] for i in devices.values())))
    (out / "device_keys.json").write_text(
        json.dumps({d: i["public_key"] for d, i in sorted(devices.items())}, indent=1))
    (out / "mosquitto.conf").write_text(mosquitto_conf(out, port, bind, tls=ca.exists(), broker_user=broker_user))
    _hand_to_broker(out, broker_user)
    log.info("%d devices in %s: %d new, %d kept; mosquitto.conf listens on port %d of %s (%s)", len(devices), out,
             len(new), len(devices) - len(new), port, bind or "every interface", "TLS" if ca.exists() else "no TLS")
    return Provisioned(out, devices, aggregator, new)
