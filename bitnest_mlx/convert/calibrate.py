"""Calibration through the runtime's own forward: one decoder layer at a time, in chunks of
sequences, with the layer's Linears swapped for float ones that record their inputs.

The layer is the runtime's `TransformerBlock` (`models/bitnest_llama.py`), built from the same
`PackageSpec` the package will be read with, so RoPE (incl. `llama3` scaling and transformers-5
`rope_parameters`), biases, Qwen2's k-bias offset, R3, A8 and the online R4 all run as they run
at generation time. Only the weights differ:

- `hessians(i, weights)`: layer i with float weights (norms folded, rotated, R4 fused into
  down_proj, as stored before quantization); each Linear's input, after A8 (GPTQ's X), is
  accumulated into 2XᵀX/n chunk by chunk. q/k/v and gate/up read one input, so one Hessian each.
- `advance(i, planes)`: the hidden states move through layer i as the draft runs it (the hi
  planes, A8), which is what layer i + 1 will see; the KV cache is not quantized here.
- `final_hessian()`: lm_head's input, the final norm of the quantized stack, A8.

A chunk is `chunk_tokens` tokens (whole sequences), so memory holds the hidden states of the
calibration set ([tokens, hidden] float32) plus one chunk's activations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..formats.bitnest import LAYER_LINEARS, PackageSpec, Planes, a8
from ..layers.dual_plane import DualPlaneLinear
from ..layers.nested_kv import NestedKVCache
from ..layers.options import RunOptions

# Linears whose input is another's: their Hessian is that one's.
SHARED_INPUT = {
    "self_attn.k_proj": "self_attn.q_proj",
    "self_attn.v_proj": "self_attn.q_proj",
    "mlp.up_proj": "mlp.gate_proj",
}
CHUNK_TOKENS = 4096
LAST_LINEAR = "mlp.down_proj"  # its product only feeds the layer's output

_FLOAT = RunOptions(mode="target", quantize_kv=False, use_kernels=False)
# The draft's reading; dense_min_rows=1: a dense matmul on the dequantized planes (MLX's CPU
# quantized matmul has no blocked GEMM, and these are long teacher-forced passes).
_DRAFT = RunOptions(mode="draft", quantize_kv=False, use_kernels=False, dense_min_rows=1)


class HessianSum:
    """2XᵀX/n over the rows fed to `add`, accumulated in float64 from float32 products."""

    def __init__(self, k: int):
        self.sum = np.zeros((k, k), dtype=np.float64)
        self.rows = 0

    def add(self, x: mx.array) -> None:
        x2 = np.asarray(x.reshape(-1, x.shape[-1]).astype(mx.float32))
        self.sum += x2.T @ x2  # numpy's BLAS takes Aᵀ·A as a symmetric rank-k update
        self.rows += len(x2)

    def value(self) -> np.ndarray:
        return 2.0 * self.sum / max(self.rows, 1)


class FloatLinear(DualPlaneLinear):
    """A float weight in a DualPlaneLinear's place: `project` (A8, bias) treats it as a Linear
    on the pure path, and `_pure` sees the input exactly as the planes would. With
    `output=False` only the input is recorded and the product is zeros: the Hessian pass does
    not need the layer's last product (a quarter of a Llama layer's flops)."""

    def __init__(
        self,
        weight: np.ndarray,
        bias: np.ndarray | None,
        record: Callable[[mx.array], None] | None = None,
        output: bool = True,
    ):
        nn.Module.__init__(self)
        self.weight = mx.array(np.asarray(weight, np.float32))
        if bias is not None:
            self.bias = mx.array(np.asarray(bias, np.float32))
        self._record, self._output = record, output

    def _pure(self, x: mx.array, draft: bool, dense_min_rows: int = 0) -> mx.array:
        if self._record is not None:
            self._record(x)
        if not self._output:
            return mx.zeros((*x.shape[:-1], self.weight.shape[0]), dtype=x.dtype)
        return x @ self.weight.T


def _block(spec: PackageSpec, layer: int) -> nn.Module:
    from ..models import bitnest_llama

    return bitnest_llama.TransformerBlock(bitnest_llama.ModelArgs.from_spec(spec), layer)


def _set_linear(block: nn.Module, name: str, module: nn.Module) -> None:
    parent, attr = name.split(".")
    setattr(getattr(block, parent), attr, module)


class Calibration:
    """Hidden states of the calibration tokens [n_seq, seq_len] through the package's layers.

    `embed` [V, D] is the embedding as the package stores it (rotated, bf16), `had_k` the R4
    factor the package ships (None when K = 1), `norms` the smoothing vectors stored as norm
    weights ({norm weight name: d}; empty: weightless norms).
    """

    def __init__(
        self,
        spec: PackageSpec,
        embed: mx.array,
        tokens: np.ndarray,
        had_k: np.ndarray | None = None,
        norms: Mapping[str, np.ndarray] | None = None,
        chunk_tokens: int = CHUNK_TOKENS,
    ):
        assert tokens.ndim == 2, "calibration tokens are [n_seq, seq_len]"
        h = embed[mx.array(tokens)].astype(mx.float32)
        self._setup(spec, np.array(h), had_k, norms, chunk_tokens)
        del h

    def _setup(self, spec, hidden, had_k, norms, chunk_tokens) -> None:
        self.spec, self.had_k, self.norms = spec, had_k, dict(norms or {})
        self.chunk = max(1, chunk_tokens // hidden.shape[1])  # sequences per chunk
        self.h = hidden  # [n_seq, seq_len, D] float32

    @classmethod
    def resumed(
        cls,
        spec: PackageSpec,
        hidden: np.ndarray,
        had_k: np.ndarray | None = None,
        norms: Mapping[str, np.ndarray] | None = None,
        chunk_tokens: int = CHUNK_TOKENS,
    ) -> Calibration:
        """The calibration as it stood after a finished layer: `hidden` [n_seq, seq_len, D] are
        the states entering the next one (saved by a resumable conversion), the rest as above."""
        calibration = cls.__new__(cls)
        calibration._setup(spec, hidden, had_k, norms, chunk_tokens)
        return calibration

    def _chunks(self):
        for s in range(0, len(self.h), self.chunk):
            yield slice(s, s + self.chunk)

    def _fixed_parts(self, block: nn.Module, layer: int) -> None:
        """What the runtime's `sanitize` loads beside the planes: R4's hadK, norm weights."""
        if self.had_k is not None:
            block.mlp.r4.had_k = mx.array(self.had_k.astype(np.float32))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            d = self.norms.get(f"model.layers.{layer}.{norm}.weight")
            if d is not None:  # else the block's own: ones when smoothed, None when weightless
                setattr(block, norm, mx.array(d))

    def _run(self, block: nn.Module, options: RunOptions, update: bool) -> None:
        for rows in self._chunks():
            h = mx.array(self.h[rows])
            cache = NestedKVCache(self.spec.kv_group, quantized=False)
            out = block(h, "causal" if h.shape[1] > 1 else None, cache, options)
            mx.eval(out)
            if update:
                self.h[rows] = np.array(out)

    def hessians(self, layer: int, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """{Linear name (as in LAYER_LINEARS): its A8 input's Hessian [K, K] float64} of layer
        `layer` with float `weights` ({"self_attn.q_proj.weight": [N, K], biases...}); the
        hidden states are left as they were."""
        sums = {
            name: HessianSum(weights[f"{name}.weight"].shape[1])
            for name in LAYER_LINEARS
            if name not in SHARED_INPUT
        }
        block = self._float_block(
            layer, weights, {n: s.add for n, s in sums.items()}, skip=LAST_LINEAR
        )
        self._run(block, _FLOAT, update=False)
        values = {name: s.value() for name, s in sums.items()}
        # Shared inputs share one array: the quantizer factors it once per layer input.
        return {name: values[SHARED_INPUT.get(name, name)] for name in LAYER_LINEARS}

    def _float_block(
        self,
        layer: int,
        weights: Mapping[str, np.ndarray],
        records: Mapping[str, Callable[[mx.array], None]],
        skip: str | None = None,
    ) -> nn.Module:
        """Layer `layer` with float Linears; `skip` names one whose product is not computed
        (its input is still recorded)."""
        block = _block(self.spec, layer)
        self._fixed_parts(block, layer)
        for name in LAYER_LINEARS:
            linear = FloatLinear(
                weights[f"{name}.weight"],
                weights.get(f"{name}.bias"),
                records.get(name),
                output=name != skip,
            )
            _set_linear(block, name, linear)
        return block

    def advance(
        self, layer: int, planes: Mapping[str, Planes], biases: Mapping[str, np.ndarray]
    ) -> None:
        """The hidden states through layer `layer` as the draft reads it (`planes` by Linear
        name, as in LAYER_LINEARS; `biases` by "<name>.bias")."""
        block = _block(self.spec, layer)
        self._fixed_parts(block, layer)
        for name in LAYER_LINEARS:
            p = planes[name]
            tensors = {
                f"{name}.hi": mx.array(p.hi),
                f"{name}.lo": mx.array(p.lo),
                f"{name}.scales": mx.array(p.scales),
            }
            if f"{name}.bias" in biases:
                tensors[f"{name}.bias"] = mx.array(np.asarray(biases[f"{name}.bias"], np.float32))
            params = DualPlaneLinear.prepare(tensors, name, mx.float32)
            linear = getattr(getattr(block, name.split(".")[0]), name.split(".")[1])
            linear.load_weights([(k.removeprefix(name + "."), v) for k, v in params.items()])
        self._run(block, _DRAFT, update=True)

    def float_advance(
        self,
        layer: int,
        weights: Mapping[str, np.ndarray],
        quantize_activations: bool = False,
        capture: tuple[str, ...] = (),
    ) -> dict[str, np.ndarray]:
        """The hidden states through layer `layer` with float weights (A8 on or off): the
        float model's forward, for smoothing and tests. Returns the inputs of the `capture`d
        Linears (LAYER_LINEARS names), [tokens, K] float32, as they reach the Linear."""
        seen: dict[str, list[np.ndarray]] = {name: [] for name in capture}
        records = {name: (lambda x, out=seen[name]: out.append(np.array(x))) for name in capture}
        block = self._float_block(layer, weights, records)
        options = RunOptions(
            mode="target",
            quantize_activations=quantize_activations,
            quantize_kv=False,
            use_kernels=False,
        )
        self._run(block, options, update=True)
        return {
            name: np.concatenate([x.reshape(-1, x.shape[-1]) for x in xs])
            for name, xs in seen.items()
        }

    def normed(self, norm: str | None = None) -> np.ndarray:
        """The RMSNorm of the hidden states [tokens, D] (times the smoothing vector of `norm`
        when it has one): what the Linears reading that norm see before A8."""
        h = mx.array(self.h.reshape(-1, self.h.shape[-1]))
        d = self.norms.get(norm) if norm else None
        x = mx.fast.rms_norm(h, None if d is None else mx.array(d), self.spec.rms_norm_eps)
        return np.array(x)

    def final_hessian(self) -> np.ndarray:
        """lm_head's input Hessian: A8 of the final norm of the current hidden states."""
        total = HessianSum(self.h.shape[-1])
        d = self.norms.get("model.norm.weight")
        for rows in self._chunks():
            h = mx.array(self.h[rows])
            x = mx.fast.rms_norm(h, None if d is None else mx.array(d), self.spec.rms_norm_eps)
            total.add(a8(x))
        return total.value()
