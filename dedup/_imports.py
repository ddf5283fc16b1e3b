"""Import what a command names by spec: ``MODULE``, or ``MODULE:ATTRIBUTE``.

``dedup task run MODULE:FUNCTION``, ``dedup run MODULE[:FUNCTION]`` and
``dedup reconcile --module MODULE`` all import this way: like ``python -m``, a
module in the working directory (where the cron line or the command runs) is
found too.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any

from dedup import _errors as errors


def _import(name: str) -> ModuleType:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(name)


def module(name: str, *, what: str) -> ModuleType:
    """Import module ``name``, or a ConfigurationError naming ``what`` it is for."""
    try:
        return _import(name)
    except ImportError as exc:
        raise errors.ConfigurationError(f"cannot import {what} {name}: {exc}") from exc


def load(spec: str, *, what: str, default: str | None = None, expected: str = "") -> Any:
    """The callable ``spec`` names: ``MODULE:ATTRIBUTE`` (dotted), or ``MODULE`` and ``default``.

    Without ``default`` the attribute is required.  Errors name ``what`` is
    loaded (``job``, ``service``), the spec, and what was ``expected``.
    """
    name, _, attribute = spec.partition(":")
    attribute = attribute or default or ""
    if not name or not attribute:
        raise errors.ConfigurationError(
            f"{what} {spec!r}: name it MODULE:FUNCTION, e.g. myjobs:send_statements"
        )
    hint = f" ({expected})" if expected else ""
    try:
        found: Any = _import(name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise errors.ConfigurationError(f"cannot load {what} {spec}: {exc}{hint}") from exc
    if not callable(found):
        raise errors.ConfigurationError(f"{what} {spec} is not callable: {found!r}{hint}")
    return found
