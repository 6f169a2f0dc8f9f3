"""`bench --kernels`: each kernel's executed operations (counted in the CPU emulator) as
estimated ALU cycles per unit of work, against the cycles each Apple GPU has per unit while
streaming that unit's bytes at its memory bandwidth (docs/kernels.md).

Nothing here runs on a GPU: speeds are estimated from operation counts and public chip figures.
"""

from __future__ import annotations

import shutil

from ..runtime.chips import GPUS, Chip


def missing_tools() -> list[str]:
    """The compilers the counting emulator needs that this machine lacks."""
    from ..kernels.emulator import counting, emulate

    return [c for c in (emulate.cxx(), counting.clang()) if shutil.which(c) is None]


def estimate(result: dict, chips: tuple[Chip, ...] = GPUS) -> dict:
    """One profiled case with, per chip, its cycle budget and the estimated fraction of the
    bandwidth roofline (1.0: memory-bound, ALUs keep up)."""
    per_chip = {}
    for chip in chips:
        budget = chip.budget(result["stream_bytes"])
        per_chip[chip.name] = {"budget": budget, "roofline": min(1.0, budget / result["cycles"])}
    return {**result, "chips": per_chip}


def run() -> list[dict]:
    from ..kernels.emulator import profile

    return [estimate(r) for r in profile.profile()]


def report(rows: list[dict], chips: tuple[str, ...] = ("M1", "M4 Max")) -> str:
    head = f"{'kernel':<12} {'case':<20} {'unit':<18} {'cycles':>7} {'div':>5} {'conv':>5}"
    head += "".join(f" {c + ' budget':>14} {'roof':>5}" for c in chips)
    lines = [
        "estimated from operation counts in the CPU emulator (no GPU ran): lane-cycles per unit",
        head,
    ]
    for r in rows:
        p = r["per_unit"]
        line = (
            f"{r['kernel']:<12} {r['case']:<20} {r['unit']:<18} {r['cycles']:>7.2f} "
            f"{p['div']:>5.2f} {p['convert'] + p['round']:>5.2f}"
        )
        for c in chips:
            e = r["chips"][c]
            line += f" {e['budget']:>14.2f} {e['roofline']:>5.0%}"
        lines.append(line)
    return "\n".join(lines)
