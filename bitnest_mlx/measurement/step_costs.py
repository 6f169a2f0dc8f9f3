"""Step-time costs for the reports (eval, `bench --workloads`, `bench --speed-model`, the timing
runs' projections, the converter's draft-vocabulary choice): bytes per token from the
roofline, kernels per token counted from the model's own graph (`dispatches`), host syncs of a
round as counted, on each chip's constants (runtime/step_time.py, docs/step-time.md).

A count builds the model at 2 and 1 layers and walks each step's graph: tens of seconds on a
small model here, about 17 min at 3B dims. So each structure (a model's args) is counted once per
process; `counts` may be given instead (a count already made, or `step_kernels.STORED` where a
test does not measure the counter).

What a Mac must confirm: the counts are of the graph (a Mac may split or fuse a few kernels),
and f, t_k and t_sync are fitted on an M4 Max or assumed elsewhere (`step_time.provenance`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import mlx.nn as nn

from ..runtime.speed_model import CostModel
from ..runtime.step_kernels import PassKernels, PathKernels, timed_cost
from ..runtime.step_time import Step, step_seconds, tokens_per_second
from . import step_fit
from .roofline import roofline

_COUNTED: dict[str, dict[str, PathKernels]] = {}
_PEERS: dict[tuple[str, int], float] = {}
# mlx-lm's default quantization group (`mlx_lm.convert -q`), which its published 4- and 8-bit
# checkpoints use: the peers' bytes are priced at it.
PEER_GROUP = 64


def _key(args) -> str:
    return json.dumps(args.to_dict(), sort_keys=True, default=str)


def path_kernels(counts: Mapping[str, Mapping]) -> dict[str, PathKernels]:
    """`dispatches.count_bitnest`'s {path: {step: Count}} as the runtime's PathKernels: the
    draft and target steps, each counted verify pass by its rows, the round's host syncs."""
    out = {}
    for path, steps in counts.items():
        each = {name: PassKernels(c.per_layer, c.outside) for name, c in steps.items()}
        verify = sorted(
            (int(n.split("_")[1]), k) for n, k in each.items() if n.startswith("verify")
        )
        (syncs,) = [c.syncs for name, c in steps.items() if name.startswith("round")]
        out[path] = PathKernels(each["draft"], each["target"], tuple(verify), float(syncs))
    return out


def counted(args) -> dict[str, PathKernels]:
    """{path: PathKernels} of a bitnest model of `args`, counted once per structure."""
    from .dispatches import count_bitnest

    key = _key(args)
    if key not in _COUNTED:
        _COUNTED[key] = path_kernels(count_bitnest(args))
    return _COUNTED[key]


def cost_model(
    model: nn.Module,
    context: int,
    chip: str,
    path: str,
    draft_kv: int = 4,
    counts: Mapping[str, PathKernels] | None = None,
) -> CostModel:
    """The step-time CostModel of `model` on `chip` and `path` at `context` tokens: its bytes
    per token there (the draft reading KV `draft_kv`), the verify pass's KV share, its kernels
    per token (`counts`, default `counted(model.args)`) and a round's syncs."""
    roof = roofline(model, context, draft_kv)
    per_token = roof["bytes_per_token"]
    kv_fraction = (
        roof["kv_bytes_per_context_token"]["target"]
        * context
        / roof["weight_bytes_per_token"]["target"]
    )
    kernels = (counts or counted(model.args))[path]
    layers = model.args.num_hidden_layers
    return timed_cost(
        per_token["target"], per_token["draft"], kernels, layers, chip, path, kv_fraction
    )


def peer_config(args) -> dict:
    """The Hugging Face config fields of mlx-lm's Llama on a bitnest package's dims."""
    fields = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads")
    fields += ("num_key_value_heads", "head_dim", "vocab_size")
    return {"model_type": "llama", **{f: getattr(args, f) for f in fields}}


def peer_kernels(args, bits: int) -> float:
    """Kernels a token of mlx-lm's Llama at `args`' dims, quantized at `bits`, counted once."""
    from .dispatches import count_mlx_lm_llama

    key = (_key(args), bits)
    if key not in _PEERS:
        c = count_mlx_lm_llama(args, bits)
        _PEERS[key] = c.per_token(args.num_hidden_layers)
    return _PEERS[key]


def peer_step(args, bits: int, context: int) -> Step:
    """One decode token of mlx-lm's Llama at `args`' dims and `bits` (group PEER_GROUP) at
    `context` tokens: its weights and float16 KV, its counted kernels, no sync (its loop is
    pipelined)."""
    config = peer_config(args)
    nbytes = step_fit.weight_bytes(config, bits, PEER_GROUP) + step_fit.kv_bytes(config, context)
    return Step(nbytes, peer_kernels(args, bits))


def over_peer(cost: CostModel, args, context: int, bits: int = 4) -> float:
    """Target-only tok/s at `cost` over mlx-lm's `bits`-bit Llama of `args`' dims at `context`
    tokens, both on `cost`'s chip: what a speed-up over target-only is worth against the peer."""
    peer = tokens_per_second(peer_step(args, bits, context), cost.chip)
    return 1 / step_seconds(cost.target_step, cost.chip) / peer
