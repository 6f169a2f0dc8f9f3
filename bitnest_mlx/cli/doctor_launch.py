"""bitnest-doctor's step costs: t_k, what one more kernel adds to a step, and t_sync, what one
host sync costs, timed on this machine beside the step-time model's constants for its chip
(runtime/step_time.py, docs/step-time.md).

* t_k: a chain of tiny dependent kernels (an add on 16 floats, each on the previous result),
  built first and evaluated at once: the time of a long chain minus a short one over the kernels
  between, which cancels the eval's own cost. Each kernel waits on the one before, as a decode
  step's do, and moves no bytes worth counting.
* t_sync: `mx.eval` of one such kernel on a fresh input, minus t_k: the round trip of handing
  work to the device and waiting on it.

Beside them, `dsv4_report` prices a DeepSeek-V4-Flash decode token with these measured
constants (`measurement/dsv4_price.py`: bytes from the real bundle's config at 2k and 64k
context, the stored kernels a token of each path, one host sync a token), so the projection of
docs/deepseek-v4.md is checked on the user's Mac: its bytes term streams at the chip's peak
bandwidth times f, or, on a chip the model does not know, at the fit chip's, marked assumed.

Off Metal these are the CPU backend's costs, printed for the report's shape only.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from ..measurement import dsv4_price
from ..runtime.chips import gpu
from ..runtime.step_time import FITTED_CHIP, constants, provenance

CHAIN = (100, 1000)  # kernels in the short and the long chain
WIDTH = 16  # floats each kernel touches


def _chain_seconds(n: int, seed: float) -> float:
    """Seconds of one mx.eval of `n` dependent adds on a fresh evaluated input."""
    x = mx.full((WIDTH,), seed)
    mx.eval(x)
    y = x
    for _ in range(n):
        y = y + 1.0
    tic = time.perf_counter()
    mx.eval(y)
    return time.perf_counter() - tic


def _median(n: int, repeats: int) -> float:
    _chain_seconds(n, -1.0)  # warm-up: allocation
    return statistics.median(_chain_seconds(n, float(i)) for i in range(repeats))


def measure(repeats: int) -> dict[str, float]:
    """{"t_kernel": s, "t_sync": s, "eval_one": s}: medians of `repeats` runs each."""
    short, long = CHAIN
    t_short, t_long = _median(short, repeats), _median(long, repeats)
    t_kernel = max((t_long - t_short) / (long - short), 0.0)
    one = _median(1, repeats)
    return {"t_kernel": t_kernel, "t_sync": max(one - t_kernel, 0.0), "eval_one": one}


def known_chip(chip: str | None) -> str | None:
    """The step-time model's name of `chip` ("Apple M3 Max" -> "M3 Max"), None if unknown."""
    try:
        return gpu(chip).name if chip else None
    except ValueError:
        return None


def launch_report(chip: str | None, repeats: int) -> dict:
    """Measured t_k and t_sync (microseconds) beside the model's constants for `chip` (None or
    a chip the model does not know: no table row)."""
    found = measure(max(repeats, 5))
    known = known_chip(chip)
    table = constants(known) if known else None
    return {
        "chain": list(CHAIN),
        "repeats": max(repeats, 5),
        "t_kernel_us": found["t_kernel"] * 1e6,
        "t_sync_us": found["t_sync"] * 1e6,
        "table_chip": known,
        "table_t_kernel_us": None if table is None else table.t_kernel * 1e6,
        "table_t_sync_us": None if table is None else table.t_sync * 1e6,
        "table_provenance": None if known is None else provenance(known),
    }


def markdown(s: dict) -> list[str]:
    def cell(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    short, long = s["chain"]
    lines = [
        f"## Step costs (chains of {short} and {long} dependent kernels; eval of one)",
        "",
        "| | t_k (us a kernel) | t_sync (us a host sync) |",
        "|---|---|---|",
        f"| measured | {cell(s['t_kernel_us'])} | {cell(s['t_sync_us'])} |",
        f"| step-time model ({s['table_chip']}) | {cell(s['table_t_kernel_us'])} "
        f"| {cell(s['table_t_sync_us'])} |",
        "",
    ]
    if s["table_provenance"]:
        lines += [f"Model constants: {s['table_provenance']}.", ""]
    return lines


def dsv4_report(step_costs: dict, chip: str | None) -> dict:
    """DeepSeek-V4-Flash's decode step priced with this machine's measured t_k and t_sync
    (`step_costs`, from `launch_report`): per context and path its kernels and syncs a token,
    the step's terms, tok/s and bound. The bytes term uses `chip`'s peak bandwidth and f when
    the model knows the chip; otherwise the fit chip's, and says it is assumed."""
    known = known_chip(chip)
    c = constants(
        known or FITTED_CHIP,
        t_kernel=step_costs["t_kernel_us"] * 1e-6,
        t_sync=step_costs["t_sync_us"] * 1e-6,
    )
    if known:
        bandwidth = f"{known}'s peak (runtime/chips.py) at f {c.f}: {provenance(known)}"
    else:
        bandwidth = (
            f"assumed: {FITTED_CHIP}'s {c.bandwidth_gbs:g} GB/s at f {c.f} (this machine's chip "
            "is not a Mac the model knows)"
        )
    config = dsv4_price.flash_config()
    rows = [
        dsv4_price.step_row(config, c, t, path)
        for t in dsv4_price.CONTEXTS
        for path in dsv4_price.PATHS
    ]
    return {
        "model": config.get("_name_or_path"),
        "chip": known,
        "bandwidth_gbs": c.bandwidth_gbs,
        "bandwidth": bandwidth,
        "t_kernel_us": step_costs["t_kernel_us"],
        "t_sync_us": step_costs["t_sync_us"],
        "rows": rows,
    }


def dsv4_markdown(d: dict) -> list[str]:
    lines = [
        f"## DeepSeek-V4-Flash on these step costs ({d['model']}, kernels and syncs a token "
        "as counted on the demo bundle)",
        "",
        "| context | path | kernels a token | syncs a token | GB a token | bytes ms | kernels ms "
        "| syncs ms | tok/s | bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        lines.append(
            f"| {r['context']} | {r['path']} | {r['kernels']:.0f} | {r['syncs']:g} | "
            f"{r['gb']:.3f} | {r['bytes_ms']:.2f} | {r['kernels_ms']:.2f} | {r['syncs_ms']:.2f} "
            f"| {r['tokens_per_second']:.1f} | {r['bound']} |"
        )
    lines += [
        "",
        f"t_k {d['t_kernel_us']:.2f} us and t_sync {d['t_sync_us']:.2f} us measured here; bytes "
        f"at {d['bandwidth_gbs']:g} GB/s: {d['bandwidth']}.",
        "",
    ]
    return lines
