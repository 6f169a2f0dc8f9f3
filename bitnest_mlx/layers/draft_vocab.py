"""The draft's lm_head over a reduced vocabulary (docs/bitnest-package.md §2.9).

FR-Spec / VocabTrim: the draft scores only the K most frequent tokens, so it reads K rows of the
lm_head's hi plane instead of V. Its logits elsewhere are -inf: the draft's distribution puts all
its mass on the kept ids, and the target, which verifies over every row, still emits any token.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .dual_plane import DualPlaneLinear
from .options import RunOptions

# The run-time join's row buffers grow by at least this many rows (and at least double), so a
# generation gathers each new id's row once and copies its buffers O(log n) times.
JOIN_CHUNK = 64


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
        y, ids = self.rows(x, options), self.ids  # [..., K]
        join = options.draft_join
        if join is not None and join.size:
            # The generation's joined ids: their rows of the same W4 lm_head, scored beside K.
            y = mx.concatenate([y, join.rows(x, options)], axis=-1)
            ids = join.ids
        full = mx.full((*y.shape[:-1], self.vocab_size), -mx.inf, dtype=y.dtype)
        index = mx.broadcast_to(ids, y.shape)
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


class DraftVocabJoin:
    """The token ids of one generation's context (prompt and text so far) that the package's
    draft vocabulary leaves out, joined to it for that generation: their hi-plane rows (and
    scales, biases; dense rows under `keep_dense`) gathered from the lm_head the target reads
    anyway, each once, into buffers grown by chunks.

    A drafted token is only proposed; the target verifies every one, so joining ids changes the
    draft's distribution, never the output. One object belongs to one generation and reaches the
    head through that generation's `RunOptions.draft_join`: state per request, nothing set on the
    model, so nothing carries over to the next generation.
    """

    def __init__(self, model: nn.Module, tokens: Iterable[int] = ()):
        head, lm_head = model.draft_head, model.lm_head
        self._lm_head, self._kept = lm_head, head.ids
        self._seen = np.zeros(head.vocab_size, dtype=bool)  # kept or joined: nothing to gather
        self._seen[np.array(head.ids)] = True
        self._joined: list[int] = []
        self._buffers: dict[str, mx.array] = {}  # capacity rows of each gathered array
        self.ids = head.ids  # kept ids, then the joined ones: where the head scatters
        self.rows: DualPlaneLinear | None = None  # the joined rows, a view of the buffers
        self.add(tokens)

    @classmethod
    def for_model(cls, model: nn.Module, tokens: Iterable[int] = ()) -> DraftVocabJoin | None:
        """A join for a model whose draft has a reduced vocabulary, else None (nothing left out)."""
        return cls(model, tokens) if getattr(model, "draft_head", None) is not None else None

    @property
    def size(self) -> int:
        """How many rows were joined (gathered) so far."""
        return len(self._joined)

    def add(self, tokens: Iterable[int]) -> int:
        """Join the ids of `tokens` the draft cannot score yet; returns `size`."""
        t = np.unique(np.fromiter(tokens, dtype=np.int64))
        t = t[(t >= 0) & (t < self._seen.size)]
        new = t[~self._seen[t]]
        if new.size:
            self._seen[new] = True
            self._gather(new)
        return self.size

    def _gather(self, new: np.ndarray) -> None:
        n, lm = self.size, self._lm_head
        need = n + new.size
        rows = mx.array(new.astype(np.int32))
        sources = {"hi": lm.hi, "scales": lm.scales, "biases": lm.biases}
        dense = getattr(lm, "kept_dense", None)
        if dense is not None:
            sources["dense"] = dense[True]
        cap = next(iter(self._buffers.values())).shape[0] if self._buffers else 0
        if need > cap:  # grow: copy the n rows held, never re-gather them
            cap = max(2 * cap, -(-need // JOIN_CHUNK) * JOIN_CHUNK)
            for name, src in sources.items():
                old = self._buffers.get(name, src[:0])[:n]
                pad = mx.zeros((cap - n, *src.shape[1:]), dtype=src.dtype)
                self._buffers[name] = mx.concatenate([old, pad])
        for name, src in sources.items():
            self._buffers[name][n:need] = src[rows]
        self._joined.extend(new.tolist())
        self.ids = mx.concatenate([self._kept, mx.array(self._joined, dtype=mx.int32)])
        self.rows = self._view(need)
        mx.eval(self.ids, *self._buffers.values())

    def _view(self, n: int) -> DualPlaneLinear:
        """A Linear over the first n buffered rows (slices: no copy); lo = hi, never read."""
        b, lm = self._buffers, self._lm_head
        rows = DualPlaneLinear(lm.hi.shape[1] * 8, n, group_size=lm.group_size)
        rows.hi = rows.lo = b["hi"][:n]
        rows.scales, rows.biases = b["scales"][:n], b["biases"][:n]
        if "dense" in b:  # `keep_dense` models multiply floats; the draft reads only W4
            object.__setattr__(rows, "kept_dense", {True: b["dense"][:n]})
        return rows


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
