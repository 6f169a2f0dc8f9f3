"""Hadamard matrices for R4 (numpy, float64): Sylvester, Paley constructions and the K × 2^k split.

The runtime never builds a K > 1 matrix itself: the package ships the one the writer used
(`aux.had_K.<K>`), because different Hadamard matrices of the same order are not interchangeable.
"""

from __future__ import annotations

import numpy as np

# QuaRot/SpinQuant's search order, plus 76 (Qwen2.5-0.5B: 4864 = 76·64).
K_CANDIDATES = (172, 156, 140, 108, 76, 60, 52, 36, 28, 44, 40, 20, 12)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def sylvester(n: int) -> np.ndarray:
    """Natural-order Walsh-Hadamard matrix, H[i, j] = (-1)^popcount(i & j)."""
    if not is_power_of_two(n):
        raise ValueError(f"Sylvester Hadamard needs a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    squares = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if a in squares else -1 for a in range(1, q)])
    return chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]


def paley(order: int) -> np.ndarray | None:
    """A Hadamard matrix of `order` by Paley I (q ≡ 3 mod 4) or II (q ≡ 1 mod 4), q prime."""
    q = order - 1
    if _is_prime(q) and q % 4 == 3:
        s = np.zeros((order, order))
        s[0, 1:], s[1:, 0] = 1, -1
        s[1:, 1:] = _jacobsthal(q)
        return s + np.eye(order)
    q = order // 2 - 1
    if order % 2 == 0 and _is_prime(q) and q % 4 == 1:
        c = np.zeros((q + 1, q + 1))
        c[0, 1:], c[1:, 0] = 1, 1
        c[1:, 1:] = _jacobsthal(q)
        plus, minus = np.array([[1, -1], [-1, -1]]), np.array([[1, 1], [1, -1]])
        return np.kron(c, plus) + np.kron(np.eye(q + 1), minus)
    return None


def _construct(k: int) -> np.ndarray | None:
    if is_power_of_two(k):
        return sylvester(k)
    h = paley(k)
    if h is None and k % 2 == 0 and (half := _construct(k // 2)) is not None:
        h = np.block([[half, half], [half, -half]])
    return h


def hadamard_k(k: int) -> np.ndarray:
    """A ±1 matrix H with H·Hᵀ = k·I (Sylvester, Paley, or Sylvester-doubling of either)."""
    h = _construct(k)
    if h is None:
        raise ValueError(f"no Hadamard construction for order {k}")
    return h


def split_k(n: int) -> int:
    """The K of n = K · 2^k used for R4 (1 when n is a power of two)."""
    if is_power_of_two(n):
        return 1
    for k in K_CANDIDATES:
        if n % k == 0 and is_power_of_two(n // k) and _construct(k) is not None:
            return k
    raise ValueError(f"intermediate size {n} is not K·2^k for any supported K {K_CANDIDATES}")


def r4_transform(x: np.ndarray, had_k: np.ndarray | None) -> np.ndarray:
    """y = (hadK ⊗ H_{n/K}) x / sqrt(n) along the last axis (float64).

    With x's last axis as a [K, m] block X (m = n/K), y's is hadK · X · H_mᵀ; each factor is
    applied as one 2-D product over all rows: a stack of [K, m] blocks times a matrix is one
    small product per row, which BLAS cannot block (docs/convert.md, "Bounds")."""
    n = x.shape[-1]
    k = 1 if had_k is None else had_k.shape[0]
    m = n // k
    y = x.astype(np.float64).reshape(-1, m) @ sylvester(m).T  # rows of X H_mᵀ
    if had_k is not None:  # hadK · Y, as (Yᵀ hadKᵀ)ᵀ on [rows·m, K]
        y = y.reshape(-1, k, m).transpose(0, 2, 1).reshape(-1, k) @ had_k.T
        y = y.reshape(-1, m, k).transpose(0, 2, 1)
    return (y / np.sqrt(n)).reshape(x.shape)
