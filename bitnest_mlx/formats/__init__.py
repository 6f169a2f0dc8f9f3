"""On-disk formats: pure I/O and validation, no model code."""

from __future__ import annotations

from pathlib import Path


def detect(path: str | Path) -> str | None:
    """ "bitnest" (a bitnest manifest), "dsv4" (config.json model_type deepseek_v4) or None.

    Cheap (a few small files), since mlx-lm's loader asks it about every model it loads.
    """
    from . import bitnest, dsv4_bundle

    if bitnest.is_package(path):
        return "bitnest"
    if dsv4_bundle.is_bundle(path):
        return "dsv4"
    return None
