"""The draft's lm_head over a reduced vocabulary (docs/bitnest-package.md §2.9).

FR-Spec / VocabTrim: the draft scores only the K most frequent tokens, so it reads K rows of the
lm_head's hi plane instead of V. Its logits elsewhere are -inf: the draft's distribution puts all
its mass on the kept ids, and the target, which verifies over every row, still emits any token.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .dual_plane import DualPlaneLinear
from .options import RunOptions


class DraftVocabHead(nn.Module):
    """logits [..., V] of the W4 lm_head restricted to `ids` (int32 [K], increasing), -inf at
    every other id. `rows` holds the gathered hi-plane rows and scales of those ids, the one
    copy made at load; its `lo` is the same array as its `hi` (never read: draft only)."""

    def __init__(self, in_features: int, vocab_size: int, kept: int, group_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.ids = mx.zeros((kept,), dtype=mx.int32)
        self.rows = DualPlaneLinear(in_features, kept, group_size=group_size)

    def __call__(self, x: mx.array, options: RunOptions) -> mx.array:
        if not options.draft:
            raise ValueError("DraftVocabHead: the reduced vocabulary is the draft's (W4) only")
        y = self.rows(x, options)  # [..., K]
        full = mx.full((*y.shape[:-1], self.vocab_size), -mx.inf, dtype=y.dtype)
        index = mx.broadcast_to(self.ids, y.shape)
        return mx.put_along_axis(full, index, y, axis=-1)

    @staticmethod
    def prepare(tensors: dict, ids: mx.array, prefix: str, dtype: mx.Dtype) -> dict:
        """The lm_head's package tensors -> this module's parameters (under `prefix`): its hi
        rows and scales at `ids`, gathered once."""
        hi = tensors["lm_head.hi"][ids]
        # lo is the same gathered buffer (a view of it), so the gather is the only copy.
        kept = {
            "lm_head.hi": hi,
            "lm_head.lo": hi,
            "lm_head.scales": tensors["lm_head.scales"][ids],
        }
        rows = DualPlaneLinear.prepare(kept, "lm_head", dtype)
        return {f"{prefix}.ids": ids} | {
            f"{prefix}.rows.{k.removeprefix('lm_head.')}": v for k, v in rows.items()
        }

    @classmethod
    def from_lm_head(cls, lm_head: DualPlaneLinear, ids: mx.array) -> DraftVocabHead:
        """The head over `ids` gathered from a loaded lm_head (a measurement of several K on one
        model; a package's own ids come through `prepare` at load)."""
        n, k8 = lm_head.hi.shape
        head = cls(k8 * 8, n, ids.size, lm_head.group_size)
        head.ids = ids.astype(mx.int32)
        head.rows.hi = head.rows.lo = lm_head.hi[head.ids]
        head.rows.scales = lm_head.scales[head.ids]
        head.rows.biases = lm_head.biases[head.ids]
        mx.eval(head.parameters())
        return head


def restrict_logits(logits: mx.array, ids: mx.array) -> mx.array:
    """Logits [..., V] kept at `ids` and -inf at every other id: what a draft over those ids
    scores, from the logits of every row (the same W4 rows)."""
    outside = mx.full((logits.shape[-1],), -mx.inf, dtype=logits.dtype)
    outside[ids] = 0
    return logits + outside


def draft_tokens(model: nn.Module) -> int:
    """The token ids a model's draft scores: its reduced vocabulary's K, else the vocabulary."""
    head = getattr(model, "draft_head", None)
    return model.args.vocab_size if head is None else head.ids.size
