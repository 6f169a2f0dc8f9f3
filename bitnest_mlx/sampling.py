"""Sampling as a distribution: the map from logits to the sampled distribution, and the lossless
accept / resample rule of speculative decoding (Leviathan et al. 2023 / Chen et al. 2023)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class Sampler:
    """Temperature / top-p / min-p / top-k as one logits -> log-probabilities map.

    The same map is applied to draft and target logits, which rejection sampling needs to be
    lossless. Filters run on the T = 1 log-probabilities and temperature is applied last,
    in mlx-lm's order, so the distribution equals `mlx_lm.sample_utils.make_sampler`'s.
    Calling the object samples a token from log-probabilities, like an mlx-lm sampler.
    """

    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0

    def logprobs(self, logits: mx.array) -> mx.array:
        """logits [..., V] -> log-probabilities of the sampling distribution (float32)."""
        logits = logits.astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.temp == 0:
            # Greedy as a one-hot distribution: rejection sampling then reduces to exact match.
            # argmax of the log-probabilities, as mlx-lm's greedy sampler (same tie-breaking).
            hot = mx.arange(lp.shape[-1]) == mx.argmax(lp, axis=-1, keepdims=True)
            return mx.where(hot, 0.0, -mx.inf)
        if 0 < self.top_p < 1:
            lp = apply_top_p(lp, self.top_p)
        if self.min_p > 0:
            lp = apply_min_p(lp, self.min_p, self.min_tokens_to_keep)
        if 0 < self.top_k < lp.shape[-1]:
            lp = apply_top_k(lp, self.top_k)
        lp = lp / self.temp
        return lp - mx.logsumexp(lp, axis=-1, keepdims=True)

    def sample(self, logprobs: mx.array) -> mx.array:
        """Draw from `logprobs` as returned by `logprobs()` (argmax when greedy)."""
        if self.temp == 0:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(logprobs)

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self.sample(self.logprobs(logprobs))


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
) -> Sampler:
    """`mlx_lm.sample_utils.make_sampler`'s signature (without XTC), usable for speculation."""
    return Sampler(temp, top_p, min_p, min_tokens_to_keep, top_k)


def speculative_sample(
    drafts: mx.array, q_logprobs: mx.array, p_logprobs: mx.array
) -> tuple[mx.array, mx.array]:
    """Accept a prefix of the drafts and draw the next token; lossless w.r.t. the target.

    drafts [..., γ] (drawn from q), q_logprobs [..., γ, V] (draft), p_logprobs [..., γ+1, V]
    (target), both already processed by the same `Sampler.logprobs`. Leading axes are
    independent samples. Returns (n accepted [...], next token [...]): draft i is accepted with
    probability min(1, p/q); at the first rejection the token is drawn from norm(max(0, p - q)),
    and when all γ are accepted it is the bonus token drawn from the last target row.
    """
    gamma = drafts.shape[-1]
    p, q = mx.exp(p_logprobs.astype(mx.float32)), mx.exp(q_logprobs.astype(mx.float32))
    idx = drafts[..., None]
    p_d = mx.take_along_axis(p[..., :gamma, :], idx, axis=-1)[..., 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[..., 0]
    # u < p/q without dividing: q_d > 0 since d was drawn from q.
    accept = mx.random.uniform(shape=drafts.shape) * q_d < p_d
    n = mx.cumprod(accept.astype(mx.int32), axis=-1).sum(axis=-1)
    residual = mx.maximum(p[..., :gamma, :] - q, 0.0)
    # p == q leaves no residual mass; a rejection then has probability 0, any row will do.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p[..., :gamma, :])
    rows = mx.concatenate([residual, p[..., gamma:, :]], axis=-2)
    row = mx.take_along_axis(rows, n[..., None, None], axis=-2)[..., 0, :]
    return n, mx.random.categorical(mx.log(row))
