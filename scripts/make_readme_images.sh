#!/usr/bin/env bash
# Regenerate the tour's pictures (docs/tour.md: docs/images/*.png) with the project's own commands:
#   1. the demo run (config/mnist5k_demo.yaml, NPROC processes)     -> runs/readme/mnist5k_demo
#   2. distribuuuu plot on it                                      -> docs/images/learning_curves.png
#   3. distribuuuu bench --scaling on the same config, 2 epochs    -> docs/images/scaling.png
# Usage: scripts/make_readme_images.sh            (SCALING=1,2,4 NPROC=4 to change the counts)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUNS=${RUNS:-runs/readme}
NPROC=${NPROC:-2}
SCALING=${SCALING:-1,2}

rm -rf "$RUNS"
"$PY" -m distribuuuu train --cfg config/mnist5k_demo.yaml --nproc-per-node "$NPROC" OUT_DIR "$RUNS/mnist5k_demo"
"$PY" -m distribuuuu plot "$RUNS/mnist5k_demo" --out "$RUNS/plots"
# Two epochs per count: the second one (workers and caches warm) is the one timed.
# NUM_THREADS 1: on a CPU each process owns one core, as it would own one GPU (BENCH_THREADS=0: share all).
"$PY" -m distribuuuu bench --cfg config/mnist5k_demo.yaml --scaling "$SCALING" --epochs 2 --out "$RUNS/scaling" \
    NUM_THREADS "${BENCH_THREADS:-1}"
mkdir -p docs/images
cp "$RUNS/plots/learning_curves.png" docs/images/learning_curves.png
cp "$RUNS/scaling/scaling.png" docs/images/scaling.png
ls -l docs/images/learning_curves.png docs/images/scaling.png
