"""`python -m bitnest_mlx.doctor` (`bitnest-doctor`): does this runtime work, and work fast, on
this machine? A short Markdown report to paste into an issue (`--json`: the same as data).

* the machine: OS, chip and its memory bandwidth, memory, MLX / mlx-lm versions, Metal;
* each kernel use (dual-plane qmv at groups 32/64/128, grouped q/k/v, gate/up epilogue,
  nested-KV attention and its merge, Hadamard, MXTQ gather and fused SwiGLU at 2 and 4 bits):
  compiled, self-test passed, GB/s at a decode-sized shape beside the chip's bandwidth;
* the demo package decoded greedily with kernels on and off (same tokens? tok/s of each), and
  its draft / target / speculative tok/s;
* the verify cost v(M) for M = 1, 2, 4, 8, 16 rows, timed on both paths, beside the speed
  model's table for this chip (`doctor_verify`);
* the step costs t_k (a kernel) and t_sync (a host sync), timed on chains of tiny dependent
  kernels, beside the step-time model's constants for this chip (`doctor_launch`);
* DeepSeek-V4-Flash's kernels and host syncs a decode token and its projected tok/s on those
  measured step costs (`doctor_launch.dsv4_report`).

Off Metal the kernels are reported unavailable and only the pure-MLX part runs (`--emulator`
runs their self-tests in the CPU emulator instead, which needs g++). Under a minute on a Mac:
self-tests at the layers' few-KB shapes, 20 timed replays per kernel, a 64-token decode.
docs/doctor.md says what a healthy report looks like and documents the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import replace

import mlx.core as mx

from .. import kernels
from ..runtime import speculative
from ..runtime.chips import chip_peak
from ..runtime.demo import demo_path
from ..runtime.loader import load
from ..runtime.sampling import make_sampler
from .args import positive_int
from .blas import INSTALL
from .blas import status as openblas_status
from .doctor_kernels import run_checks
from .doctor_launch import dsv4_markdown, dsv4_report, launch_report
from .doctor_launch import markdown as launch_markdown
from .doctor_verify import markdown as verify_markdown
from .doctor_verify import verify_report

SCHEMA = 1
PROMPT = "The river"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bitnest-doctor",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="demo tokens per run")
    p.add_argument("--repeats", type=int, default=20, help="timed replays per kernel (Metal)")
    p.add_argument(
        "--emulator",
        action="store_true",
        help="run the kernels' self-tests in the CPU emulator (off Metal; needs g++)",
    )
    return p


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def system() -> dict:
    """The machine and the software stack."""
    metal = mx.metal.is_available()
    if metal:
        info = mx.metal.device_info()
        chip, memory = str(info.get("device_name", "")), info.get("memory_size")
    else:
        chip = platform.processor() or platform.machine()
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peak = chip_peak()
    return {
        "os": platform.platform(),
        "machine": platform.machine(),
        "chip": chip,
        "memory_gb": round(memory / 1e9, 1) if memory else None,
        "peak_gbs": peak[1] if peak else None,
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx-lm"),
        "bitnest_mlx": _version("bitnest-mlx"),
        "metal": metal,
        "openblas": openblas_status(),
    }


def kernel_report(runner: kernels.Runner | None, repeats: int, peak_gbs: float | None) -> dict:
    """The kernel checks through `runner` (None: the Metal kernels, when there is Metal)."""
    if runner is None and not mx.metal.is_available():
        reason = (
            "no Metal device (the pure-MLX path serves every call; --emulator runs the "
            "kernels' self-tests in the CPU emulator)"
        )
        return {"runner": None, "available": False, "reason": reason, "compiled": {}, "checks": []}
    metal = runner is None
    name = "metal" if metal else ("emulator" if "emulator" in runner.__module__ else "custom")
    found = run_checks(runner or kernels.metal_runner, repeats if metal else 0, metal, peak_gbs)
    return {"runner": name, "available": metal, "reason": None, **found}


def _timed(steps: Iterator) -> tuple[list[int], float]:
    """Tokens of a decode and its tok/s over the whole call, the short prompt included: the
    speculative loop yields a round's tokens at once, so timing from the first token would
    leave out the round that made it."""
    tic = time.perf_counter()
    tokens = [int(step[0]) for step in steps]
    return tokens, len(tokens) / (time.perf_counter() - tic)


def decode_report(max_tokens: int, kernels_on: bool) -> dict:
    """The demo decoded greedily: kernels on vs off (when there are kernels), then draft,
    target and speculative tok/s on the path this machine uses."""
    from mlx_lm.generate import generate_step

    model, tokenizer = load(demo_path())
    prompt = mx.array(tokenizer.encode(PROMPT), dtype=mx.uint32)
    base = model.options

    def plain(mode: str, use_kernels: bool) -> tuple[list[int], float]:
        model.options = replace(base, mode=mode, use_kernels=use_kernels)
        list(generate_step(prompt, model, max_tokens=2))  # warm-up: allocation, compiles
        return _timed(generate_step(prompt, model, max_tokens=max_tokens))

    out: dict = {"model": "demo", "prompt": PROMPT, "max_tokens": max_tokens}
    if kernels_on:
        on, off = plain("target", True), plain("target", False)
        same = next((i for i, (a, b) in enumerate(zip(on[0], off[0])) if a != b), None)
        out["kernels_vs_pure"] = {
            "paths": kernels.report(),  # which kernels served the decode, by call count
            "identical": on[0] == off[0],
            "first_difference": same,
            "kernels_tps": on[1],
            "pure_tps": off[1],
        }
    else:
        out["kernels_vs_pure"] = None
    for mode in ("draft", "target"):
        out[f"{mode}_tps"] = plain(mode, kernels_on)[1]
    model.options = replace(base, use_kernels=kernels_on)
    for n in (2, max_tokens):  # the first is a warm-up, as for the plain runs
        stats = speculative.SpeculativeStats()
        steps = speculative.speculative_generate_step(
            prompt, model, max_tokens=n, sampler=make_sampler(0.0), stats=stats
        )
        out["speculative_tps"] = _timed(steps)[1]
    out["acceptance"] = stats.acceptance_rate
    return out


def collect(args: argparse.Namespace, runner: kernels.Runner | None = None) -> dict:
    """The whole report. `runner` replaces the Metal kernels (the CPU emulator in tests)."""
    tic = time.perf_counter()
    sysinfo = system()
    if runner is None and args.emulator:
        from ..kernels import emulator

        runner = emulator.run
    report = {
        "schema": SCHEMA,
        "system": sysinfo,
        "kernels": kernel_report(runner, args.repeats, sysinfo["peak_gbs"]),
    }
    report["decode"] = decode_report(args.max_tokens, kernels_on=report["kernels"]["available"])
    # Off Metal a pass is compute-bound and slow: fewer replays say as much.
    repeats = args.repeats if sysinfo["metal"] else min(args.repeats, 3)
    report["verify_cost"] = verify_report(report["kernels"]["available"], sysinfo["chip"], repeats)
    chip = sysinfo["chip"] if sysinfo["metal"] else None
    report["step_costs"] = launch_report(chip, repeats)
    report["dsv4_projection"] = dsv4_report(report["step_costs"], chip)
    report["seconds"] = time.perf_counter() - tic
    return report


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "—" if x is None else format(x, fmt)


def _openblas_row(found: str | None) -> list[str]:
    """The system table's OpenBLAS line (Linux only: elsewhere MLX uses Accelerate)."""
    if found is None:
        return []
    if found == "missing":
        found = f"missing: a conversion's calibration runs about 10x slower; {INSTALL}"
    return [f"| OpenBLAS | {found} |"]


def markdown(r: dict) -> str:
    s, k, d = r["system"], r["kernels"], r["decode"]
    peak = f" (peak {s['peak_gbs']} GB/s)" if s["peak_gbs"] else ""
    lines = [
        "# bitnest-doctor report",
        "",
        "| | |",
        "|---|---|",
        f"| OS | {s['os']} |",
        f"| chip | {s['chip']}{peak} |",
        f"| memory | {_num(s['memory_gb'])} GB |",
        f"| Python / MLX / mlx-lm / bitnest-mlx | {s['python']} / {s['mlx']} / {s['mlx_lm']} / "
        f"{s['bitnest_mlx']} |",
        f"| Metal | {'yes' if s['metal'] else 'no'} |",
        *_openblas_row(s["openblas"]),
        "",
        f"## Kernels (runner: {k['runner'] or 'none'})",
        "",
    ]
    if k["reason"]:
        lines += [f"Kernels unavailable: {k['reason']}.", ""]
    if k["checks"]:
        lines += [
            "| check | kernels | compiled | self-test | GB/s | of peak |",
            "|---|---|---|---|---|---|",
        ]
        for c in k["checks"]:
            frac = "—" if c["peak_fraction"] is None else f"{100 * c['peak_fraction']:.0f} %"
            lines.append(
                f"| {c['name']} | {', '.join(c['kernels'])} | {'yes' if c['compiled'] else 'no'} "
                f"| {c['self_test']} | {_num(c['gbps'])} | {frac} |"
            )
        lines.append("")
    title = f"## Demo decode ({d['max_tokens']} tokens, greedy, prompt {d['prompt']!r} included)"
    lines += [title, ""]
    kp = d["kernels_vs_pure"]
    if kp is None:
        lines += ["Kernels on vs off: not compared (no kernels on this machine).", ""]
    else:
        verdict = "identical" if kp["identical"] else f"differ from token {kp['first_difference']}"
        lines += [
            f"Kernels on vs off: tokens {verdict}; {_num(kp['kernels_tps'])} tok/s with kernels, "
            f"{_num(kp['pure_tps'])} tok/s pure MLX.",
            "",
        ]
    lines += [
        "| run | tok/s |",
        "|---|---|",
        f"| draft (W4) | {_num(d['draft_tps'])} |",
        f"| target (W8) | {_num(d['target_tps'])} |",
        f"| speculative | {_num(d['speculative_tps'])} "
        f"(acceptance {100 * d['acceptance']:.0f} %) |",
        "",
        *verify_markdown(r["verify_cost"]),
        *launch_markdown(r["step_costs"]),
        *dsv4_markdown(r["dsv4_projection"]),
        f"took {r['seconds']:.1f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = collect(args)
    print(json.dumps(report, indent=2) if args.json else markdown(report))
    healthy = all(c["self_test"] == "passed" for c in report["kernels"]["checks"])
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
