"""Kernels a Mac launches for a lazy MLX graph, counted on a Linux CPU (the GPU basis).

On MLX's CPU backend `mx.fast.rms_norm`, `rope` and `scaled_dot_product_attention` are built as
their fallback graphs (5-15 primitives each), `mx.dequantize` as shifts and masks (about 20), and
`mx.fast.metal_kernel` cannot run at all; on a Metal GPU each is one kernel. `gpu_basis()` replaces
them, while it is active, by stand-ins: one primitive each (a `Concatenate`) that returns the right
shapes and dtypes and depends on every input, so the graph has the shape of the one a Mac builds.
`launches(outputs)` then counts every primitive that is not a view (`VIEWS`) as one kernel; a
compiled (`mx.compile`) chain is one `Compiled...` primitive, so one kernel, as on Metal.

Parts: while counting, `gpu_basis` can wrap the functions that make up a model's parts (norms, A8,
projections...); the kernels a part's call creates (its outputs' graph beyond its inputs', minus the
nodes an inner part already claimed) are that part's. Host syncs: `mx.eval`, `array.item()` and
`array.tolist()` that wait on work (unevaluated, or launched by `mx.async_eval`) count as one each
(`Ledger.syncs`), and the work they evaluate is counted there.

What this does not see: a `Reshape` that copies a non-contiguous input (counted as a view), the copy
MLX makes of a non-contiguous input to a `metal_kernel` launch, and kernels MLX itself splits (a
two-pass reduction, the GEMV variants): MLX's Metal backend may launch a few more than counted,
never fewer.
"""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import mlx.core as mx
import mlx.nn as nn

# Primitives that give a view of their input (no kernel on Metal).
VIEWS = frozenset(
    {
        "AsStrided",
        "Broadcast",
        "BroadcastAxes",
        "Depends",
        "ExpandDims",
        "Flatten",
        "Reshape",
        "Slice",
        "Split",
        "Squeeze",
        "StopGradient",
        "Transpose",
        "Unflatten",
        "View",
    }
)


def launches(outputs: Sequence[mx.array]) -> Counter:
    """Kernels a Mac launches to evaluate `outputs`, by primitive name: one per distinct
    (primitive, inputs) of the graph that is not a view. A compiled function's calls share one
    primitive object, so a primitive alone would count them once."""
    arrays = [a for a in outputs if isinstance(a, mx.array)]
    if not arrays:
        return Counter()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "g.dot"
        mx.export_to_dot(str(path), *arrays)
        lines = path.read_text().splitlines()
    seen: dict[tuple, str] = {}
    node, name, inputs = None, "", []
    # The export's lines: '{ <node> [label ="<name>", ...' opens a primitive, '<array> -> <node>'
    # names one of its inputs (str methods: this runs for every part of every counted step).
    for line in [*lines, '{ 0 [label ="end"']:
        if line.startswith("{ ") and ' [label ="' in line:
            if node is not None:
                seen[(node, tuple(inputs))] = name
            head, _, rest = line[2:].partition(' [label ="')
            node, name, inputs = head, rest.partition('"')[0], []
        elif node is not None and line.endswith(" -> " + node):
            inputs.append(line[: -len(node) - 4])
    return Counter(n for n in seen.values() if is_kernel(n))


def count(outputs: Sequence[mx.array]) -> int:
    return sum(launches(outputs).values())


def is_kernel(name: str) -> bool:
    return name.split(" ")[0] not in VIEWS  # "View float16": the name, then its parameters


def arrays_in(obj: Any) -> list[mx.array]:
    """The mx.arrays in nested tuples / lists / dicts (a function's arguments or results)."""
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for o in obj for a in arrays_in(o)]
    if isinstance(obj, dict) and not isinstance(obj, nn.Module):  # a module: its weights
        return [a for o in obj.values() for a in arrays_in(o)]
    return []


# ---------------------------------------------------------------------------------------------
# Stand-ins: one primitive that depends on every input and has the outputs' shapes.

_EVAL = mx.eval  # the real one: gpu_basis counts calls to mx.eval as host syncs


@cache
def _pad(nbytes: int) -> mx.array:
    """Evaluated zero bytes (a source, not a node), one array per size."""
    zeros = mx.zeros((nbytes,), dtype=mx.uint8)
    _EVAL(zeros)
    return zeros


def stand_in(
    inputs: Sequence[Any], shapes: Sequence[Sequence[int]], dtypes: Sequence[mx.Dtype]
) -> list[mx.array]:
    """Arrays of `shapes`/`dtypes` from one Concatenate over one element of every input array
    (views) and zero padding: one kernel, evaluable on a CPU, cheap at any size."""
    heads = []
    for a in arrays_in(list(inputs)):
        one = a[tuple(slice(0, 1) for _ in a.shape)].reshape(1) if a.ndim else a.reshape(1)
        heads.append(one.view(mx.uint8))
    sizes = [max(1, math.prod(s)) * d.size for s, d in zip(shapes, dtypes)]
    flat = mx.concatenate([*heads, _pad(sum(sizes))])[len(heads) :]
    outs, at = [], 0
    for shape, dtype, size in zip(shapes, dtypes, sizes):
        outs.append(flat[at : at + size].view(dtype).reshape(shape))
        at += size
    return outs


def _rms_norm(x, weight, eps):
    return stand_in([x, weight], [x.shape], [x.dtype])[0]


def _layer_norm(x, weight, bias, eps):
    return stand_in([x, weight, bias], [x.shape], [x.dtype])[0]


def _rope(x, dims, *, traditional, base, scale, offset, freqs=None):
    return stand_in([x, offset, freqs], [x.shape], [x.dtype])[0]


def _sdpa(q, k, v, *, scale, mask=None, sinks=None, **kw):
    shape = (*q.shape[:-1], v.shape[-1])
    return stand_in([q, k, v, mask, sinks], [shape], [q.dtype])[0]


def _dequantize(w, scales, biases=None, group_size=None, bits=None, mode="affine", **kw):
    # One kernel on a Mac: MLX builds it as one primitive there; only the CPU backend expands
    # it to shifts and masks (about 20 primitives).
    shape = (*w.shape[:-1], w.shape[-1] * 32 // (bits or 4))
    return stand_in([w, scales, biases], [shape], [scales.dtype])[0]


def _launch(launch, verbose: bool = False) -> list[mx.array]:
    return stand_in(launch.inputs, launch.output_shapes, launch.output_dtypes)


# ---------------------------------------------------------------------------------------------
# Parts and syncs.


@dataclass
class Ledger:
    """Kernels by part (each call's new kernels, less those of the parts called inside it) and
    the host syncs with the kernels each evaluated."""

    parts: Counter = field(default_factory=Counter)
    open: list[int] = field(default_factory=list)  # kernels claimed inside each open call
    syncs: list[int] = field(default_factory=list)  # kernels evaluated at each sync
    launched: int = 0  # kernels evaluated at async_eval and the syncs
    in_flight: set[int] = field(default_factory=set)  # ids of arrays async_eval launched

    def claim(self, part: str, inputs: Sequence[mx.array], outputs: Sequence[mx.array]) -> None:
        """Count the kernels `outputs` need beyond `inputs` as `part`'s (a call with no open
        part around it)."""
        self.open.append(0)
        self.close(part, inputs, outputs)

    def close(
        self,
        part: str,
        inputs: Sequence[mx.array],
        outputs: Sequence[mx.array],
        new: int | None = None,
    ) -> None:
        """End the innermost open call: its kernels are `new`, or those `outputs` need beyond
        `inputs` when None (counted from the graph)."""
        if new is None:
            new = count([*inputs, *outputs]) - count(inputs)
        inner = self.open.pop()
        self.parts[part] += new - inner
        if self.open:
            self.open[-1] += new

    def by_part(self, outputs: Sequence[mx.array], rest: str = "other") -> Counter:
        """The kernels launched so far and those `outputs` still need: the parts claimed, the
        remainder as `rest`."""
        total = count(outputs) + self.launched
        return Counter({**self.parts, rest: total - sum(self.parts.values())})

    def evaluated(self, arrays: Sequence[mx.array], sync: bool) -> None:
        """Kernels launched by evaluating `arrays`; a sync (a host read) counts when it waits on
        work: new kernels, or an array an `mx.async_eval` launched (kernels already counted)."""
        n = count(arrays)
        self.launched += n
        if not sync:
            self.in_flight |= {id(a) for a in arrays}
            return
        waited = {id(a) for a in arrays} & self.in_flight
        self.in_flight -= waited
        if n or waited:
            self.syncs.append(n)


def part(
    ledger: Ledger,
    name: str | Callable[..., str],
    fn: Callable,
    result: Callable[..., Any] | None = None,
) -> Callable:
    """`fn` whose calls' new kernels belong to part `name` (or `name(*args)`); `result(*args)`
    gives the arrays a call writes when it returns none (a cache's store)."""

    def wrapped(*args, **kwargs):
        ledger.open.append(0)
        out = fn(*args, **kwargs)
        label = name(*args, **kwargs) if callable(name) else name
        made = out if result is None else result(*args, **kwargs)
        ledger.close(label, arrays_in([args, kwargs]), arrays_in(made))
        return out

    return wrapped


def _one_kernel(ledger: Ledger, name: str, stand_in_fn: Callable) -> Callable:
    """A stand-in's calls as part `name`: one kernel each, known without reading the graph
    (a stand-in adds exactly one primitive, its Concatenate, beyond its inputs)."""

    def wrapped(*args, **kwargs):
        ledger.open.append(0)
        out = stand_in_fn(*args, **kwargs)
        ledger.close(name, [], [], new=1)
        return out

    return wrapped


@contextmanager
def gpu_basis(ledger: Ledger | None = None, parts: Sequence[tuple] = ()) -> Iterator[Ledger]:
    """While active: `mx.fast` ops and Metal kernel launches are one-primitive stand-ins (the
    norms and RoPE claimed as parts "norm" / "rope", attention as "attention"), each `(owner,
    attribute, part name[, result])` of `parts` is wrapped by `part`, and host syncs are
    counted."""
    ledger = ledger or Ledger()
    fast = {
        "rms_norm": ("norm", _rms_norm),
        "layer_norm": ("norm", _layer_norm),
        "rope": ("rope", _rope),
        "scaled_dot_product_attention": ("attention", _sdpa),
    }
    from bitnest_mlx.kernels import launch

    eval_, async_eval = mx.eval, mx.async_eval
    item, tolist = mx.array.item, mx.array.tolist

    def sync_eval(*args):
        ledger.evaluated(arrays_in(list(args)), sync=True)
        return eval_(*args)

    def pipelined(*args):
        ledger.evaluated(arrays_in(list(args)), sync=False)
        return async_eval(*args)

    def read(method):
        def wrapped(self, *a):
            ledger.evaluated([self], sync=True)
            return method(self, *a)

        return wrapped

    with ExitStack() as stack:
        for attr, (label, fn) in fast.items():
            stack.enter_context(mock.patch.object(mx.fast, attr, _one_kernel(ledger, label, fn)))
        stack.enter_context(mock.patch.object(launch, "metal_runner", _launch))
        stack.enter_context(mock.patch.object(mx, "dequantize", _dequantize))
        for owner, attr, label, *result in parts:
            wrapped = part(ledger, label, getattr(owner, attr), *result)
            stack.enter_context(mock.patch.object(owner, attr, wrapped))
        stack.enter_context(mock.patch.object(mx, "eval", sync_eval))
        stack.enter_context(mock.patch.object(mx, "async_eval", pipelined))
        stack.enter_context(mock.patch.object(mx.array, "item", read(item)))
        stack.enter_context(mock.patch.object(mx.array, "tolist", read(tolist)))
        yield ledger
