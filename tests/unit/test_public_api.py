"""The names outside code relies on (docs/reference/api.md) are exactly the public surface."""

from __future__ import annotations

import inspect
import pkgutil
import tomllib

import pytest

import dedup
from dedup import _cli as cli
from tests.conftest import ROOT

CONTRACT = {
    "IdempotentConsumer",
    "Message",
    "Tx",
    "keys",
    "wrap",
    "migrate",
    "StaleTokenError",
    "TaskRunner",
    "TaskRun",
    "TaskOutcome",
    "Outcome",
    "claim",
}


def test_all_holds_the_contract_and_every_name_exists() -> None:
    assert CONTRACT <= set(dedup.__all__)
    assert all(hasattr(dedup, name) for name in dedup.__all__)
    assert sorted(dedup.__all__) == dedup.__all__


def test_every_public_name_has_a_docstring() -> None:
    for name in dedup.__all__:
        assert inspect.getdoc(getattr(dedup, name)), name


def test_key_strategies_of_the_contract() -> None:
    for name in ("header", "json_field", "kafka_key", "offset", "first"):
        assert callable(getattr(dedup.keys, name))


def test_claim_signature_of_the_contract() -> None:
    params = inspect.signature(dedup.claim).parameters
    assert list(params)[:2] == ["conn", "records"]
    for name in ("namespace", "key"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert {"fresh", "duplicates", "conflicts"} <= set(dedup.ClaimResult.__dataclass_fields__)


def test_consumer_signature_of_the_contract() -> None:
    params = inspect.signature(dedup.IdempotentConsumer).parameters
    for name in (
        "topics",
        "group_id",
        "bootstrap_servers",
        "dsn",
        "pool",
        "key",
        "namespace",
        "batch_size",
        "install_signal_handlers",
    ):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert dedup._consumer.DEFAULT_BATCH_SIZE == 500


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert dedup.__version__ == version
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"dedup (dedup-kafka) {version}\n"


def test_modules_other_than_keys_are_private() -> None:
    # The face is `dedup` itself (and `dedup.keys`, documented as a module):
    # everything else is free to change shape without breaking a user.
    public = sorted(
        m.name
        for m in pkgutil.iter_modules(dedup.__path__)
        if not m.name.startswith("_") and m.name != "keys"
    )
    assert public == []
