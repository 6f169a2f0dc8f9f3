"""DeepSeek-V4's kernels (hyper-connections, MoE routing) as tests/test_kernels.py cases: each
maker returns (kernel call taking a runner and an optional source mutation, pure reference)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from bitnest_mlx import kernels
from bitnest_mlx.layers import dsv4_hc, dsv4_route


def _mutated(runner, mutate):
    return runner if mutate is None else (lambda launch: runner(launch, mutate))


def _flat(arrays) -> mx.array:
    return mx.concatenate([a.astype(mx.float32).reshape(-1) for a in arrays])


def hc_pre_case(tokens, d, dtype, iters, seed):
    """Normed x, post and comb of one site: hc 4, `iters` Sinkhorn iterations."""
    shape = dsv4_hc.HCShape(4, iters, 1e-6, 1e-6)
    streams, fn, scale, base = dsv4_hc.site(mx.random.key(seed), d, shape, dtype, tokens)
    norm = nn.RMSNorm(d, eps=1e-5)
    norm.weight = mx.random.uniform(0.5, 1.5, (d,), key=mx.random.key(seed + 100)).astype(dtype)
    mix = streams.reshape(1, tokens, -1).astype(mx.float32) @ fn.T
    s = shape

    def call(runner, mutate=None):
        return _flat(
            kernels.hc_pre(
                streams, mix, scale, base, norm.weight, s.iters, s.hc_eps, s.norm_eps, norm.eps,
                _mutated(runner, mutate),
            )
        )  # fmt: skip

    x, post, comb = dsv4_hc.pure_before(streams, fn, scale, base, s)
    return call, _flat((norm(x), post, comb))


def hc_post_case(tokens, d, dtype, seed):
    shape = dsv4_hc.HCShape(4, 20, 1e-6, 1e-6)
    streams, fn, scale, base = dsv4_hc.site(mx.random.key(seed), d, shape, dtype, tokens)
    _, post, comb = dsv4_hc.pure_before(streams, fn, scale, base, shape)
    y = (mx.random.normal((1, tokens, d), key=mx.random.key(seed + 100)) * 3).astype(dtype)

    def call(runner, mutate=None):
        return kernels.hc_post(y, streams, post, comb, _mutated(runner, mutate))

    return call, dsv4_hc.pure_after(y, streams, post, comb)


def moe_route_case(tokens, experts, k, hashed, seed):
    """Routings compared as dense weight rows (the paths list a token's experts in their own
    order). Strong biases, so a routing that ignored them would pick other experts."""
    keys = mx.random.split(mx.random.key(seed), 4)
    logits = mx.random.normal((1, tokens, experts), key=keys[0]) * 3
    if hashed:
        table = mx.random.randint(0, experts, (64, k), key=keys[1]).astype(mx.int32)
        ids = mx.random.randint(0, 64, (1, tokens), key=keys[2]).astype(mx.uint32)
        kw = {"table": table, "ids": ids}
    else:
        kw = {"bias": mx.random.normal((experts,), key=keys[3]) * 2}

    def call(runner, mutate=None):
        idx, w = kernels.moe_route(logits, k, 2.5, runner=_mutated(runner, mutate), **kw)
        return dsv4_route.dense(idx, w, experts)

    return call, dsv4_route.dense(*dsv4_route.pure_route(logits, k, 2.5, **kw), experts)


# tokens, D, streams dtype, Sinkhorn iterations: D past / below the 256 threads of a token.
HC_PRE = {
    "2tok_d192_f32": (2, 192, mx.float32, 20),
    "1tok_d4096_fp16": (1, 4096, mx.float16, 20),
    "3tok_d320_fp16_1_iter": (3, 320, mx.float16, 1),
}
# tokens, D, streams dtype: D a multiple of the 256 threads or ragged.
HC_POST = {
    "2tok_d192_f32": (2, 192, mx.float32),
    "1tok_d4096_fp16": (1, 4096, mx.float16),
    "3tok_d300_f32": (3, 300, mx.float32),
}
# tokens, experts, k, hash routing: experts past the 32 lanes (ragged), DeepSeek-V4-Flash's.
MOE_ROUTE = {
    "learned_6_of_256": (2, 256, 6, False),
    "learned_4_of_40": (3, 40, 4, False),
    "hash_6_of_256": (3, 256, 6, True),
}
# (maker, table, rel) as tests/test_kernels.py's CASES, and the rel of a float16 output's rounding.
DSV4_CASES = {
    "hc_pre": (hc_pre_case, HC_PRE, 2e-5),
    "hc_post": (hc_post_case, HC_POST, 2e-5),
    "moe_route": (moe_route_case, MOE_ROUTE, 2e-5),
}
LOW_PRECISION_REL = {mx.float16: 2e-3}
# One planted bug per kernel, as test_kernels.MUTATIONS.
DSV4_MUTATIONS = {
    # The comb logits scaled by the post gate's scale.
    "hc_pre": (
        "2tok_d192_f32",
        "scale[i < HC ? 0 : (i < 2 * HC ? 1 : 2)]",
        "scale[i < HC ? 0 : 1]",
    ),
    # comb instead of its transpose.
    "hc_post": ("3tok_d300_f32", "comb[(tok * HC + j) * HC + k]", "comb[(tok * HC + k) * HC + j]"),
    # The bias forgotten: the top k of the scores alone.
    "moe_route": ("learned_4_of_40", "s + bias[e]", "s"),
}
DSV4_SELF_TESTS = {
    "hc_pre": dsv4_hc.before_self_test,
    "hc_post": dsv4_hc.after_self_test,
    "moe_route": dsv4_route.route_self_test,
}
