"""The cost of one step-boundary vote (launch.comm.max_over_ranks) with 2, 4, 8 ... gloo processes.

    python benchmarks/vote_cost.py [--procs 2,4,8] [--votes 2000]

Every rank of a run votes at step boundaries on "a stop signal arrived" and "a time-based
checkpoint is due" (engine._maybe_checkpoint_or_stop): one all-reduce of two ints over gloo (the
main group on CPU, the gloo side group under nccl). This starts N processes on this host with the
built-in spawner, times `votes` back-to-back votes after a warm-up, and prints a table: the median
and 90th percentile of one vote, and what that costs per step with DIST.VOTE_PERIOD_STEPS 1 and 10.
Between hosts the latency adds network round trips; on one host with fewer cores than processes
the numbers also include the OS scheduler's time slices (the table says how many cores there are).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distribuuuu import config
from distribuuuu.launch import comm, spawn


def _worker(votes: int, out_path: str) -> None:
    """One rank: join the group, warm up, time each vote, rank 0 writes the times."""
    cfg = config.get_defaults()
    cfg.DEVICE, cfg.NUM_THREADS = "cpu", 1
    with comm.session(cfg) as ctx:
        for _ in range(50):
            comm.max_over_ranks([False, False])
        times = []
        for _ in range(votes):
            start = time.perf_counter()
            comm.max_over_ranks([False, False])
            times.append(time.perf_counter() - start)
        if ctx.is_main:
            with open(out_path, "w") as f:
                json.dump(times, f)


def measure(procs: int, votes: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        status = spawn.spawn(_worker, procs, (votes, out))
        if status != 0:
            raise SystemExit(f"the run with {procs} processes exited with status {status}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", default="2,4,8", help="comma-separated process counts")
    parser.add_argument("--votes", type=int, default=2000, help="timed votes per process count")
    args = parser.parse_args()
    rows = []
    for n in (int(p) for p in args.procs.split(",")):
        times = sorted(measure(n, args.votes))
        rows.append((n, statistics.median(times), times[int(0.9 * (len(times) - 1))]))
    print(f"\nvote cost: launch.comm.max_over_ranks over gloo, one host, {os.cpu_count()} cores, {args.votes} votes")
    print(f"{'processes':>9} {'median us':>10} {'p90 us':>8} {'per step, every step':>21} {'every 10 steps':>15}")
    for n, med, p90 in rows:
        print(f"{n:>9} {1e6 * med:>10.0f} {1e6 * p90:>8.0f} {1e6 * med:>18.0f} us {1e6 * med / 10:>12.0f} us")


if __name__ == "__main__":
    main()
