"""docs/reference/configuration.md names every environment variable the code reads."""

from __future__ import annotations

import re

from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "reference" / "configuration.md"
PYTHON_READS = [
    re.compile(r"""environ(?:\.get)?[\[(]\s*["']([A-Z][A-Z0-9_]+)["']"""),
    re.compile(r"""getenv\(\s*["']([A-Z][A-Z0-9_]+)["']"""),
    re.compile(r"""\benv=["']([A-Z][A-Z0-9_]+)["']"""),  # the services' option(..., env=)
    re.compile(r"""^[A-Z_]+ = ["']([A-Z][A-Z0-9_]+)["']""", re.MULTILINE),  # NAME = "VAR"
]
SHELL_READS = re.compile(r"\$\{?([A-Z][A-Z0-9_]+)")
NOT_OURS = {"PATH", "HOME", "XDG_CACHE_HOME", "BASH_SOURCE", "DEBIAN_FRONTEND", "VIRTUAL_ENV"}
# The services' per-service options: option(..., env=f"{prefix}_TOPIC") for each prefix.
PER_SERVICE = ("TOPIC", "GROUP", "BATCH_SIZE", "MAX_ATTEMPTS")
SERVICES = ("PAYMENTS", "COUPONS", "NOTIFICATIONS")


def read_by_the_code() -> set[str]:
    found: set[str] = set()
    for folder in ("dedup", "consumers", "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            for pattern in PYTHON_READS:
                found.update(pattern.findall(text))
            # The dispatcher's options: ("--claim-ttl", "CLAIM_TTL", ...) under NOTIFICATIONS_.
            if 'env=f"NOTIFICATIONS_{env}"' in text:
                found.update(
                    f"NOTIFICATIONS_{n}" for n in re.findall(r'\("--[a-z-]+", "([A-Z_]+)"', text)
                )
    for path in (ROOT / "compose" / "local").iterdir():
        if path.is_file() and path.suffix not in (".xml", ".properties", ".py"):
            found.update(SHELL_READS.findall(path.read_text(encoding="utf-8")))
    found.update(f"{s}_{o}" for s in SERVICES for o in PER_SERVICE)
    found.update(re.findall(r"\$\(([A-Z_]+)\)", (ROOT / "Makefile").read_text()))
    return {name for name in found if not name.startswith("OTEL_")} - NOT_OURS - _make_only()


def _make_only() -> set[str]:
    """The Makefile's own names (PYTHON, VENV, ...), set in it, not read from the environment."""
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Z_]+) [:?]?=", text, re.MULTILINE)) - {"BENCH_ARGS"}


def test_every_variable_the_code_reads_is_on_the_configuration_page() -> None:
    page = PAGE.read_text(encoding="utf-8")
    missing = sorted(name for name in read_by_the_code() if f"`{name}`" not in page)
    assert not missing, f"variables read but not in {PAGE.relative_to(ROOT)}: {missing}"


def test_the_scan_finds_what_it_should() -> None:
    # A guard against a scan that finds nothing and so passes.
    names = read_by_the_code()
    assert {"DEDUP_DSN", "DEDUP_LOG_LEVEL", "DEDUP_RECONCILE_MODULES", "DEDUP_CACHE"} <= names
    assert {"RECEIVER_PORT", "NOTIFICATIONS_CLAIM_TTL", "CHAOS_MATRIX", "BENCH_ARGS"} <= names
