"""How a DeepSeek-V4 bundle's tensors become the model's parameters (mlx-lm's `sanitize` step).

`Model` (models/deepseek_v4.py) takes these methods: `quantize_as(bundle)` swaps the float
skeleton's Linears for MLX affine layers and its routed experts for MXTQ stacks where the bundle
stores them, and `sanitize(tensors)` returns the bundle's tensors as the parameters then are.
The loader only reads the bundle, calls the two and loads strictly, as mlx-lm's `load_model`
calls a model's `sanitize`; it knows no layer of the model.

Kept apart from models/deepseek_v4.py so that file stays the architecture's math.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from bitnest_mlx.formats.dsv4_bundle import Bundle, BundleError, Slot, layer_proj
from bitnest_mlx.layers import expert_store
from bitnest_mlx.layers.expert_store import ExpertStore
from bitnest_mlx.layers.mxtq_linear import MXTQSwitchLinear

# Float parameters only float32 math reads besides the hyper-connections' `hc_*` (the router,
# the compressors' position bias and norm): loaded at the model dtype's precision but held as
# float32.
FLOAT32_MATH = ("ffn.gate.weight", "ffn.gate.bias", "compressor.ape", "compressor.norm.weight")


def float32_math(key: str) -> bool:
    return key.rpartition(".")[2].startswith("hc_") or key.endswith(FLOAT32_MATH)


class BundleWeights:
    """The bundle -> parameters mapping of the DeepSeek-V4 `Model` (a mixin: it reads the
    model's `layers`, `stage` and parameters)."""

    def check_declared(self, slots: dict[str, Slot]) -> None:
        """The skeleton holds exactly the schedule's tensors at their shapes (a Linear's,
        Embedding's or expert stack's slot is its `.weight`): a module that reads no slot, or a
        slot no module reads, fails here at construction, not at the first strict load."""
        have = {k: tuple(a.shape) for k, a in tree_flatten(self.parameters())}
        stacked = ("linear", "embedding", "experts")
        want = {(f"{n}.weight" if s.kind in stacked else n): s.shape for n, s in slots.items()}
        if have != want:
            wrong = sorted(set(have.items()) ^ set(want.items()))
            raise ValueError(f"the model and the bundle schedule differ at {wrong[:4]}")

    def holds(self, key: str) -> bool:
        """Whether this model (or pipeline stage) runs the module of bundle key `key`: a stage
        keeps its own layers, and the embedding only if it runs layer 0."""
        if key == "embed" or key.startswith("embed."):
            return self.stage.first
        if key.startswith("layers."):
            return self.stage.start <= int(key.split(".")[1]) < self.stage.end
        return True

    def quantize_as(self, bundle: Bundle, max_expert_memory: float | None = None) -> None:
        """The layer types `bundle` stores, in place of the float skeleton's: MLX affine Linears
        and Embedding at each slot's (bits, group), MXTQ expert stacks at each slot's bits.

        max_expert_memory: GB (1e9 bytes) of routed-expert codes to keep resident; the codes stay
        in the bundle's files and the most recently used experts are cached
        (layers/expert_store.py, `model.expert_store`). None: every expert resident."""
        for bits, group in set(bundle.affine.values()):
            names = {n for n, bg in bundle.affine.items() if bg == (bits, group)}
            nn.quantize(
                self,
                group_size=group,
                bits=bits,
                class_predicate=lambda path, m, names=names: (
                    path in names and isinstance(m, (nn.Linear, nn.Embedding))
                ),
            )
        store = None if max_expert_memory is None else ExpertStore(int(max_expert_memory * 1e9))
        ranges = expert_store.tensor_ranges(bundle.path) if store is not None else {}
        for name, fmt in bundle.formats.items():
            if not isinstance(fmt, int) or not self.holds(name):
                continue  # float or affine, or a layer of another pipeline stage
            layer, proj = layer_proj(name)
            switch = self.layers[int(layer)].ffn.switch_mlp
            # The float skeleton's SwitchLinear says the stack's shape: [E, out, in].
            e, out_f, in_f = getattr(switch, proj).weight.shape
            experts = MXTQSwitchLinear(in_f, out_f, e, fmt, seed=bundle.seed)
            if store is not None:
                experts.use_store(store, expert_store.expert_source(ranges, name, e))
            setattr(switch, proj, experts)
        self.expert_store = store

    def sanitize(self, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
        """The bundle's tensors (keyed by parameter name: formats/dsv4_bundle.read) as this
        model's parameters, after `quantize_as`.

        Each weight is held once, as stored: codes, scales, norms keep their bundle dtype (MLX's
        quantized matmul takes float16 scales with float32 input, bit-identically). Only the
        embedding's scales are widened to the model dtype, because a QuantizedEmbedding returns
        its scales' dtype. Tensors of layers another pipeline stage runs are dropped unread, and
        so are the codes of experts read through the expert store."""
        params = dict(tree_flatten(self.parameters()))
        out = {}
        for key, a in tensors.items():
            if not self.holds(key) or self._on_disk(key):
                continue  # never evaluated: their bytes are never read into memory here
            target = params.get(key)
            if target is None:
                raise BundleError(f"{key}: no such model parameter")
            keep = key.endswith((".scales", ".biases")) and not key.startswith("embed.")
            out[key] = a.astype(target.dtype) if a.dtype != target.dtype and not keep else a
            if float32_math(key) and out[key].dtype != mx.float32:
                # The model dtype's values, held in float32: the same numbers the per-call
                # widening gave, without a conversion kernel a call.
                out[key] = out[key].astype(mx.float32)
        return out

    def _on_disk(self, key: str) -> bool:
        """`key` is the codes of an expert stack read through the store (`use_store` removed
        the parameter)."""
        if not key.endswith(".tq_packed") or ".ffn.switch_mlp." not in key:
            return False
        layer, proj = layer_proj(key.removesuffix(".tq_packed"))
        experts = getattr(self.layers[int(layer)].ffn.switch_mlp, proj)
        return isinstance(experts, MXTQSwitchLinear) and "tq_packed" not in experts


__all__ = ["BundleWeights"]
