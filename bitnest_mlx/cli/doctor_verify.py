"""bitnest-doctor's verify cost: v(M) = the time of an M-row target pass of one Llama-3.2-3B MLP
projection (K 3072, N 8192, group 64) over a 1-row pass, timed on this machine for the pure
path and, on Metal, the dual-plane kernel; printed beside `speed_model`'s table for this chip.
This is how real Macs correct the table (docs/speculative.md, "The verify cost v(M)").
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from ..layers.dual_plane import random_linear
from ..layers.options import RunOptions
from ..runtime.chips import gpu
from ..runtime.speed_model import verify_cost

ROWS = (1, 2, 4, 8, 16)
SHAPE = (3072, 8192, 64)  # K, N, weight group


def _median_seconds(fn, repeats: int) -> float:
    mx.eval(fn())  # warm-up: compilation and allocation
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def measure(paths: dict[str, RunOptions], repeats: int) -> dict[str, dict[int, float]]:
    """{path: {M: seconds of an M-row target pass}} (median of `repeats`)."""
    k, n, group = SHAPE
    lin = random_linear(k, n, group, seed=0)
    xs = {m: mx.random.normal((m, k), key=mx.random.key(m)) for m in ROWS}
    return {
        path: {m: _median_seconds(lambda m=m, o=o: lin(xs[m], o), repeats) for m in ROWS}
        for path, o in paths.items()
    }


def verify_report(kernels_on: bool, chip: str | None, repeats: int) -> dict:
    """Measured v(M) per path (None: the path does not run here) beside the table's value for
    `chip` (None: a chip the table does not know, or not a Mac)."""
    paths = {"pure": RunOptions(mode="target", use_kernels=False)}
    if kernels_on:
        paths["kernel"] = RunOptions(mode="target", use_kernels=True)
    seconds = measure(paths, repeats)
    try:
        known = gpu(chip).name if chip else None
    except ValueError:
        known = None
    out = {"shape": {"k": SHAPE[0], "n": SHAPE[1], "group": SHAPE[2]}, "table_chip": known}
    for path in ("pure", "kernel"):
        t = seconds.get(path)
        out[path] = {
            "seconds": None if t is None else {str(m): t[m] for m in ROWS},
            "measured": None if t is None else {str(m): t[m] / t[1] for m in ROWS},
            "table": None if known is None else {str(m): verify_cost(m, known, path) for m in ROWS},
        }
    return out


def markdown(v: dict) -> list[str]:
    s = v["shape"]
    lines = [
        f"## Verify cost v(M) (target pass of a {s['k']}x{s['n']} projection, group "
        f"{s['group']}; M rows over 1 row)",
        "",
        "| path | " + " | ".join(f"M={m}" for m in ROWS) + " |",
        "|---|" + "---|" * len(ROWS),
    ]
    for path in ("pure", "kernel"):
        for kind in ("measured", "table"):
            row = v[path][kind]
            name = f"{path}, {kind}" + (f" ({v['table_chip']})" if kind == "table" else "")
            cells = ["—"] * len(ROWS) if row is None else [f"{row[str(m)]:.2f}" for m in ROWS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines
