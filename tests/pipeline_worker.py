"""One rank of tests/test_pipeline.py: load a pipeline stage, decode greedily, write the results.

Run as `python tests/pipeline_worker.py BUNDLE OUT` with the ring backend's environment
(MLX_RANK, MLX_HOSTFILE), or under `mlx.launch` (examples/dsv4_real_size.sh). Writes
OUT/rank<r>.json (tokens, parameter bytes, active memory after loading, peak RSS) and
OUT/rank<r>.npy (the last step's logits). `greedy` is also the single-process
reference the test runs in its own process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

PROMPT = [0, 2, *range(40, 77), 3]  # 40 tokens: past the indexer's top-k and a ratio-4 block
NEW_TOKENS = 6
PREFILL_CHUNK = 16


def greedy(model, prompt: list[int] = PROMPT, n: int = NEW_TOKENS) -> tuple[list[int], np.ndarray]:
    """Chunked prefill that evaluates only the caches (as mlx-lm's prefill does), then n greedy
    steps; returns the tokens and the last step's logits [V]."""
    cache = model.make_cache()
    for i in range(0, len(prompt) - 1, PREFILL_CHUNK):
        model(mx.array(prompt[i : min(i + PREFILL_CHUNK, len(prompt) - 1)])[None], cache)
        mx.eval([c.state for c in cache])
    y, tokens = prompt[-1], []
    for _ in range(n):
        logits = model(mx.array([[y]]), cache)[0, -1]
        y = int(logits.argmax().item())
        tokens.append(y)
    return tokens, np.array(logits)


def parameter_bytes(model) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def main(bundle: str, out: str) -> None:
    from bitnest_mlx import load
    from bitnest_mlx.measurement.dsv4_bench import peak_rss_bytes

    group = mx.distributed.init(strict=True, backend="ring")
    mx.reset_peak_memory()
    model, _ = load(bundle, pipeline=group)
    loaded = mx.get_active_memory()
    tokens, logits = greedy(model)
    r = group.rank()
    np.save(Path(out) / f"rank{r}.npy", logits)
    stage = model.stage
    report = {
        "rank": r,
        "size": group.size(),
        "layers": [stage.start, stage.end],
        "tokens": tokens,
        "parameter_bytes": parameter_bytes(model),
        "active_bytes_after_load": loaded,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    (Path(out) / f"rank{r}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:3])
