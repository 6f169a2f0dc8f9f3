"""Operation-count profile of every kernel at representative decode shapes, and the estimated
ALU cycles per unit of work it implies (docs/kernels.md, `bench --kernels`).

Each case calls a kernel's public launch function with a counting runner, so everything that
call launches is counted, and divides the executed operations by its units of work: weights ×
tokens for the matmuls, cached K/V elements × tokens for attention, elements for the rotation.
Cycles are lane-cycles: the counts of every lane times an assumed cost per class (`CYCLES`).
Nothing here is measured on a GPU: it is an estimate from counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .. import dual_plane, mxtq, nested_kv
from .counting import CLASSES, CountingRunner

# Assumed lane-cycles per operation on an Apple GPU (M1 generation): FP32 add/mul/FMA and
# 32-bit integer add/logic issue once per cycle; integer multiply, int<->float conversion,
# rounding and transcendentals go through the slower pipe (~4); an exact (IEEE) division is a
# reciprocal plus Newton steps (~30; MLX builds custom kernels without fast-math). A simd_*
# reduction or shuffle is counted as one call per lane at ~10 (5 shuffle steps). Memory
# operations are not ALU cycles and are reported in bytes only.
CYCLES = {
    "fma": 1,
    "fadd": 1,
    "fmul": 1,
    "int_mul": 4,
    "int_add": 1,
    "cmp_select": 1,
    "shift": 1,
    "mask": 1,
    "convert": 4,
    "fp_convert": 1,
    "round": 4,
    "div": 30,
    "transcendental": 4,
    "simd": 10,
    "barrier": 4,
}
ARITHMETIC = ("fma", "fadd", "fmul", "int_mul", "int_add")


@dataclass(frozen=True)
class Case:
    kernel: str
    name: str
    unit: str
    units: float
    stream_bytes: float  # bytes streamed from memory per unit (the roofline's share)
    call: Callable[[CountingRunner], object]


def _planes(n: int, k: int, group: int, seed: int):
    keys = mx.random.split(mx.random.key(seed), 3)
    hi = mx.random.randint(0, 2**31, (n, k // 8), key=keys[0]).astype(mx.uint32)
    lo = mx.random.randint(0, 2**31, (n, k // 8), key=keys[1]).astype(mx.uint32)
    scales = mx.random.uniform(0.002, 0.02, (n, k // group), key=keys[2]).astype(mx.float16)
    return hi, lo, scales


def dual_plane_cases(n: int = 64, k: int = 3072, group: int = 128) -> list[Case]:
    """A Llama-3.2-3B-wide projection (K = 3072), A8 per token, draft and target, M = 1 and 4;
    then gate/up stacked (2n rows) with the SiLU·up epilogue, draft M = 1 and target M = 4."""
    hi, lo, scales = _planes(n, k, group, 0)
    out = []
    for m in (1, 4):
        x = mx.random.normal((m, k), key=mx.random.key(m)).astype(mx.float16)
        for draft in (True, False):
            plane = 0.5 if draft else 1.0
            out.append(
                Case(
                    "dual_plane",
                    f"{'draft' if draft else 'target'} M={m}",
                    "weight·token",
                    n * k * m,
                    (plane + 2 / group) / m,
                    lambda r, x=x, draft=draft: dual_plane.dual_plane_matmul(
                        x, hi, lo, scales, draft=draft, a8_group=-1, runner=r
                    ),
                )
            )
    # The MLP's gate and up stacked ([gate; up], n rows each) in one launch, silu(gate)·up in
    # the epilogue: the decode and the verification shape of the model's grouped launch.
    gate_up = [mx.concatenate([a, a]) for a in (hi, lo, scales)]
    for m, draft in ((1, True), (4, False)):
        x = mx.random.normal((m, k), key=mx.random.key(m)).astype(mx.float16)
        plane = 0.5 if draft else 1.0
        out.append(
            Case(
                "dual_plane",
                f"gate/up {'draft' if draft else 'target'} M={m}",
                "weight·token",
                2 * n * k * m,
                (plane + 2 / group) / m,
                lambda r, x=x, draft=draft: dual_plane.dual_plane_matmul(
                    x, *gate_up, draft=draft, a8_group=-1, gate_up=True, runner=r
                ),
            )
        )
    return out


def nested_kv_cases(
    n_kv: int = 512, d: int = 128, group: int = 64, ls: tuple[int, ...] = (1, 4)
) -> list[Case]:
    """GQA 3 (Llama-3.2-3B's 24 / 8 heads), two kv heads, decode (L = 1) and L = 4 (`ls`: the
    query tokens; speed_model.KV8_CYCLES counts L = 1 .. 8 this way)."""
    hkv, hq = 2, 6
    keys = mx.random.split(mx.random.key(5), 5)
    words, groups = (1, hkv, n_kv, d // 8), (1, hkv, n_kv, d // group)
    kp = tuple(mx.random.randint(0, 2**31, words, key=keys[i]).astype(mx.uint32) for i in (0, 1))
    vp = tuple(mx.random.randint(0, 2**31, words, key=keys[i]).astype(mx.uint32) for i in (2, 3))
    ks = mx.random.uniform(0.05, 0.2, groups, key=keys[4])
    out = []
    for L in ls:
        q = mx.random.normal((1, hq, L, d), key=mx.random.key(L)).astype(mx.float16)
        for draft in (True, False):
            elements = 2 * hkv * n_kv * d
            plane = 0.5 if draft else 1.0
            out.append(
                Case(
                    "nested_kv",
                    f"{'KV4' if draft else 'KV8'} L={L}",
                    "KV element·token",
                    elements * L,
                    (plane + 4 / group) / L,
                    lambda r, q=q, draft=draft: nested_kv.nested_kv_attention(
                        q, (*kp, ks), (*vp, ks), draft=draft, scale=d**-0.5, group=group, runner=r
                    ),
                )
            )
    return out


def mxtq_cases(n_in: int = 2048, n_out: int = 64, slots: int = 6) -> list[Case]:
    """One token's routed experts (6 slots sharing x, as gate/up), 2 and 4 bits."""
    out = []
    for bits in (2, 4):
        keys = mx.random.split(mx.random.key(bits), 4)
        experts = 8
        packed = mx.random.randint(0, 2**31, (experts, n_out, n_in * bits // 32), key=keys[0])
        packed = packed.astype(mx.uint32)
        norms = mx.random.uniform(0.5, 2.0, (experts, n_out), key=keys[1]).astype(mx.float16)
        codebook = mx.random.normal((2**bits,), key=keys[2])
        x = mx.random.normal((1, 1, n_in), key=keys[3])
        idx = mx.arange(slots, dtype=mx.uint32).reshape(1, slots) % experts
        out.append(
            Case(
                "mxtq_gather",
                f"{bits}-bit {slots} slots",
                "weight·slot",
                n_out * n_in * slots,
                bits / 8 + 2 / n_in,
                lambda r, bits=bits, packed=packed, norms=norms, cb=codebook, x=x, i=idx: (
                    mxtq.mxtq_gather_matvec(x, i, packed, norms, cb, bits, r)
                ),
            )
        )
    return out


def hadamard_cases(d: int = 4096) -> list[Case]:
    x = mx.random.normal((1, d), key=mx.random.key(9)).astype(mx.float16)
    signs = mx.where(mx.random.uniform(shape=(d,), key=mx.random.key(10)) < 0.5, -1.0, 1.0)
    return [
        Case(
            "hadamard",
            f"d={d}",
            "element",
            d,
            2 + 4,  # fp16 in, float32 out
            lambda r: mxtq.hadamard_rotate(x, signs, r),
        )
    ]


def all_cases() -> list[Case]:
    return dual_plane_cases() + nested_kv_cases() + mxtq_cases() + hadamard_cases()


def cycles(per_unit: dict[str, float]) -> float:
    """Estimated ALU lane-cycles of one unit of work from its per-unit operation counts."""
    return sum(per_unit.get(c, 0.0) * cost for c, cost in CYCLES.items())


def measure(case: Case, mutate: Callable[[str], str] | None = None) -> dict:
    """Executed operations per unit of `case`, their estimated cycles, and the case's facts."""
    runner = CountingRunner(mutate)
    mx.eval(case.call(runner))
    per = runner.counts.per(case.units)
    return {
        "kernel": case.kernel,
        "case": case.name,
        "unit": case.unit,
        "launches": runner.counts.launches,
        "per_unit": {c: per[c] for c in CLASSES},
        "arithmetic": sum(per[c] for c in ARITHMETIC),
        "cycles": cycles(per),
        "stream_bytes": case.stream_bytes,
    }


def profile(cases: list[Case] | None = None) -> list[dict]:
    return [measure(c) for c in (all_cases() if cases is None else cases)]
