"""Sampling as a distribution: the map from logits to the sampled distribution, the lossless
accept / resample rules of speculative decoding, and the randomness of seeded runs.

Two accept rules, both lossless (the emitted tokens follow the target exactly):

* `speculative_sample`: rejection sampling (Leviathan et al. 2023 / Chen et al. 2023), accept
  with probability min(1, p/q). The highest possible acceptance, sum(min(p, q)).
* `gumbel_speculative_sample`: Gumbel-max coupling. Position i's token is argmax(lp_i + g_i)
  with Gumbel noise g_i shared by draft and target, so a draft is accepted iff it equals the
  target's own sample: the output is the target-only sample for that noise, whatever γ.

`PositionNoise` makes seeded runs reproducible: every random number is a pure function of
(seed, generated-token position, stream), independent of the draft length, of timing and of the
global `mx.random` state.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

RULES = ("gumbel", "rejection")  # accept rules of speculative decoding (see the module doc)


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

    def sample(self, logprobs: mx.array, noise: mx.array | None = None) -> mx.array:
        """Draw from `logprobs` as returned by `logprobs()` (argmax when greedy).

        With `noise` (standard Gumbel, same shape) the draw is argmax(logprobs + noise), a
        deterministic function of the noise; without, it uses the global `mx.random` state.
        """
        if self.temp == 0:
            return mx.argmax(logprobs, axis=-1)
        if noise is not None:
            return gumbel_sample(logprobs, noise)
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
    drafts: mx.array,
    q_logprobs: mx.array,
    p_logprobs: mx.array,
    uniform: mx.array | None = None,
    noise: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Accept a prefix of the drafts and draw the next token; lossless w.r.t. the target.

    drafts [..., γ] (drawn from q), q_logprobs [..., γ, V] (draft), p_logprobs [..., γ+1, V]
    (target), both already processed by the same `Sampler.logprobs`. Leading axes are
    independent samples. Returns (n accepted [...], next token [...]): draft i is accepted with
    probability min(1, p/q); at the first rejection the token is drawn from norm(max(0, p - q)),
    and when all γ are accepted it is the bonus token drawn from the last target row.

    Seeded runs pass the randomness in: `uniform` [..., γ] for the accept tests and `noise`
    [..., γ+1, V] (standard Gumbel) for the draw from the row that is emitted. A residual
    row's noise must be independent of the noise its position's draft was drawn with; the
    bonus row's position had no draft this round, so its draft noise will do. Without them the
    global `mx.random` is used.
    """
    gamma = drafts.shape[-1]
    p, q = mx.exp(p_logprobs.astype(mx.float32)), mx.exp(q_logprobs.astype(mx.float32))
    idx = drafts[..., None]
    p_d = mx.take_along_axis(p[..., :gamma, :], idx, axis=-1)[..., 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[..., 0]
    # u < p/q without dividing: q_d > 0 since d was drawn from q.
    if uniform is None:
        uniform = mx.random.uniform(shape=drafts.shape)
    accept = uniform * q_d < p_d
    n = mx.cumprod(accept.astype(mx.int32), axis=-1).sum(axis=-1)
    residual = mx.maximum(p[..., :gamma, :] - q, 0.0)
    # p == q leaves no residual mass; a rejection then has probability 0, any row will do.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p[..., :gamma, :])
    rows = mx.concatenate([residual, p[..., gamma:, :]], axis=-2)
    row = mx.log(mx.take_along_axis(rows, n[..., None, None], axis=-2)[..., 0, :])
    if noise is None:
        return n, mx.random.categorical(row)
    row_noise = mx.take_along_axis(noise, n[..., None, None], axis=-2)[..., 0, :]
    return n, gumbel_sample(row, row_noise)


def acceptance_probability(q_logprobs: mx.array, p_logprobs: mx.array) -> mx.array:
    """Σ_x min(p(x), q(x)) per row [...] of draft q and target p log-probabilities [..., V]
    (both from the same `Sampler.logprobs`): the probability that `speculative_sample` accepts
    a draft drawn from q, the most any lossless accept rule can reach."""
    p, q = mx.exp(p_logprobs.astype(mx.float32)), mx.exp(q_logprobs.astype(mx.float32))
    return mx.minimum(p, q).sum(axis=-1)


# --------------------------------------------------------------------------------------------
# Seeded randomness: a pure function of (seed, position, stream)

GUMBEL, ACCEPT, RESAMPLE = 0, 1, 2  # PositionNoise streams
_MASK64 = (1 << 64) - 1
_TINY = float(np.finfo(np.float32).tiny)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class PositionNoise:
    """The random numbers of a seeded run, keyed by (seed, position, stream).

    `position` is the index of the generated token (0 = the first token after the prompt).
    Streams: GUMBEL (the draft's proposal and the target's sample at that position, and the
    bonus token), ACCEPT (rejection rule: the uniform of the accept test), RESAMPLE (rejection
    rule: the Gumbel noise of the residual draw). A row is drawn on its own key, so its values
    do not depend on how many rows are requested with it, nor on anything drawn before.
    """

    seed: int

    def key(self, position: int, stream: int = GUMBEL) -> mx.array:
        x = _splitmix64(self.seed & _MASK64)
        x = _splitmix64(x ^ (position & _MASK64))
        return mx.random.key(_splitmix64(x ^ stream))

    def uniform(self, start: int, count: int, stream: int = ACCEPT) -> mx.array:
        """[count] uniforms in [0, 1), one per position start..start+count-1."""
        positions = range(start, start + count)
        rows = [mx.random.uniform(shape=(1,), key=self.key(i, stream)) for i in positions]
        return mx.concatenate(rows) if rows else mx.zeros((0,))

    def gumbel(self, start: int, count: int, vocab: int, stream: int = GUMBEL) -> mx.array:
        """[count, vocab] standard Gumbel noise, one row per position start..start+count-1.

        The uniforms are bounded below by float32's smallest normal, so the noise is finite
        (a -inf on the only finite entry of a filtered row would otherwise pick token 0).
        """
        rows = []
        for i in range(start, start + count):
            u = mx.random.uniform(low=_TINY, high=1.0, shape=(vocab,), key=self.key(i, stream))
            rows.append(-mx.log(-mx.log(u)))
        return mx.stack(rows) if rows else mx.zeros((0, vocab))

    def rejection_sample(
        self, drafts: mx.array, q_logprobs: mx.array, p_logprobs: mx.array, start: int, g: mx.array
    ) -> tuple[mx.array, mx.array]:
        """`speculative_sample` with this noise, for drafts at positions start..start+γ-1 drawn
        with the GUMBEL rows g [γ+1, V]: ACCEPT uniforms, RESAMPLE noise for a residual draw,
        and g's last row for the bonus token (no draft of this round used it)."""
        gamma = drafts.shape[-1]
        noise = mx.concatenate([self.gumbel(start, gamma, g.shape[-1], RESAMPLE), g[gamma:]])
        return speculative_sample(drafts, q_logprobs, p_logprobs, self.uniform(start, gamma), noise)


def gumbel_sample(logprobs: mx.array, noise: mx.array) -> mx.array:
    """argmax(logprobs + noise): a draw from softmax(logprobs) for standard Gumbel noise."""
    return mx.argmax(logprobs + noise, axis=-1)


class SeededSampler:
    """An mlx-lm sampler (log-probabilities [..., V] -> token) for seeded non-speculative runs.

    Its n-th call draws with `PositionNoise(seed)`'s Gumbel row n, the noise the speculative
    loop uses at position n: one instance per generation (it counts the calls).
    """

    def __init__(self, sampler: Sampler, seed: int):
        self.sampler, self.noise, self.position = sampler, PositionNoise(seed), 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        lp = self.sampler.logprobs(logprobs)
        noise = None
        if self.sampler.temp > 0:
            noise = self.noise.gumbel(self.position, 1, lp.shape[-1])[0]
        self.position += 1
        return self.sampler.sample(lp, noise)


def gumbel_speculative_sample(
    drafts: mx.array, p_logprobs: mx.array, noise: mx.array | None
) -> tuple[mx.array, mx.array]:
    """Accept rule of the Gumbel-max coupling; lossless and the target-only sample itself.

    drafts [..., γ] must be argmax(q_i + noise_i) (the draft's Gumbel-max samples with the same
    noise); p_logprobs [..., γ+1, V] (target, processed by `Sampler.logprobs`); noise
    [..., γ+1, V] standard Gumbel, or None for greedy. The target's tokens are
    t_i = argmax(p_i + noise_i); draft i is accepted iff it equals t_i (and all before it were
    accepted). Returns (n accepted [...], next token t_n [...]). Every emitted token is t_i,
    so the output is what target-only decoding with the same noise gives, for any γ;
    acceptance is P(argmax(q + g) = argmax(p + g)) <= sum(min(p, q)).
    """
    gamma = drafts.shape[-1]
    lp = p_logprobs.astype(mx.float32)
    target = mx.argmax(lp, axis=-1) if noise is None else gumbel_sample(lp, noise)  # [..., γ+1]
    match = (target[..., :gamma] == drafts).astype(mx.int32)
    n = mx.cumprod(match, axis=-1).sum(axis=-1) if gamma else mx.zeros(drafts.shape[:-1], mx.int32)
    return n, mx.take_along_axis(target, n[..., None], axis=-1)[..., 0]
