#!/usr/bin/env bash
# DeepSeek-V4 at real per-layer size: the measurements of docs/deepseek-v4.md ("Memory and decode
# cost at real size"). Not CI: the 2-layer bundle is ~5.8 GB on disk and a resident load holds
# about as much; run it on a machine with >= 9 GB free. Usage: examples/dsv4_real_size.sh [DIR]
set -euo pipefail
OUT=${1:-/work/runs/dsv4-2layer}
PY=${PYTHON:-python}

# 1. Flash layers 3-4 (ratios 128 and 4, gate/up 2-bit, down 4-bit), random weights, streamed.
$PY -m bitnest_mlx.dsv4 make-bundle --layers 2 --out "$OUT"

# 2. Resident: peak RSS of load + one decode step vs the tensor bytes, decode tok/s, weight bytes
#    per token, the per-part table, and the routed experts beside mlx-lm's SwitchGLU.
$PY -m bitnest_mlx.bench --model "$OUT" --prompt-tokens 4 --gen-tokens 4 --parts --json \
  > "$OUT.resident.json"

# 3. A budget of 25 % of the routed-expert code bytes: peak RSS vs non-expert bytes + budget,
#    hit rate and disk bytes per token.
BUDGET=$($PY -c "from bitnest_mlx.measurement.dsv4_bench import bundle_bytes as b; \
print(0.25 * b('$OUT')['expert_code_bytes'] / 1e9)")
$PY -m bitnest_mlx.bench --model "$OUT" --prompt-tokens 4 --gen-tokens 16 --no-mlx-lm \
  --max-expert-memory "$BUDGET" --json > "$OUT.budget.json"

$PY - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for run in ("resident", "budget"):
    r = json.load(open(f"{out}.{run}.json"))
    print(run, json.dumps({k: r[k] for k in ("memory", "decode", "decode_bytes_per_token",
                                              "parts", "experts_vs_mlx_lm") if k in r}, indent=1))
PY

# 4. Two pipeline ranks on 127.0.0.1 (ring backend): each loads its half of the layers; greedy
#    tokens and last logits against one process, resident weights and peak RSS per rank.
mkdir -p "$OUT.pipeline"
mlx.launch --backend ring -n 2 -- "$PY" tests/pipeline_worker.py "$OUT" "$OUT.pipeline"
$PY - "$OUT" <<'PY'
import json, sys
import numpy as np
sys.path.insert(0, "tests")
from pipeline_worker import greedy, parameter_bytes
from bitnest_mlx import load
from bitnest_mlx.measurement.dsv4_bench import peak_rss_bytes
out = sys.argv[1]
model, _ = load(out)
tokens, logits = greedy(model)
whole = parameter_bytes(model)
print("single process:", tokens, f"parameter GB {whole / 1e9:.3f}, peak RSS GB {peak_rss_bytes() / 1e9:.3f}")
for r in range(2):
    rep = json.load(open(f"{out}.pipeline/rank{r}.json"))
    diff = float(np.abs(np.load(f"{out}.pipeline/rank{r}.npy") - logits).max())
    print(f"rank {r}: layers {rep['layers']} tokens {rep['tokens']} same={rep['tokens'] == tokens} "
          f"max|dlogits| {diff:.2e} parameter GB {rep['parameter_bytes'] / 1e9:.3f} "
          f"({rep['parameter_bytes'] / whole:.2f} of one process) peak RSS GB {rep['peak_rss_bytes'] / 1e9:.3f}")
PY
