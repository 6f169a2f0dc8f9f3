"""Pipeline parallelism over `mx.distributed`: which layers a rank runs, and the hand-offs.

mlx-lm's convention (mlx_lm/models/pipeline.py), so a group launched for mlx-lm works here:
each rank holds one contiguous slice of the layers, and the slices run in *reverse* rank order.
The last rank (size - 1) runs the first layers, rank 0 the last ones; hidden states flow from
rank r + 1 to rank r. After the last stage every rank receives its output (all_gather), so every
rank computes the same logits and the same sampled tokens, and the generation loop needs no
change.

The model keeps the math; it only asks its `PipelineStage` which layers are local, whether it
embeds, and to `receive` / `hand_on` the hidden state. A model that is not split has the
one-stage default, whose hand-offs are the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


class PipelineError(ValueError):
    """A pipeline that cannot be formed: a format that cannot be split, or a split that leaves a
    rank without layers."""


@dataclass(frozen=True)
class PipelineStage:
    """Layers [start, end) of a model run on rank `rank` of `group` (None: not split)."""

    start: int
    end: int
    rank: int = 0
    size: int = 1
    group: mx.distributed.Group | None = None

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        return cls(0, num_layers)

    @classmethod
    def of(
        cls, group: mx.distributed.Group, num_layers: int, split: list[int] | None = None
    ) -> PipelineStage:
        """This rank's stage. `split[r]`: how many layers rank r runs (default: even, the low
        ranks, which run the last layers, take the remainder)."""
        rank, size = group.rank(), group.size()
        if split is None:
            base, extra = divmod(num_layers, size)
            split = [base + (r < extra) for r in range(size)]
        if len(split) != size or min(split) < 1 or sum(split) != num_layers:
            raise PipelineError(
                f"pipeline split {split}: need {size} positive counts summing to {num_layers} "
                "layers (every rank runs at least one layer)"
            )
        start = sum(split[rank + 1 :])  # ranks above this one run the layers before
        return cls(start, start + split[rank], rank, size, group)

    @property
    def first(self) -> bool:
        """Runs layer 0, so it embeds the tokens."""
        return self.rank == self.size - 1

    def receive(self, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        """The previous stage's hidden state (only on a stage that is not `first`)."""
        return mx.distributed.recv(shape, dtype, self.rank + 1, group=self.group)

    def hand_on(self, x: mx.array, cache) -> mx.array:
        """Send this stage's output on; return the last stage's output, on every rank.

        `cache` (this stage's last layer cache, with `depend_on`) is tied to the send:
        mlx-lm's prefill evaluates only the caches, not the logits, and without the tie that
        evaluation would not send, leaving the next stage waiting forever.
        """
        if self.size == 1:
            return x
        if self.rank > 0:
            x = mx.distributed.send(x, self.rank - 1, group=self.group)
            cache.depend_on(x)
        # Rank 0 ran the last layers; its rows come first in the gather.
        return mx.distributed.all_gather(x, group=self.group)[: x.shape[0]]


__all__ = ["PipelineError", "PipelineStage"]
