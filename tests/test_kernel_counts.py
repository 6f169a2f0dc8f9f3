"""The emulator's operation counts (bitnest_mlx/kernels/emulator/counting.py) and what they say
about the dual-plane kernel; `bench --kernels` turns them into estimated cycles."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import pytest
import tools
from metal_emu.emulator import InlineSpec

from bitnest_mlx import kernels
from bitnest_mlx.cli import bench
from bitnest_mlx.kernels.dual_plane import A8_IN_KERNEL_MAX_ROWS
from bitnest_mlx.kernels.emulator import counting, emulate, profile
from bitnest_mlx.measurement import kernel_costs
from bitnest_mlx.runtime import chips
from bitnest_mlx.runtime.speed_model import KV8_CYCLES

needs_compilers = tools.needs(
    emulate.cxx(), counting.clang(), why="operation counts build with both"
)


def count_inline(body: str, threads: int) -> counting.Counts:
    digest = hashlib.sha256(body.encode()).hexdigest()[:12]
    spec = InlineSpec(f"count_probe_{digest}", "", ("in0", "in1"), ("out",), body=body)
    a = mx.arange(1, threads + 1, dtype=mx.float32)
    launch = kernels.Launch(
        spec, [a, a * 2], [], (threads, 1, 1), (32, 1, 1), [(threads,)], [mx.float32]
    )
    counts, outputs = counting.count(launch)
    mx.eval(outputs)
    return counts


@needs_compilers
def test_counts_of_a_tiny_launch_match_a_hand_count():
    # Per thread: two float loads, a·b + a/b contracted into one FMA over one division, one
    # simd_sum and the add after it, one float store.
    body = """
    const uint i = thread_position_in_grid.x;
    const float a = in0[i];
    const float b = in1[i];
    out[i] = a * b + a / b + metal::simd_sum(a);
    """
    ops = count_inline(body, 64).ops
    hand = {"fma": 64, "div": 64, "fadd": 64, "simd": 64}
    assert {c: ops[c] for c in hand} == hand
    assert ops["device_read_bytes"] == 64 * 2 * 4 and ops["device_write_bytes"] == 64 * 4
    assert ops["convert"] == ops["round"] == ops["int_mul"] == 0


@needs_compilers
def test_counts_follow_control_flow_not_the_source_text():
    # One division in the text, executed only by the 16 threads below 16 of 64.
    body = """
    const uint i = thread_position_in_grid.x;
    float v = in0[i];
    if (i < 16u)
      v = v / in1[i];
    out[i] = v;
    """
    assert count_inline(body, 64).ops["div"] == 16


def small_dual_plane_cases() -> list[profile.Case]:
    return profile.dual_plane_cases(n=16, k=1536)


@needs_compilers
def test_a_planted_division_shows_in_the_dual_plane_counts():
    case = small_dual_plane_cases()[0]
    clean = profile.measure(case)["per_unit"]["div"]
    planted = profile.measure(
        case, mutate=lambda s: s.replace("bn_round_even(xv[i] * inv)", "bn_round_even(xv[i] / a)")
    )["per_unit"]["div"]
    # A8 divides once per token's scale, not once per x value.
    assert clean < 0.02
    # One division per x value loaded: each is reused by the simdgroup's 4 rows.
    assert planted - clean == pytest.approx(1 / 4, rel=0.05)


@needs_compilers
@pytest.mark.parametrize("index", range(4), ids=["draft-M1", "target-M1", "draft-M4", "target-M4"])
def test_dual_plane_per_weight_token_has_no_division_rounding_or_conversion(index):
    """Per weight and token: one FMA against the decoded code, the decode's one subtract shared
    by the M tokens, and the weight scale once per lane's 16 columns. A8 inside the launch (up
    to A8_IN_KERNEL_MAX_ROWS tokens) adds 4 float operations per x value (times its reciprocal
    scale, the two adds that round it, its column's power of two), shared by the simdgroup's 4
    rows; wider passes read a8_quantize's codes (the power of two only), whose one division and
    rounding per x value are shared by all N = 16 rows. Nothing else on the slow pipe."""
    case = small_dual_plane_cases()[index]
    r = profile.measure(case)
    p = r["per_unit"]
    m = 1 if "M=1" in case.name else 4
    in_launch = m <= A8_IN_KERNEL_MAX_ROWS
    assert r["launches"] == (1 if in_launch else 2)
    assert p["convert"] == 0
    assert p["round"] == (0 if in_launch else pytest.approx(1 / 16))
    assert p["div"] < (0.02 if in_launch else 1 / 16 + 0.01)  # + a scale per token or group
    float_ops = p["fma"] + p["fadd"] + p["fmul"]
    epilogue = 0.05  # the scales after each row's simd_sum, over K = 1536
    a8 = 4 / 4 if in_launch else 1 / 4
    assert float_ops <= 1 + 1 / m + 1 / 16 + a8 + epilogue
    assert float_ops <= 2 + 1 / 16 + a8 + epilogue
    assert p["int_mul"] < 0.1  # row offsets once per lane's 16 columns, never per weight


@needs_compilers
@pytest.mark.parametrize("name", ["gate/up draft M=1", "gate/up target M=4"])
def test_gate_up_epilogue_adds_one_exp_and_one_division_per_output_and_token(name):
    """[gate; up] in one launch: the per-weight work of a plain projection, plus silu(g)·u once
    per output and token (an exp and a division per gate row, i.e. 1 / 2K per weight·token)."""
    case = next(c for c in small_dual_plane_cases() if c.name == name)
    r = profile.measure(case)
    p = r["per_unit"]
    m, k = (1 if "M=1" in name else 4), 1536
    plain = profile.measure(small_dual_plane_cases()[0 if m == 1 else 3])
    assert r["launches"] == plain["launches"]
    assert p["convert"] == 0
    assert p["transcendental"] == pytest.approx(1 / (2 * k))
    # The A8 work per x value is shared by twice the rows (gate and up) of the plain case.
    a8_div, a8_round = plain["per_unit"]["div"], plain["per_unit"]["round"]
    assert p["div"] == pytest.approx(1 / (2 * k) + a8_div / (1 if m == 1 else 2), abs=2e-3)
    assert p["round"] == pytest.approx(a8_round / 2)
    float_ops = p["fma"] + p["fadd"] + p["fmul"]
    assert float_ops <= 1 + 1 / m + 1 / 16 + 4 / 4 + 0.05


def test_chip_budget_is_alus_times_clock_per_streamed_byte():
    m1 = chips.gpu("M1")
    # 1024 lanes at 1.278 GHz against 68.25 GB/s: cycles per byte, times bytes per unit.
    assert m1.budget(0.5) == pytest.approx(1024 * 1.278 * 0.5 / 68.25)


def test_bench_kernels_says_which_compiler_is_missing(monkeypatch, capsys):
    monkeypatch.setenv("BITNEST_EMU_CLANG", "no-such-clang++")
    assert bench.main(["--kernels"]) == 2
    assert "no-such-clang++ not found" in capsys.readouterr().out


@needs_compilers
def test_nested_kv_verification_reads_each_element_once_without_conversions():
    """GQA 3 at L = 4 (12 rows, one chunk): per K/V element·token about 3 FMAs (one per row of
    the token's 3 heads, for QK or PV), no int->float conversion (codes decoded through the
    mantissa of 2^23), and the KV8 read within 0.6 of M4 Max's bandwidth roofline (issue 40)."""
    case = next(c for c in profile.nested_kv_cases(ls=(4,)) if c.name == "KV8 L=4")
    r = profile.measure(case)
    p = r["per_unit"]
    assert p["convert"] == p["round"] == 0
    assert 3 <= p["fma"] <= 3.2
    assert kernel_costs.estimate(r)["chips"]["M4 Max"]["roofline"] >= 0.6


@needs_compilers
def test_speed_model_kv8_cycles_are_the_kernels_counts():
    """speed_model.KV8_CYCLES is the nested-KV kernel's KV8 read at each L, counted as
    `bench --kernels` counts its nested-KV cases: a kernel change must update the table."""
    cases = profile.nested_kv_cases(ls=tuple(KV8_CYCLES))
    got = {int(c.name[6:]): profile.measure(c)["cycles"] for c in cases if c.name[:3] == "KV8"}
    assert got == pytest.approx(KV8_CYCLES, abs=1e-3)
