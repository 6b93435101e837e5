#!/bin/bash
# One process's NUM_THREADS 0 (its cores, torch's default) against NUM_THREADS 1, side by side, on an
# idle machine and beside two CPU-bound processes (docs/performance.md, section 4; issue #47):
#     benchmarks/threads_alone.sh [WORKDIR]      # about 3 minutes on 2 cores
# Each line: the machine's state, the threads asked and decided, the mean img/s of epochs 2-3 of the
# 8x8 digits folder (resnet_tiny at 32 px, no loader workers), the load average after the run.
set -e
here=$(cd "$(dirname "$0")/.." && pwd)
D=${DISTRIBUUUU:-$here/.venv/bin/distribuuuu}
work=${1:-$(mktemp -d)}
cd "$work"
[ -d digits_folder ] || "$D" data export digits digits_folder > /dev/null
measure() {  # $1 the machine's state, $2 NUM_THREADS
  rm -rf r
  "$D" train TRAIN.DATASET digits_folder OPTIM.MAX_EPOCH 3 TRAIN.WORKERS 0 NUM_THREADS "$2" RNG_SEED 0 \
    OUT_DIR r > log.txt 2>&1
  decided=$(grep -o "setup: NUM_THREADS [0-9]*" log.txt | head -1 || true)
  ips=$(python3 -c "import json; t=[json.loads(l)['img_per_s'] for l in open('r/metrics.jsonl') if '\"train\"' in l][1:]; print(round(sum(t)/len(t)))")
  echo "$1 | asked $2 | ${decided:-as asked} | epochs 2-3 img/s $ips | load $(cut -d' ' -f1 /proc/loadavg)"
}
for state in idle busy; do
  if [ $state = busy ]; then
    python3 -c "while True: pass" & b1=$!
    python3 -c "while True: pass" & b2=$!
    trap 'kill $b1 $b2 2>/dev/null' EXIT
    sleep 20
  fi
  for round in 1 2; do measure $state 0; measure $state 1; done
done
