"""Apple GPU facts the speed models read: memory bandwidth, GPU cores and clock per chip name.

Bandwidth: Apple's specifications (each name's largest configuration). GPU cores: Apple's
specifications. Clocks: M1 and M2 families from philipturner/metal-benchmarks; M3 and M4 from
third-party spec tables (hmc-tech.com), which Apple does not publish, so treat them as
approximate.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# Peak memory bandwidth (GB/s) of each chip name's largest configuration.
PEAK_GBS = {
    "M1": 68.25, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800,
    "M2": 100, "M2 Pro": 200, "M2 Max": 400, "M2 Ultra": 800,
    "M3": 100, "M3 Pro": 150, "M3 Max": 400, "M3 Ultra": 819,
    "M4": 120, "M4 Pro": 273, "M4 Max": 546,
}  # fmt: skip


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


GPUS = (
    Chip("M1", PEAK_GBS["M1"], 8, 1.278),
    Chip("M1 Pro", PEAK_GBS["M1 Pro"], 16, 1.296),
    Chip("M1 Max", PEAK_GBS["M1 Max"], 32, 1.296),
    Chip("M1 Ultra", PEAK_GBS["M1 Ultra"], 64, 1.296),
    Chip("M2", PEAK_GBS["M2"], 10, 1.398),
    Chip("M2 Pro", PEAK_GBS["M2 Pro"], 19, 1.398),
    Chip("M2 Max", PEAK_GBS["M2 Max"], 38, 1.398),
    Chip("M2 Ultra", PEAK_GBS["M2 Ultra"], 76, 1.398),
    Chip("M3", PEAK_GBS["M3"], 10, 1.398),
    Chip("M3 Pro", PEAK_GBS["M3 Pro"], 18, 1.398),
    Chip("M3 Max", PEAK_GBS["M3 Max"], 40, 1.398),
    Chip("M3 Ultra", PEAK_GBS["M3 Ultra"], 80, 1.398),
    Chip("M4", PEAK_GBS["M4"], 10, 1.578),
    Chip("M4 Pro", PEAK_GBS["M4 Pro"], 20, 1.578),
    Chip("M4 Max", PEAK_GBS["M4 Max"], 40, 1.578),
)


def family(name: str) -> str:
    """The family ("M1/M2" or "M3+") of a chip name such as "M4 Max" or "Apple M2 Pro": those
    whose multi-row quantized matmuls behave alike (speed_model's v(M) table; MLX's qmv_wide
    serves M3 and later)."""
    for word in name.split():
        if len(word) >= 2 and word[0] == "M" and word[1:].isdigit():
            return "M1/M2" if int(word[1:]) <= 2 else "M3+"
    raise ValueError(f"not an Apple M-series chip name: {name!r}")


def gpu(name: str) -> Chip:
    """The `GPUS` entry whose name is the longest one contained in `name` ("Apple M4 Max" ->
    M4 Max, not M4); ValueError naming the known chips if none is."""
    known = [c for c in GPUS if f" {c.name} " in f" {name} "]
    if not known:
        raise ValueError(f"unknown chip {name!r}; known: {', '.join(c.name for c in GPUS)}")
    return max(known, key=lambda c: len(c.name))


def chip_peak() -> tuple[str, float] | None:
    """(device name, peak GB/s) of this Mac's GPU, or None off Metal / for an unknown chip. The
    longest matching name in `GPUS` wins ("M4 Max" before "M4"); binned parts (e.g. the
    300 GB/s M3 Max) differ from it."""
    if not mx.metal.is_available():
        return None
    name = str(mx.metal.device_info().get("device_name", ""))
    try:
        return name, gpu(name).bandwidth_gbs
    except ValueError:
        return None


def achieved_bandwidth(bytes_per_token: dict, tps: dict, peak: tuple[str, float]) -> dict:
    """GB/s implied by the measured tok/s and the roofline's bytes per token, and its fraction
    of the chip's peak (decode is bandwidth-bound: 1.0 would be the ceiling)."""
    chip, bw = peak
    out = {"chip": chip, "peak_gbs": bw}
    for mode in ("draft", "target"):
        gbs = bytes_per_token[mode] * tps[mode] / 1e9
        out[mode] = {"gbs": gbs, "fraction_of_peak": gbs / bw}
    return out
