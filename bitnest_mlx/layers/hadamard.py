"""Online Hadamard rotations: R4 (hadK ⊗ H_{n/K}) on the down_proj input, R3 on q and k."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import kernels


class OnlineHadamard(nn.Module):
    """y = (hadK ⊗ H_{n/K}) x / sqrt(n); hadK is the package's `aux.had_K.<K>` (K > 1 only).

    MLX's built-in 12/20/28 Hadamard matrices differ from the ones packages ship, so for
    K > 1 only the power-of-two part uses `mx.hadamard_transform`.
    """

    def __init__(self, n: int, k: int = 1, fp32: bool = False):
        super().__init__()
        self.n, self.k, self.fp32 = n, k, fp32
        if k > 1:
            self.had_k = mx.zeros((k, k))

    def __call__(self, x: mx.array) -> mx.array:
        dtype = x.dtype
        if self.fp32:
            x = x.astype(mx.float32)
        scale = self.n**-0.5
        if self.k == 1:
            y = mx.hadamard_transform(x, scale=scale)
        else:
            xr = x.reshape(*x.shape[:-1], self.k, self.n // self.k)
            if self.n // self.k > 1:
                xr = mx.hadamard_transform(xr, scale=scale)
            else:
                xr = xr * scale
            y = (self.had_k.astype(xr.dtype) @ xr).reshape(x.shape)
        return y.astype(dtype)


def r3(x: mx.array) -> mx.array:
    """R3 of x's head rows (last axis): the normalized Walsh-Hadamard transform in float32,
    returned in x's dtype."""
    return mx.hadamard_transform(x.astype(mx.float32)).astype(x.dtype)


def rotate_heads(qk: mx.array, n_q: int, use_kernels: bool = True) -> tuple[mx.array, mx.array]:
    """R3 of q and k from their heads side by side, qk [B, n_q + Hkv, L, D]: (q, k). One
    launch for both where the kernel serves (a Mac, its self-test passed), else `r3` of qk."""
    q, k = qk[:, :n_q], qk[:, n_q:]
    if (
        use_kernels
        and kernels.head_hadamard_supported(q, k)
        and kernels.use("head_hadamard", head_hadamard_self_test)
    ):
        kernels.record("head_hadamard", "kernel")
        return kernels.head_hadamard(q, k)
    kernels.record("head_hadamard", "pure")
    qk = r3(qk)
    return qk[:, :n_q], qk[:, n_q:]


def head_hadamard_self_test(
    runner: kernels.Runner | None = None, big: bool = False
) -> tuple[mx.array, mx.array]:
    """(kernel, pure) R3 of a decode step's q and k at head_dim 128 (GQA 3) and of a 4-token
    verify at head_dim 64; `big`: a 512-token prefill at head_dim 128."""
    cases = (((24, 8, 512, 128), 1),) if big else (((24, 8, 1, 128), 1), ((4, 2, 4, 64), 2))
    got, want = [], []
    for (hq, hkv, rows, d), seed in cases:
        k1, k2 = mx.random.split(mx.random.key(seed))
        q = mx.random.normal((1, hq, rows, d), key=k1) * 4
        k = mx.random.normal((1, hkv, rows, d), key=k2) * 4
        got += [a.reshape(-1) for a in kernels.head_hadamard(q, k, runner)]
        want += [r3(q).reshape(-1), r3(k).reshape(-1)]
    return mx.concatenate(got), mx.concatenate(want)
