"""Online R4: the normalized (hadK ⊗ H_{n/K}) transform on the down_proj input."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


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
