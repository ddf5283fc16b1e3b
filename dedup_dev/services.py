"""Where the development Kafka and Postgres answer, and how to start them when they don't.

Your own services (``KAFKA_BOOTSTRAP_SERVERS`` and ``DEDUP_DSN``) come first;
else the ones ``compose/local/up`` started, whose addresses it wrote to
``.services/env`` (or ``$DEDUP_SERVICES_DIR/env``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
"""The checkout."""

HOW_TO_START = (
    "start them with `compose/local/up` (or `make test`, which does), "
    "or point KAFKA_BOOTSTRAP_SERVERS and DEDUP_DSN at your own"
)


class Unreachable(Exception):
    """A development service does not answer; the message says how to start it."""


@dataclass(frozen=True)
class Services:
    """Where the services answer."""

    bootstrap_servers: str
    """Kafka, as host:port."""
    dsn: str
    """Postgres, a DSN for a role that may create databases."""


@dataclass(frozen=True)
class SecuredKafka:
    """The SASL_SSL listener of a broker ``DEDUP_KAFKA_SASL_SSL=1 compose/local/up`` started."""

    bootstrap_servers: str
    cafile: str
    """The throwaway CA that signed the broker's certificate."""
    username: str
    password: str

    def settings(self, **changes: str) -> dict[str, str]:
        """The client settings, by aiokafka's names (``ssl_cafile`` for the context)."""
        return {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": self.username,
            "sasl_plain_password": self.password,
            "ssl_cafile": self.cafile,
            **changes,
        }

    def environ(self, **changes: str) -> dict[str, str]:
        """The same as ``KAFKA_<NAME>`` variables, with ``KAFKA_BOOTSTRAP_SERVERS``."""
        named = {f"KAFKA_{k.upper()}": v for k, v in self.settings(**changes).items()}
        return {"KAFKA_BOOTSTRAP_SERVERS": self.bootstrap_servers, **named}


def secured_kafka(env_file: Path) -> SecuredKafka | None:
    """The SASL_SSL listener written to ``env_file`` by ``compose/local/up``, if any."""
    found = read_env(env_file)
    if not found.get("KAFKA_SASL_SSL_BOOTSTRAP_SERVERS"):
        return None
    return SecuredKafka(
        found["KAFKA_SASL_SSL_BOOTSTRAP_SERVERS"],
        found["KAFKA_SASL_SSL_CAFILE"],
        found["KAFKA_SASL_SSL_USERNAME"],
        found["KAFKA_SASL_SSL_PASSWORD"],
    )


def services_dir() -> Path:
    """The folder ``compose/local/up`` keeps its services in."""
    return Path(os.environ.get("DEDUP_SERVICES_DIR") or ROOT / ".services")


def read_env(path: Path) -> dict[str, str]:
    """The ``NAME=value`` lines of an env file written by ``compose/local/up`` ({} if none)."""
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def configured() -> Services | None:
    """The services of the environment, each completed from ``.services/env``; None if either
    is missing."""
    local = read_env(services_dir() / "env")
    kafka = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or local.get("KAFKA_BOOTSTRAP_SERVERS")
    dsn = os.environ.get("DEDUP_DSN") or local.get("DEDUP_DSN")
    if not kafka or not dsn:
        return None
    return Services(kafka, dsn)


def with_database(dsn: str, database: str) -> str:
    """``dsn`` pointing at another database on the same server."""
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{database}"


def with_user(dsn: str, user: str) -> str:
    """``dsn`` logging in as ``user`` (the development server trusts local connections)."""
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))
