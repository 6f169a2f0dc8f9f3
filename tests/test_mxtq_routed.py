"""The routed-expert MLP of an MXTQ MoE layer (`mxtq_linear.routed_glu`): gate, up, clamped
SwiGLU, route weight and down as one unit, on (emulated) Metal and in pure MLX, resident or
through an expert store."""

from __future__ import annotations

import types

import mlx.core as mx
import numpy as np
import pytest
import tools
from metal_emu import emulator

from bitnest_mlx import kernels
from bitnest_mlx.layers import mxtq_linear
from bitnest_mlx.layers.dsv4_ops import swiglu_clamped
from bitnest_mlx.layers.mxtq_linear import MXTQSwitchLinear, routed_glu

D, H, N_EXP, K = 256, 128, 6, 3  # hidden, intermediate (powers of two: both rotate on Metal)


def _stack(n_in, n_out, bits, seed):
    k1, k2 = mx.random.split(mx.random.key(seed))
    sw = MXTQSwitchLinear(n_in, n_out, N_EXP, bits=bits)
    sw.tq_packed = mx.random.randint(0, 2**31, sw.tq_packed.shape, key=k1).astype(mx.uint32)
    sw.tq_norms = mx.random.uniform(0.5, 2.0, sw.tq_norms.shape, key=k2).astype(mx.float16)
    return sw


def _moe(bits=(2, 2, 4)):
    """gate, up, down at a bit plan like DeepSeek-V4's (2-bit gate/up, 4-bit down)."""
    return _stack(D, H, bits[0], 1), _stack(D, H, bits[1], 2), _stack(H, D, bits[2], 3)


def _inputs(tokens=2, seed=4):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((tokens, 1, 1, 1, D)).astype(np.float32) * 4)
    idx = mx.array(rng.integers(0, N_EXP, (tokens, 1, K)).astype(np.uint32))
    w = mx.array(rng.uniform(0.1, 1.0, (tokens, 1, K)).astype(np.float32))
    return x, idx, w


def test_routed_glu_pure_path_is_the_unfused_composition():
    gate, up, down = _moe()
    x, idx, w = _inputs()
    got = routed_glu(gate, up, down, x, idx, w, 1.0, use_kernels=False)
    h = swiglu_clamped(gate(x, idx), up(x, idx), 1.0) * w[..., None, None]
    np.testing.assert_allclose(np.array(got), np.array(down(h, idx)), rtol=1e-6, atol=1e-6)


class _ArrayStore:
    """An expert store over in-memory stacks (the real one reads files; this counts calls)."""

    def __init__(self):
        self.stacks, self.fetches = {}, 0

    def fetch(self, source, experts):
        self.fetches += 1
        return self.stacks[source][mx.array(np.array(experts, np.uint32))]


def _host_conversions(monkeypatch) -> list:
    """Counts np.array(<mx.array>) in mxtq_linear: a host sync each."""
    seen = []

    def array(a, *args, **kwargs):
        if isinstance(a, mx.array):
            seen.append(a.shape)
        return np.array(a, *args, **kwargs)

    monkeypatch.setattr(mxtq_linear, "np", types.SimpleNamespace(**{**np.__dict__, "array": array}))
    return seen


def test_an_expert_store_costs_one_host_sync_per_moe_layer_and_changes_nothing(monkeypatch):
    gate, up, down = _moe()
    x, idx, w = _inputs()
    resident = routed_glu(gate, up, down, x, idx, w, 1.0)
    store = _ArrayStore()
    for name, sw in (("gate", gate), ("up", up), ("down", down)):
        store.stacks[name] = sw.tq_packed
        sw.use_store(store, name)
    syncs = _host_conversions(monkeypatch)
    stored = routed_glu(gate, up, down, x, idx, w, 1.0)
    mx.eval(stored)
    assert len(syncs) == 1 and store.fetches == 3  # one routing read, one fetch per stack
    np.testing.assert_array_equal(np.array(stored), np.array(resident))


def test_resident_routed_glu_needs_no_host_sync_so_it_compiles():
    gate, up, down = _moe()
    x, idx, w = _inputs()

    def step(x, idx, w):
        return routed_glu(gate, up, down, x, idx, w, 1.0)

    np.testing.assert_allclose(
        np.array(mx.compile(step)(x, idx, w)), np.array(step(x, idx, w)), rtol=1e-6, atol=1e-7
    )


@tools.needs(emulator.cxx(), why="the emulator compiles kernels with it")
@pytest.mark.parametrize("bits", [(2, 2, 4), (4, 4, 2)], ids=["2-2-4", "4-4-2"])
def test_routed_glu_on_emulated_metal_is_four_dispatches_and_the_pure_result(bits, monkeypatch):
    """Rotate x once, fused gate/up/SwiGLU/route weight, rotate h, gather down."""
    gate, up, down = _moe(bits)
    x, idx, w = _inputs(tokens=3)
    want = routed_glu(gate, up, down, x, idx, w, 0.75, use_kernels=False)
    launched = []

    def count(launch, verbose=False):
        launched.append(launch.spec.name)
        return emulator.run(launch)

    monkeypatch.setattr(kernels.dispatch, "_metal", lambda: True)
    monkeypatch.setattr(kernels, "use", lambda name, self_test: True)
    monkeypatch.setattr(kernels.launch, "metal_runner", count)
    got = routed_glu(gate, up, down, x, idx, w, 0.75)
    mx.eval(got)
    specs = (kernels.HADAMARD, kernels.MXTQ_SWIGLU, kernels.HADAMARD, kernels.MXTQ_GATHER)
    assert launched == [s.name for s in specs]
    scale = float(mx.abs(want).max())
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-5 * scale)
