"""What every Kafka client of dedup shares: the security settings, and why a connection failed.

The settings follow aiokafka's names (``security_protocol``, ``sasl_mechanism``,
``sasl_plain_username``, ``sasl_plain_password``), plus ``ssl_cafile``,
``ssl_certfile`` and ``ssl_keyfile``, from which the ``ssl_context`` aiokafka
wants is made.  The command line and the bundled services read them from
``KAFKA_<NAME>`` variables (docs/reference/configuration.md, "Secured Kafka").

aiokafka says only "Unable to bootstrap" when a login or a certificate is
refused; :func:`unreachable` asks the listener once more to tell the user which
setting to fix.  The password is never part of a message.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import aiokafka.errors
from aiokafka import conn as kafka_conn
from aiokafka import helpers

from dedup import _errors as errors

SETTINGS: Mapping[str, str] = {
    "security_protocol": "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL",
    "sasl_mechanism": "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
    "sasl_plain_username": "the SASL user",
    "sasl_plain_password": "the SASL password; prefer the variable (a flag shows in ps)",
    "ssl_cafile": "the CA certificate(s) that signed the brokers' certificates (PEM)",
    "ssl_certfile": "this client's certificate, for brokers that ask for one (PEM)",
    "ssl_keyfile": "this client's private key (PEM)",
}
"""The settings a secured cluster needs, by aiokafka's names, with what each is."""
FILE_SETTINGS = ("ssl_cafile", "ssl_certfile", "ssl_keyfile")
"""Turned into aiokafka's ``ssl_context``: aiokafka itself takes no file names."""
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_PROBE_TIMEOUT_MS = 10_000
_CONNECTION_OPTIONS = frozenset(
    (
        "security_protocol",
        "sasl_mechanism",
        "sasl_plain_username",
        "sasl_plain_password",
        "ssl_context",
    )
)


def variable(setting: str) -> str:
    """The environment variable of a setting: ``KAFKA_SASL_PLAIN_PASSWORD``."""
    return f"KAFKA_{setting.upper()}"


def flag(setting: str) -> str:
    """The command-line flag of a setting: ``--sasl-plain-password``."""
    return "--" + setting.replace("_", "-")


def add_kafka_options(parser: argparse._ActionsContainer) -> None:
    """Declare ``--security-protocol`` ... ``--ssl-keyfile`` on an argparse parser or group.

    Each defaults to its ``KAFKA_<NAME>`` variable; :func:`kafka_options` collects them.
    The ``dedup`` commands and the bundled services declare them this way.
    """
    for setting, what in SETTINGS.items():
        parser.add_argument(
            flag(setting),
            dest=setting,
            default=os.environ.get(variable(setting)) or None,
            help=f"{what} (default: ${variable(setting)})",
        )


def kafka_options(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given to a parser of :func:`add_kafka_options` (unset ones left out)."""
    return {name: getattr(args, name) for name in SETTINGS if getattr(args, name, None)}


def from_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings given as ``KAFKA_<NAME>`` variables (unset and empty ones left out)."""
    env = os.environ if environ is None else environ
    return {name: env[variable(name)] for name in SETTINGS if env.get(variable(name))}


def client_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` for an aiokafka client: the ``ssl_*file`` settings made an ``ssl_context``."""
    given = {name: value for name, value in options.items() if value is not None}
    files = {name: given.pop(name) for name in FILE_SETTINGS if name in given}
    protocol = given.get("security_protocol", "PLAINTEXT")
    if protocol not in PROTOCOLS:
        raise errors.ConfigurationError(
            f"security_protocol={protocol!r}: expected one of {', '.join(PROTOCOLS)}"
        )
    if "ssl_context" in given or not (files or protocol in ("SSL", "SASL_SSL")):
        return given
    for name, path in files.items():
        if not os.access(path, os.R_OK):
            raise errors.ConfigurationError(
                f"{name}={path!r} ({variable(name)}): no such readable file"
            )
    try:
        given["ssl_context"] = helpers.create_ssl_context(
            cafile=files.get("ssl_cafile"),
            certfile=files.get("ssl_certfile"),
            keyfile=files.get("ssl_keyfile"),
        )
    except ssl.SSLError as exc:
        raise errors.ConfigurationError(
            f"the TLS files ({', '.join(f'{k}={v!r}' for k, v in files.items())}) "
            f"cannot be loaded: {exc}"
        ) from exc
    return given


PASSWORD = "sasl_plain_password"  # noqa: S105 - the setting's name
"""The setting whose value is a secret."""


def redacted(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the password hidden, for a repr or a log line."""
    return {k: "***" if k == PASSWORD and v else v for k, v in options.items()}


def secrets(options: Mapping[str, Any]) -> set[str]:
    """The secret ``options`` hold (the SASL password), to mask where a message quotes it."""
    password = options.get(PASSWORD)
    return {password} if isinstance(password, str) and password else set()


def _first_server(bootstrap_servers: str | Sequence[str]) -> tuple[str, int]:
    servers = (
        bootstrap_servers.split(",") if isinstance(bootstrap_servers, str) else bootstrap_servers
    )
    host, _, port = servers[0].strip().rpartition(":")
    return host.strip("[]") or "localhost", int(port or 9092)


async def unreachable(
    bootstrap_servers: str | Sequence[str],
    options: Mapping[str, Any],
    cause: Exception,
    *,
    what: str,
) -> errors.DedupError:
    """The error to raise when a client could not start: which listener refused, and why.

    A refused login or an untrusted certificate is a :class:`ConfigurationError`
    naming the setting to fix; anything else a :class:`ServiceUnavailableError`.
    ``what`` says what the client was for ("the consumer", "replay").
    """
    protocol = options.get("security_protocol", "PLAINTEXT")
    host, port = _first_server(bootstrap_servers)
    listener = f"the {protocol} listener at {host}:{port}"
    probe = {k: v for k, v in options.items() if k in _CONNECTION_OPTIONS}
    try:
        conn = await kafka_conn.create_conn(
            host, port, request_timeout_ms=_PROBE_TIMEOUT_MS, **probe
        )
    except ssl.SSLCertVerificationError as exc:
        return errors.ConfigurationError(
            f"{what}: {listener} presented a TLS certificate this client does not trust "
            f"({exc.verify_message}): set ssl_cafile ({variable('ssl_cafile')}, "
            f"{flag('ssl_cafile')}) to the CA that signed it"
        )
    except aiokafka.errors.SaslAuthenticationFailed as exc:
        user = options.get("sasl_plain_username")
        return errors.ConfigurationError(
            f"{what}: {listener} refused the {options.get('sasl_mechanism')} login of "
            f"sasl_plain_username={user!r} ({exc}): "
            "check sasl_plain_username and sasl_plain_password "
            f"({variable('sasl_plain_password')}, {flag('sasl_plain_password')})"
        )
    except (OSError, TimeoutError, aiokafka.errors.KafkaError):
        pass
    else:
        conn.close()
    return errors.ServiceUnavailableError(
        f"{what}: cannot reach Kafka at bootstrap_servers={bootstrap_servers!r} "
        f"({listener}): {cause}"
    )
