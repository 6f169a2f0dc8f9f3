"""DeepSeek-V4's hyper-connections around each sublayer, one launch each side.

`hc_pre`: the gates and the Sinkhorn normalisation of one token's HC x HC stream mixing and the
sublayer's input, from the streams and their (unscaled) mix; `hc_post`: the streams after the
sublayer. The pure-MLX twins, and the check of one against the other, are
bitnest_mlx/layers/dsv4_hc.py.
"""

from __future__ import annotations

import mlx.core as mx

from .launch import KernelSpec, Launch, Runner, run

HC_PRE = KernelSpec(
    "bitnest_hc_pre",
    "hc_pre.metal",
    ("streams", "mix", "scale", "base", "weight", "d", "iters", "hc_eps", "mix_eps", "norm_eps"),
    ("x", "post", "comb"),
)
HC_POST = KernelSpec(
    "bitnest_hc_post", "hc_post.metal", ("y", "streams", "post", "comb", "d"), ("out",)
)

HC_PRE_THREADS = 256  # one threadgroup a token: 8 simdgroups share its RMS sum and its x
HC_POST_THREADS = 256
HC_MAX = 8  # the Sinkhorn matrix lives in one thread's registers: HC x HC floats


def hc_supported(streams: mx.array) -> bool:
    """Streams [..., HC, D] the kernels take: a float dtype and a register-sized HC."""
    return (
        streams.ndim >= 2
        and 1 <= streams.shape[-2] <= HC_MAX
        and streams.dtype
        in (
            mx.float16,
            mx.bfloat16,
            mx.float32,
        )
    )


def hc_pre(
    streams: mx.array,
    mix: mx.array,
    scale: mx.array,
    base: mx.array,
    weight: mx.array,
    iters: int,
    hc_eps: float,
    mix_eps: float,
    norm_eps: float,
    runner: Runner | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """streams [..., HC, D], mix [..., (2 + HC) HC] float32 (the flattened float32 streams times
    fnᵀ, before the RMS scale, which the kernel applies), scale [3], base [(2 + HC) HC], the
    sublayer's RMSNorm weight [D] -> (its normed input x [..., D] in the streams' dtype, post
    [..., HC], comb [..., HC, HC] float32). `mix_eps` and `norm_eps`
    are the two RMS norms' epsilons (the streams', the sublayer input's)."""
    hc, d = streams.shape[-2:]
    lead = streams.shape[:-2]
    n = mix.size // mix.shape[-1]
    launch = Launch(
        HC_PRE,
        [
            streams.reshape(n, hc * d),
            mix.reshape(n, -1).astype(mx.float32),
            scale.astype(mx.float32),
            base.astype(mx.float32),
            weight,
            d,
            iters,
            float(hc_eps),
            float(mix_eps),
            float(norm_eps),
        ],
        [("T", streams.dtype), ("HC", hc)],
        grid=(HC_PRE_THREADS, n, 1),
        threadgroup=(HC_PRE_THREADS, 1, 1),
        output_shapes=[(n, d), (n, hc), (n, hc * hc)],
        output_dtypes=[streams.dtype, mx.float32, mx.float32],
    )
    x, post, comb = run(launch, runner)
    return x.reshape(*lead, d), post.reshape(*lead, hc), comb.reshape(*lead, hc, hc)


def hc_post(
    y: mx.array,
    streams: mx.array,
    post: mx.array,
    comb: mx.array,
    runner: Runner | None = None,
) -> mx.array:
    """out[..., k, :] = post_k · y + Σ_j comb[j, k] · streams[..., j, :], in the streams' dtype:
    y [..., D], streams [..., HC, D], post [..., HC], comb [..., HC, HC] (float32)."""
    hc, d = streams.shape[-2:]
    n = y.size // d
    launch = Launch(
        HC_POST,
        [
            y.reshape(n, d),
            streams.reshape(n, hc * d),
            post.reshape(n, hc).astype(mx.float32),
            comb.reshape(n, hc * hc).astype(mx.float32),
            d,
        ],
        [("T", streams.dtype), ("HC", hc)],
        grid=(-(-d // HC_POST_THREADS) * HC_POST_THREADS, n, 1),
        threadgroup=(HC_POST_THREADS, 1, 1),
        output_shapes=[(n, hc * d)],
        output_dtypes=[streams.dtype],
    )
    (out,) = run(launch, runner)
    return out.reshape(streams.shape)
