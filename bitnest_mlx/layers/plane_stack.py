"""Several dual-plane Linears that read one input (q/k/v, gate/up) stored as one stacked array.

The grouped kernel launch and the pure path's grouped quantized matmuls want [q; k; v] (or
[gate; up]) planes, scales and biases concatenated along N. Keeping a second, stacked copy would
add ~45 % to a package at rest, so the stacked array is the only copy: it is built at the group's
first use and each Linear's `hi`, `lo`, `scales` and `biases` become row slices of it (MLX slices
of whole rows share the buffer, no copy), after which the Linear's own arrays are dropped.
Parameter names and shapes do not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

PLANES = ("hi", "lo", "scales", "biases")


@dataclass(frozen=True)
class Stack:
    """The stacked planes of a group and the per-Linear slices of them that were installed."""

    hi: mx.array
    lo: mx.array
    scales: mx.array
    biases: mx.array  # -8·scales, for MLX's quantized matmul (the pure path)
    views: tuple[tuple[mx.array, ...], ...]  # per Linear: (hi, lo, scales, biases) as installed

    def serves(self, linears: Sequence[nn.Module]) -> bool:
        """Do the Linears still hold exactly the slices this stack installed? A load_weights,
        set_dtype or swapped module since replaces an array, and the stack is rebuilt."""
        return len(linears) == len(self.views) and all(
            all(getattr(lin, p) is v for p, v in zip(PLANES, views))
            for lin, views in zip(linears, self.views)
        )


def stackable(linears: Sequence[nn.Module]) -> bool:
    """Planes that one launch can read as one matrix: same K, weight group and scale dtype."""
    first = linears[0]
    return len(linears) > 1 and all(
        all(p in lin for p in PLANES)
        and lin.hi.shape[1:] == first.hi.shape[1:]
        and lin.scales.shape[1:] == first.scales.shape[1:]
        and lin.scales.dtype == first.scales.dtype
        for lin in linears
    )


def stacked_planes(linears: Sequence[nn.Module]) -> Stack:
    """[hi; ...], [lo; ...], [scales; ...] of `linears` (in order, stacked along N), built once
    and cached on the first Linear; the Linears then hold slices of it (one copy in memory)."""
    cached = getattr(linears[0], "_plane_stack", None)
    if cached is not None and cached.serves(linears):
        return cached
    stacked = [mx.concatenate([getattr(lin, p) for lin in linears]) for p in PLANES]
    edges = [0]
    for lin in linears:
        edges.append(edges[-1] + lin.hi.shape[0])
    views = tuple(tuple(a[edges[i] : edges[i + 1]] for a in stacked) for i in range(len(linears)))
    # Evaluated now so the slices point into the stacked buffer and the Linears' own arrays
    # can be freed when replaced below, not at the end of this step's graph.
    mx.eval(stacked, views)
    for lin, vs in zip(linears, views):
        for p, v in zip(PLANES, vs):
            setattr(lin, p, v)
    stack = Stack(*stacked, views=views)
    # A plain attribute (not an mx.array), so it is no parameter: the package format and
    # `parameters()` see only the per-Linear arrays.
    linears[0]._plane_stack = stack
    return stack
