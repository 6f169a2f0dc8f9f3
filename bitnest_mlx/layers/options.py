"""How one forward pass of a bitnest model runs: which planes, which quantizations, which path."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("draft", "target")


@dataclass(frozen=True)
class RunOptions:
    """Passed down a bitnest model's forward (and fixed in a cache when it is created).

    mode: "draft" reads the hi planes (W4) and KV4; "target" reads both (W8) and KV8.
    quantize_activations / quantize_kv: A8 and the nested KV quantization; off only for parity
    checks against float models (quantize_kv is fixed per cache, at `make_cache`).
    dense_min_rows: inputs with at least this many rows use a dense matmul on the dequantized
    planes (0 = never). MLX's CPU quantized matmul has no blocked GEMM, so long teacher-forced
    passes (perplexity) are much faster dense; the quantized matmul stays the default because it
    gives bit-identical rows whatever the batch, which exact cache rollback relies on.
    use_kernels: allow the Metal kernels (they still run only on Metal, after their self-test).
    """

    mode: str = "target"
    quantize_activations: bool = True
    quantize_kv: bool = True
    dense_min_rows: int = 0
    use_kernels: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def draft(self) -> bool:
        return self.mode == "draft"
