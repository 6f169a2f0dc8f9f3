"""DeepSeek-V4's hyper-connections (mHC): the HC streams' mixing around every sublayer.

Before a sublayer (`before`): an RMS-normed mix of the flattened streams gives the input gates
`pre`, the output gates `post` and an HC x HC matrix made doubly stochastic by Sinkhorn
iterations (`comb`); the sublayer reads x = Σ_k pre_k · stream_k. After it (`after`): stream k
becomes post_k · y + Σ_j comb[j, k] · stream_j.

Two paths, chosen per call by RunOptions.use_kernels:
* kernel: one Metal launch each side, `hc_pre` and `hc_post` (DeepSeek's names;
  bitnest_mlx/kernels/hyper_connection.py), after the mix
  matmul, once its self-test against the pure path below passed (`kernels.use`).
* pure: the reference math, in as few MLX kernels as rewriting it bit for bit allows. MLX fuses
  compiled elementwise chains but splits them at reductions, at slices of an intermediate and
  past ~11 ops of depth; so sums over the HC axis are written as adds of slices of a function's
  inputs, in the order MLX's reductions add (`unrolled_sum`), and one Sinkhorn iteration
  (row and column normalisation) is one compiled kernel: 21 kernels, not 80.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, partial

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from .dsv4_ops import unrolled_sum


def _rows(c: mx.array) -> list[mx.array]:
    return [c[..., i : i + 1, :] for i in range(c.shape[-2])]


def _cols(c: mx.array) -> list[mx.array]:
    return [c[..., :, j : j + 1] for j in range(c.shape[-1])]


# Not shapeless: a slice's shape cannot be inferred there. Compiled again per (B, L).
@mx.compile
def _sinkhorn_first(p: mx.array, eps: float) -> mx.array:
    """c = p + eps, then c / (column sums + eps), from the softmax p."""
    return (p + eps) / (unrolled_sum([r + eps for r in _rows(p)]) + eps)


@mx.compile
def _sinkhorn_iteration(c: mx.array, eps: float) -> mx.array:
    """One row then one column normalisation, c / (sum + eps) each, as one kernel.

    The column sums of the row-normalised matrix are built from slices of c itself (an
    intermediate's slice would end the fused kernel), and every slice is broadcast to c's
    shape before any arithmetic: a broadcast inside the chain would count towards the fusion
    depth."""
    n, full = c.shape[-1], c.shape

    def wide(a: mx.array) -> mx.array:
        return mx.broadcast_to(a, full)

    row_sums = unrolled_sum([wide(col) for col in _cols(c)]) + eps
    scaled_rows = [
        wide(row) / (unrolled_sum([wide(row[..., j : j + 1]) for j in range(n)]) + eps)
        for row in _rows(c)
    ]
    return (c / row_sums) / (unrolled_sum(scaled_rows) + eps)


def sinkhorn(logits: mx.array, iters: int, eps: float) -> mx.array:
    """Row softmax + eps, one column normalization, then (iters - 1) × (row, column); every
    normalisation divides by (sum + eps). logits [..., HC, HC] float32."""
    c = _sinkhorn_first(mx.softmax(logits, axis=-1, precise=True), eps)
    for _ in range(iters - 1):
        c = _sinkhorn_iteration(c, eps)
    return c


@cache
def _parts(hc: int) -> mx.array:
    """Which gate each of the (2 + HC) HC mix outputs feeds: 0 pre, 1 post, 2 comb (a
    constant, evaluated once: made inside the compiled function it would be a kernel a call)."""
    part = mx.minimum(mx.arange((2 + hc) * hc) // hc, 2)
    mx.eval(part)
    return part


@mx.compile
def _gates(m: mx.array, scale: mx.array, base: mx.array, part: mx.array, eps: float) -> mx.array:
    """[..., (2 + HC) HC]: sigmoid(a) + eps (pre), 2 · sigmoid(a) (post), a (comb logits) with
    a = m · scale[part] + base, one kernel: each part's formula at every position, the right
    one kept (each kept value computed as the three-way split computes it)."""
    pre = mx.sigmoid(m * scale[0:1] + base) + eps
    post = 2 * mx.sigmoid(m * scale[1:2] + base)
    return mx.where(part == 0, pre, mx.where(part == 1, post, m * scale[2:3] + base))


@mx.compile
def collapse(pre: mx.array, streams: mx.array) -> mx.array:
    """Σ_k pre_k · stream_k in float32, rounded to the streams' dtype: pre [..., HC], streams
    [..., HC, D] -> [..., D]."""
    terms = [pre[..., k : k + 1] * streams[..., k, :] for k in range(streams.shape[-2])]
    return unrolled_sum(terms).astype(streams.dtype)


@partial(mx.compile, shapeless=True)
def _expand(y: mx.array, post: mx.array, mixed: mx.array, streams: mx.array) -> mx.array:
    # `streams` only names the dtype (compiled functions take arrays and numbers)
    return (post[..., None] * y[..., None, :].astype(mx.float32) + mixed).astype(streams.dtype)


@partial(mx.compile, shapeless=True)
def _head_gates(m: mx.array, scale: mx.array, base: mx.array, eps: float) -> mx.array:
    return mx.sigmoid(m * scale + base) + eps


def head(
    streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, hc_eps: float, eps: float
) -> mx.array:
    """The final collapse of the streams [..., HC, D] to one [..., D]: sigmoid gates only, no
    Sinkhorn (two kernels after the mix)."""
    return collapse(_head_gates(mix(streams, fn, eps), scale, base, hc_eps), streams)


def _flat32(streams: mx.array) -> mx.array:
    return streams.reshape(*streams.shape[:-2], -1).astype(mx.float32)


def mix(streams: mx.array, fn: mx.array, eps: float) -> mx.array:
    """Unweighted RMS norm over all streams, then the learned projection (float32):
    streams [..., HC, D], fn [M, HC · D] -> [..., M]."""
    return mx.fast.rms_norm(_flat32(streams), None, eps) @ fn.T


@dataclass(frozen=True)
class HCShape:
    """The config's hyper-connection constants."""

    hc: int  # hc_mult: streams per token
    iters: int  # hc_sinkhorn_iters
    hc_eps: float
    norm_eps: float  # rms_norm_eps


def before(
    streams: mx.array,
    fn: mx.array,
    scale: mx.array,
    base: mx.array,
    shape: HCShape,
    norm: nn.RMSNorm,
    use_kernels: bool = True,
) -> tuple[mx.array, mx.array, mx.array]:
    """(the sublayer's input norm(x) [..., D] in the streams' dtype, post [..., HC], comb
    [..., HC, HC] float32) for streams [..., HC, D] and one site's fn [(2 + HC) HC, HC · D],
    scale [3], base; `norm` is the sublayer's RMSNorm (in the same launch on the kernel path)."""
    if use_kernels and kernels.hc_supported(streams) and kernels.use("hc_pre", before_self_test):
        kernels.record("hc_pre", "kernel")
        return _kernel_before(streams, fn, scale, base, shape, norm.weight, norm.eps)
    kernels.record("hc_pre", "pure")
    x, post, comb = pure_before(streams, fn, scale, base, shape)
    return norm(x), post, comb


def _kernel_before(
    streams: mx.array,
    fn: mx.array,
    scale: mx.array,
    base: mx.array,
    s: HCShape,
    weight: mx.array,
    eps: float,
    runner: kernels.Runner | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    # The mix before its RMS scale (one scalar a token): the launch applies it.
    unscaled = _flat32(streams) @ fn.T
    return kernels.hc_pre(
        streams, unscaled, scale, base, weight, s.iters, s.hc_eps, s.norm_eps, eps, runner
    )


def pure_before(
    streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, s: HCShape
) -> tuple[mx.array, mx.array, mx.array]:
    """The pure path's (x before the sublayer's norm, post, comb)."""
    hc = s.hc
    gates = _gates(mix(streams, fn, s.norm_eps), scale, base, _parts(hc), s.hc_eps)
    comb = gates[..., 2 * hc :].reshape(*gates.shape[:-1], hc, hc)
    x = collapse(gates[..., :hc], streams)
    return x, gates[..., hc : 2 * hc], sinkhorn(comb, s.iters, s.hc_eps)


def after(
    y: mx.array,
    streams: mx.array,
    post: mx.array,
    comb: mx.array,
    use_kernels: bool = True,
) -> mx.array:
    """The streams after a sublayer: stream k = post_k · y + Σ_j comb[j, k] · stream_j, in
    the streams' dtype. y [..., D], streams [..., HC, D]."""
    if use_kernels and kernels.hc_supported(streams) and kernels.use("hc_post", after_self_test):
        kernels.record("hc_post", "kernel")
        return kernels.hc_post(y, streams, post, comb)
    kernels.record("hc_post", "pure")
    return pure_after(y, streams, post, comb)


def pure_after(y: mx.array, streams: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    # combᵀ, not comb: output stream k sums comb[j, k] over the input streams j.
    mixed = comb.swapaxes(-1, -2) @ streams.astype(mx.float32)
    return _expand(y, post, mixed, streams)


# The self-tests below are each kernel's one check: `kernels.use` runs them at first use and
# the test suite runs them in the CPU emulator. Two tokens of a tiny config (HC 4, D 192: a
# ragged last pass of the 256 threads); float32 streams, so that the check's 1e-3 sees the
# kernel's arithmetic, not a float16 output's last bit (tests/test_kernels.py covers those).
_TEST = HCShape(hc=4, iters=20, hc_eps=1e-6, norm_eps=1e-6)


def site(
    key: mx.array, d: int, s: HCShape, dtype: mx.Dtype = mx.float32, tokens: int = 2
) -> tuple[mx.array, ...]:
    """Random (streams [1, tokens, HC, d], fn, scale, base) of one hyper-connection site."""
    k1, k2, k3, k4 = mx.random.split(key, 4)
    mix_rows = (2 + s.hc) * s.hc
    streams = (mx.random.normal((1, tokens, s.hc, d), key=k1) * 2).astype(dtype)
    fn = mx.random.normal((mix_rows, s.hc * d), key=k2) * 0.05
    scale = mx.random.uniform(0.5, 2.0, (3,), key=k3)
    base = mx.random.normal((mix_rows,), key=k4)
    return streams, fn, scale, base


def before_self_test(
    runner: kernels.Runner | None = None, big: bool = False
) -> tuple[mx.array, mx.array]:
    """(kernel, pure) normed x, post and comb of one hyper-connection site; `big`: 64 tokens
    at DeepSeek-V4-Flash's D = 4096 (the doctor's timed shape: megabytes of streams)."""
    s, d, tokens = _TEST, (4096 if big else 192), (64 if big else 2)
    streams, fn, scale, base = site(mx.random.key(11), d, s, tokens=tokens)
    norm = nn.RMSNorm(d, eps=1e-5)
    norm.weight = mx.random.uniform(0.5, 1.5, (d,), key=mx.random.key(14))
    got = _kernel_before(streams, fn, scale, base, s, norm.weight, norm.eps, runner)
    x, post, comb = pure_before(streams, fn, scale, base, s)
    return _flat(got), _flat((norm(x), post, comb))


def after_self_test(
    runner: kernels.Runner | None = None, big: bool = False
) -> tuple[mx.array, mx.array]:
    """(kernel, pure) streams after a sublayer, from the pure path's post and comb; `big`: 64
    tokens at D = 4096."""
    d, tokens = (4096, 64) if big else (192, 2)
    streams, fn, scale, base = site(mx.random.key(12), d, _TEST, tokens=tokens)
    _, p, comb = pure_before(streams, fn, scale, base, _TEST)
    y = mx.random.normal((1, tokens, d), key=mx.random.key(13))
    got = kernels.hc_post(y, streams, p, comb, runner)
    return _flat([got]), _flat([pure_after(y, streams, p, comb)])


def _flat(arrays) -> mx.array:
    return mx.concatenate([a.astype(mx.float32).reshape(-1) for a in arrays])


__all__ = ["HCShape", "after", "before", "collapse", "head", "mix", "sinkhorn"]
