"""DSNs shown without their passwords, in both forms libpq reads (dedup.conninfo)."""

from __future__ import annotations

import urllib.parse

import pytest

from dedup.data import _conninfo as conninfo

SECRET = "s3cr@t/pw?x=1&y#z"  # noqa: S105 (a made-up password, for masking)
"""A password with every character that has a meaning in a URL."""
ENCODED = urllib.parse.quote(SECRET, safe="")


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        ("postgresql://u:secret@h:5/d", "postgresql://u:***@h:5/d"),
        (f"postgresql://u:{ENCODED}@h:5/d", "postgresql://u:***@h:5/d"),
        ("postgresql:///d", "postgresql:///d"),
        ("postgresql://u@h/d?password=secret", "postgresql://u@h/d?password=***"),
        (
            "postgres://h1:5432,h2:5433/d?sslmode=require&password=secret&application_name=x",
            "postgres://h1:5432,h2:5433/d?sslmode=require&password=***&application_name=x",
        ),
        ("postgresql://h/d?sslpassword=secret#f", "postgresql://h/d?sslpassword=***#f"),
        ("postgresql://u:secret@[::1]:5/d", "postgresql://u:***@[::1]:5/d"),
        # Written unescaped, a password with '/' or '@' is still masked whole.
        ("postgresql://u:sec/r@t@h/d", "postgresql://u:***@h/d"),
        ("host=h user=u password=secret dbname=d", "host=h user=u password=*** dbname=d"),
        ("host=h password = 'a \\'b\\' c' port=5", "host=h password = *** port=5"),
        ("password=secret", "password=***"),
        ("host=/var/run/postgresql dbname=d", "host=/var/run/postgresql dbname=d"),
    ],
)
def test_every_form_of_password_is_masked(dsn: str, shown: str) -> None:
    assert conninfo.redact(dsn) == shown


@pytest.mark.parametrize(
    "dsn", ["u:secret@h/d", "host=h password='secret", "secret", "", "not a dsn=", "=secret"]
)
def test_a_dsn_of_neither_form_is_not_shown_at_all(dsn: str) -> None:
    assert conninfo.redact(dsn) == conninfo.UNREADABLE
    assert "secret" not in conninfo.scrub(f"failed: {dsn}", dsn)


def test_scrub_removes_the_dsn_and_its_password_as_written_and_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PGPASSWORD", "from-the-environment")
    dsn = f"postgresql://u:{ENCODED}@h/d?password={ENCODED}"
    text = f"cannot connect to {dsn}: {SECRET} {ENCODED} from-the-environment"
    scrubbed = conninfo.scrub(text, dsn)
    assert scrubbed == ("cannot connect to postgresql://u:***@h/d?password=***: *** *** ***")
    keyword = "host=h password='a b\\'c'"
    assert conninfo.scrub("a b'c / 'a b\\'c'", keyword) == "*** / ***"


def test_keyword_pairs_become_a_url_asyncpg_reads() -> None:
    url = conninfo.to_url("host=/tmp port=5433 user=u password='a b\\'c' dbname=d sslmode=disable")
    assert url == (
        "postgresql://?host=%2Ftmp&port=5433&user=u&password=a%20b%27c&dbname=d&sslmode=disable"
    )
    assert conninfo.to_url("postgresql://u@h/d") == "postgresql://u@h/d"
    with pytest.raises(ValueError, match="at character 0") as caught:
        conninfo.to_url("secret")
    assert "secret" not in str(caught.value)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (
            "GET https://svc:hunter22@api.example/v1 failed",
            "GET https://svc:***@api.example/v1 failed",
        ),
        ("redis://:hunter22@cache:6379/0", "redis://:***@cache:6379/0"),
        # An unescaped '@' in the password: masked up to the last '@' of the address.
        ("amqp://u:p@ss@mq/vhost", "amqp://u:***@mq/vhost"),
        (
            "no password here: http://host:8080/path?mail=a@b",
            "no password here: http://host:8080/path?mail=a@b",
        ),
        ("host=db user=app password=hunter22 dbname=x", "host=db user=app password=*** dbname=x"),
        ("PGPASSWORD=hunter22 psql", "PGPASSWORD=*** psql"),
        (
            "{'sasl_plain_password': 'hunter 22', 'user': 'a'}",
            "{'sasl_plain_password': '***', 'user': 'a'}",
        ),
        ('{"client_secret": "hunter22", "id": 7}', '{"client_secret": "***", "id": 7}'),
        ("api_key=abc123&page=2", "api_key=***&page=2"),
        ("X-Api-Key: abc123", "X-Api-Key: ***"),
        ("Authorization: Basic dXNlcjpwdw==", "Authorization: Basic ***"),
        ("sent Bearer eyJhbGciOi.J9.x-y_z to the API", "sent Bearer *** to the API"),
        # Words alone are no credentials: nothing follows them with = or :.
        (
            "password authentication failed for user app; authorization denied",
            "password authentication failed for user app; authorization denied",
        ),
        ("amount must be an integer in minor units", "amount must be an integer in minor units"),
    ],
)
def test_credentials_in_free_text_are_masked(text: str, shown: str) -> None:
    assert conninfo.mask_credentials(text) == shown


def test_known_secrets_are_masked_wherever_they_appear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGPASSWORD", "from-the-environment")
    text = "tried s3cret-pw and from-the-environment; a pw of 3 chars, abc, stays"
    assert conninfo.mask_credentials(text, {"s3cret-pw", "abc"}) == (
        "tried *** and ***; a pw of 3 chars, abc, stays"
    )
    assert conninfo.passwords(f"postgresql://u:{ENCODED}@h/d") == {SECRET, ENCODED}
    assert conninfo.passwords("host=h password=pw1234") == {"pw1234"}
    assert conninfo.passwords(None) == conninfo.passwords("not a dsn=") == set()
