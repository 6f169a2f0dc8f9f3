#!/usr/bin/env bash
# Conversion at real size without real weights (docs/convert.md, "Real-size checkpoint"): a
# Llama-3.2-3B-shaped checkpoint of seeded random weights (~6.4 GB of bf16 safetensors, made once,
# ~0.6 GB RSS), then the converter under /usr/bin/time -v: its peak RSS and wall time, then the
# package's bytes per token (bench --speed-model).
# Not CI: needs ~13 GB of disk and the converter's memory.
#
# Usage: examples/convert_real_size.sh [DIR] [converter flags...]
#   DIR  checkpoint directory, made unless it holds one (default /work/runs/llama3b-synth)
#   the package goes to $OUT (default DIR-package); e.g. --calib-tokens 8192 --force
#   TINY=1: the same family at small dimensions (a smoke test in seconds)
set -euo pipefail
DIR=/work/runs/llama3b-synth
if [[ $# -gt 0 && $1 != -* ]]; then
  DIR=$1
  shift
fi
OUT=${OUT:-$DIR-package}
PY=${PYTHON:-python}

if [[ ! -f $DIR/model.safetensors.index.json ]]; then
  $PY -m bitnest_mlx.convert make-checkpoint --like llama-3.2-3b ${TINY:+--tiny} --out "$DIR"
fi

TIMES=$(mktemp)
trap 'rm -f "$TIMES"' EXIT
status=0
/usr/bin/time -v -o "$TIMES" $PY -m bitnest_mlx.convert --hf-path "$DIR" --out "$OUT" "$@" ||
  status=$?
awk -F': ' '/Maximum resident set size/ { printf "peak RSS %.2f GB\n", $2 / 1048576 }
            /Elapsed \(wall clock\)/ { print "wall time " $2 }' "$TIMES"
# What the package reads per token and the tok/s that implies on Apple chips (docs/speculative.md;
# ACCEPTANCE="full=0.81 65536=0.80", measured on a real model, adds the speculative column).
if [[ $status -eq 0 ]]; then
  $PY -m bitnest_mlx.bench --speed-model --model "$OUT" ${ACCEPTANCE:+--acceptance $ACCEPTANCE}
fi
exit $status
