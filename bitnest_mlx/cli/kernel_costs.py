"""`bench --kernels`: each kernel's executed operations (counted in the CPU emulator) as
estimated ALU cycles per unit of work, against the cycles each Apple GPU has per unit while
streaming that unit's bytes at its memory bandwidth (docs/kernels.md).

Nothing here runs on a GPU: speeds are estimated from operation counts and public chip figures.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

from ..roofline import PEAK_GBS


@dataclass(frozen=True)
class Chip:
    """A GPU configuration: the largest of its name. ALUs are 128 per core on every M-series
    GPU (FP32 lanes)."""

    name: str
    bandwidth_gbs: float
    gpu_cores: int
    clock_ghz: float

    @property
    def alus(self) -> int:
        return 128 * self.gpu_cores

    def budget(self, stream_bytes: float) -> float:
        """Lane-cycles the GPU has per unit of work while reading its `stream_bytes` at peak
        bandwidth: past this, ALUs and not memory set the speed."""
        return self.alus * self.clock_ghz * stream_bytes / self.bandwidth_gbs


# Bandwidth: roofline.PEAK_GBS. GPU cores: Apple's specifications. Clocks: M1 and M2 families from
# philipturner/metal-benchmarks; M3 and M4 from third-party spec tables (hmc-tech.com), which
# Apple does not publish, so treat them as approximate.
CHIPS = (
    Chip("M1", PEAK_GBS["M1"], 8, 1.278),
    Chip("M1 Pro", PEAK_GBS["M1 Pro"], 16, 1.296),
    Chip("M1 Max", PEAK_GBS["M1 Max"], 32, 1.296),
    Chip("M2", PEAK_GBS["M2"], 10, 1.398),
    Chip("M2 Pro", PEAK_GBS["M2 Pro"], 19, 1.398),
    Chip("M2 Max", PEAK_GBS["M2 Max"], 38, 1.398),
    Chip("M3", PEAK_GBS["M3"], 10, 1.398),
    Chip("M3 Pro", PEAK_GBS["M3 Pro"], 18, 1.398),
    Chip("M3 Max", PEAK_GBS["M3 Max"], 40, 1.398),
    Chip("M4", PEAK_GBS["M4"], 10, 1.578),
    Chip("M4 Pro", PEAK_GBS["M4 Pro"], 20, 1.578),
    Chip("M4 Max", PEAK_GBS["M4 Max"], 40, 1.578),
)


def missing_tools() -> list[str]:
    """The compilers the counting emulator needs that this machine lacks."""
    from ..kernels.emulator import counting, emulate

    return [c for c in (emulate.CXX, counting.CLANG) if shutil.which(c) is None]


def estimate(result: dict, chips: tuple[Chip, ...] = CHIPS) -> dict:
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


def main(as_json: bool = False) -> int:
    missing = missing_tools()
    if missing:
        print(
            "bench --kernels counts operations in the CPU emulator, which needs a C++ compiler: "
            f"{', '.join(missing)} not found (install g++ and clang, or set BITNEST_EMU_CXX / "
            "BITNEST_EMU_CLANG)"
        )
        return 2
    rows = run()
    print(json.dumps(rows, indent=2) if as_json else report(rows))
    return 0
