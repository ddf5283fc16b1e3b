"""Postgres connection strings: the two forms libpq reads, and showing one without its secrets.

A DSN is a URL (``postgresql://app:pw@db:5432/shop?sslmode=require``) or libpq
keyword/value pairs (``host=db user=app password=pw dbname=shop``).  asyncpg
reads URLs only, so :func:`to_url` turns pairs into one.

Nothing dedup prints (errors, log lines, span attributes, CLI output) may hold a
password: a DSN is shown through :func:`redact`, and text that came from the
driver and may quote the DSN (an exception's message) through :func:`scrub`.
Passwords from ``PGPASSWORD`` or a ``.pgpass`` file never enter a message:
asyncpg reads them itself.  A handler's exception, which dedup stores with a
dead letter, may quote any service's credentials: :func:`mask_credentials`
masks those it can recognize.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

MASK = "***"
"""What a secret is shown as."""

SECRET_KEYS = frozenset({"password", "sslpassword"})
"""Parameters whose values are secrets (the ``password`` of a URL's user info too)."""

UNREADABLE = "<a DSN that is neither a postgresql:// URL nor keyword=value pairs>"
"""How a DSN that cannot be parsed is shown: not at all, since where its password is is unknown."""

_SHORTEST = 4
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_KEYWORD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*")


@dataclass(frozen=True)
class _Secret:
    start: int
    """Where the secret's text starts in the DSN."""
    end: int
    """Where it ends."""
    value: str
    """The secret itself (unquoted, unescaped)."""


def is_url(dsn: str) -> bool:
    """True when ``dsn`` starts with a URL scheme (``postgresql://``)."""
    return _SCHEME.match(dsn) is not None


def redact(dsn: object) -> str:
    """``dsn`` with every password shown as ``***``; for errors, logs and output.

    The URL's ``user:password@`` and its ``password=`` / ``sslpassword=``
    parameters are masked, and so are the same keys of keyword/value pairs.
    A DSN that is neither form is not shown at all.
    """
    if not isinstance(dsn, str):
        return UNREADABLE
    try:
        found = _secrets(dsn)
    except ValueError:
        return UNREADABLE
    shown, at = [], 0
    for secret in found:
        shown += [dsn[at : secret.start], MASK]
        at = secret.end
    shown.append(dsn[at:])
    return "".join(shown)


def scrub(text: str, dsn: object = None) -> str:
    """``text`` (e.g. a driver's error message) without the DSN's passwords or ``PGPASSWORD``.

    The DSN itself is replaced by :func:`redact`'s version, then every
    password it holds, as written and decoded, by ``***`` (passwords of three
    characters or fewer are left: they would mask letters everywhere).
    """
    if isinstance(dsn, str) and dsn:
        text = text.replace(dsn, redact(dsn))
    return _masked(text, passwords(dsn))


def passwords(dsn: object) -> set[str]:
    """The passwords ``dsn`` holds, each as written and decoded (none when it is no DSN)."""
    if not isinstance(dsn, str) or not dsn:
        return set()
    try:
        found = _secrets(dsn)
    except ValueError:
        return set()
    return {text for where in found for text in (where.value, dsn[where.start : where.end])}


def _masked(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each of ``secrets`` and ``PGPASSWORD`` shown as ``***``."""
    known = {*secrets, os.environ.get("PGPASSWORD", "")}
    # A secret of a character or two would mask letters all over the message.
    for secret in sorted((s for s in known if len(s) >= _SHORTEST), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


CREDENTIAL_WORDS = ("password", "passwd", "pwd", "secret", "api_key", "apikey", "api-key")
"""A ``name=value`` or ``name: value`` pair is a credential when its name contains one of
these (any case: ``PGPASSWORD=``, ``sasl_plain_password=``, ``"client_secret": "..."``)."""

# scheme://user:password@ (the user may be empty), the password up to the last
# '@' before a space or '/', as for a DSN (an unescaped '@' in the password).
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)[^\s/]*@")
_PAIR = re.compile(
    r"([\w.-]*(?:" + "|".join(re.escape(w) for w in CREDENTIAL_WORDS) + r")[\w.-]*[\"']?"
    r"\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s\"',;&)\]}]+)",
    re.IGNORECASE,
)
# Authorization: <scheme> <credentials>, and a bearer token anywhere.
_AUTHORIZATION = re.compile(
    r"\b(authorization[\"']?\s*[=:]\s*[\"']?(?:\w+\s+)?|bearer\s+)[^\s\"',;]+", re.IGNORECASE
)


def _masked_value(match: re.Match[str]) -> str:
    value = match[2]
    quote = value[0] if value[0] in "\"'" else ""
    return f"{match[1]}{quote}{MASK}{quote}"


def mask_credentials(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` (an exception's message, say) with the credentials it may quote shown as ``***``.

    Masked: the password of any URL's user info (``scheme://user:***@``), the
    value of a pair whose name holds one of :data:`CREDENTIAL_WORDS`
    (``password=***``, ``'api_key': '***'``), an ``Authorization`` header's
    credentials (``Authorization: Basic ***``), a ``Bearer ***`` token, and,
    wherever they appear, each of ``secrets`` and ``PGPASSWORD`` (of four
    characters or more).
    """
    text = _masked(text, secrets)
    text = _URL_PASSWORD.sub(rf"\1{MASK}@", text)
    text = _PAIR.sub(_masked_value, text)
    return _AUTHORIZATION.sub(rf"\1{MASK}", text)


DEFAULT_PORT = "5432"
"""Postgres' port when the DSN names a host and no port."""


def address(dsn: str) -> str:
    """Where ``dsn`` connects, ``host:port`` (comma-separated for several), for errors.

    Names no secret; a DSN naming no host says where asyncpg looks instead.
    """
    try:
        parts = urllib.parse.urlsplit(to_url(dsn))
        query = urllib.parse.parse_qs(parts.query)
    except ValueError:
        return UNREADABLE
    netloc = parts.netloc.rpartition("@")[2]
    hosts = netloc or ",".join(query.get("host", []))
    if not hosts:
        # asyncpg reads these itself; the message only says where to look.
        return "the default host and port (PGHOST, PGPORT)"
    port = ",".join(query.get("port", [])) or DEFAULT_PORT
    return ",".join(
        h if h.rpartition("]")[2].count(":") else f"{h}:{port}" for h in hosts.split(",")
    )


def to_url(dsn: str) -> str:
    """``dsn`` as a URL asyncpg reads: a URL as it is, keyword/value pairs converted.

    Raises ValueError (naming no part of the DSN) when it is neither form.
    """
    if is_url(dsn):
        return dsn
    pairs = _keywords(dsn)
    query = "&".join(
        f"{urllib.parse.quote(key)}={urllib.parse.quote(value, safe='')}" for key, value, _ in pairs
    )
    return f"postgresql://?{query}"


def _secrets(dsn: str) -> list[_Secret]:
    """Where the secrets of ``dsn`` are, in order; ValueError when it is neither form."""
    if is_url(dsn):
        return _url_secrets(dsn)
    return [
        _Secret(span[0], span[1], value)
        for key, value, span in _keywords(dsn)
        if key.lower() in SECRET_KEYS
    ]


def _url_secrets(dsn: str) -> list[_Secret]:
    found = []
    start = _SCHEME.match(dsn)
    assert start is not None  # noqa: S101 (is_url said so)
    rest = start.end()
    # The user info ends at the last '@': a password with an unescaped '@', '/'
    # or '?' is then still masked whole (a query value holding '@' is masked
    # too, which only costs some of what is shown).
    at = dsn.rfind("@", rest)
    if at >= 0:
        colon = dsn.find(":", rest, at)
        if colon >= 0:
            raw = dsn[colon + 1 : at]
            found.append(_Secret(colon + 1, at, urllib.parse.unquote(raw)))
    host_start = max(at + 1, rest)
    query_start = dsn.find("?", host_start)
    if query_start >= 0:
        end = dsn.find("#", query_start)
        end = len(dsn) if end < 0 else end
        position = query_start + 1
        for piece in dsn[query_start + 1 : end].split("&"):
            key, equals, value = piece.partition("=")
            if equals and urllib.parse.unquote_plus(key).lower() in SECRET_KEYS:
                value_start = position + len(key) + 1
                found.append(
                    _Secret(value_start, position + len(piece), urllib.parse.unquote_plus(value))
                )
            position += len(piece) + 1
    return found


def _keywords(dsn: str) -> list[tuple[str, str, tuple[int, int]]]:
    """libpq's ``key = value`` pairs: (key, value, where the value's text is).

    Values may be single-quoted; a backslash escapes the next character.
    """
    pairs = []
    position = 0
    while dsn[position:].strip():
        match = _KEYWORD.match(dsn, position)
        if match is None:
            raise ValueError(f"not keyword=value pairs (at character {position})")
        start = position = match.end()
        value: list[str] = []
        quoted = dsn.startswith("'", position)
        if quoted:
            position += 1
        while position < len(dsn):
            char = dsn[position]
            if char == "\\" and position + 1 < len(dsn):
                value.append(dsn[position + 1])
                position += 2
                continue
            if (quoted and char == "'") or (not quoted and char.isspace()):
                break
            value.append(char)
            position += 1
        if quoted:
            if position >= len(dsn):
                raise ValueError(f"a quoted value is not closed (from character {start})")
            position += 1
        pairs.append((match[1], "".join(value), (start, position)))
    if not pairs:
        raise ValueError("an empty DSN")
    return pairs
