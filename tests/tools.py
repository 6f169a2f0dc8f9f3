"""System tools the tests use (compilers): a missing one is a skip that says so, except where
BITNEST_REQUIRE_TOOLS is set (.ci/run sets it after installing every tool), where conftest.py
turns that skip into a failure, so CI never passes by skipping what it was meant to run."""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRE_ENV = "BITNEST_REQUIRE_TOOLS"
MISSING = "missing system tool"  # the reason's prefix conftest.py looks for


def _reason(tools: tuple[str, ...], why: str) -> str:
    return f"{MISSING} {' / '.join(tools)}: {why} (.ci/run installs it)"


def absent(*tools: str) -> tuple[str, ...]:
    return tuple(t for t in tools if shutil.which(t) is None)


def needs(*tools: str, why: str) -> pytest.MarkDecorator:
    """Skip (fail under BITNEST_REQUIRE_TOOLS) unless every tool is on PATH."""
    return pytest.mark.skipif(bool(absent(*tools)), reason=_reason(absent(*tools) or tools, why))


def missing(*tools: str, why: str) -> NoReturn:
    """Inside a test or fixture: the same skip (or failure) for a tool found missing there."""
    pytest.skip(_reason(tools, why))


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def reference(module: str, why: str) -> ModuleType:
    """Import a reference implementation the tests compare against (e.g. transformers'
    deepseek_v4): a missing one is the same skip as a missing tool, so under
    BITNEST_REQUIRE_TOOLS a version without it fails instead of passing by skipping."""
    try:
        return importlib.import_module(module)
    except ImportError:
        missing(module, why=why)
