"""Launchers, process groups, collectives, the spawner and signals: one
module per job.

- ``launch.launcher``: who started this process (``detect() ->
  LaunchInfo``); the only reader of the launchers' variables (RANK,
  WORLD_SIZE, LOCAL_RANK, SLURM_*, ...). Slurm notations:
  ``launch.hostlist``.
- ``launch.comm``: ``setup(cfg) -> DistContext`` / ``teardown()`` /
  ``session(cfg)``: device, backend, threads, cuDNN flags, the process
  group; and the small collectives over it, which also work without a
  process group. ``launch.store``: the group's store (restart-private
  keys, stop announcements between ranks).
- ``launch.spawn``: ``spawn(worker, nprocs)``, the ``--nproc-per-node``
  spawner.
- ``launch.signals``: Ctrl-C/SIGTERM handling, preemption signals,
  ``Preempted``, Slurm requeue.

Import the submodule you need (``from distribuuuu.launch import comm``);
this package module imports nothing, so that importing one job does not
load the others.
"""
