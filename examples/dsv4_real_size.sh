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
BUDGET=$($PY -c "from bitnest_mlx.dsv4_bench import bundle_bytes as b; \
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
