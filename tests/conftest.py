"""Test-session settings shared by every test file.

`make test` runs the files on two pytest-xdist workers (`-n 2 --dist loadgroup`). Each file is one
group, so a file's tests run in order in one worker and its module fixtures are built once; the tests
that submit jobs to the one-host Slurm cluster form one group of their own, because the cluster has
two CPUs and two jobs at once would wait for each other.
"""

from __future__ import annotations

import pytest

# Tests that run srun/sbatch on the local Slurm cluster (tests/slurm_utils.py).
_SLURM_MARKERS = ("slurm", "srun", "sbatch")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::")[0]
        uses_slurm = module.endswith("test_slurm.py") or any(m in item.name for m in _SLURM_MARKERS)
        item.add_marker(pytest.mark.xdist_group("slurm" if uses_slurm else module))
