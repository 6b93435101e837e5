"""distribuuuu.launch: launcher detection, Slurm notations, setup/teardown, the spawner.

The spawn tests start real processes with a real gloo process group (2 processes, CPU).
"""

from __future__ import annotations

import ast
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from distribuuuu.errors import UserError
from distribuuuu.launch import comm, launcher, spawn
from tests import _dist_workers as workers
from tests.conftest import TINY, free_port, make_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What torchrun --nnodes 2 --nproc-per-node 2 gives worker 3 (node 1, local rank 1).
TORCHRUN_ENV = {
    "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
    "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1",
}

# What `srun -N 2 --ntasks-per-node 2 python train_net.py` gives task 3, inside an sbatch job.
SLURM_SRUN_ENV = {
    "SLURM_JOB_ID": "123456", "SLURM_JOBID": "123456", "SLURM_JOB_NODELIST": "node[01-04,07]",
    "SLURM_NODELIST": "node[01-04,07]", "SLURM_NTASKS": "10", "SLURM_TASKS_PER_NODE": "2(x5)",
    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
}

# The batch step of the same job: `python train_net.py` written straight into the sbatch script.
SLURM_BATCH_ENV = {
    "SLURM_JOB_ID": "123456", "SLURM_JOBID": "123456", "SLURM_JOB_NODELIST": "node[01-04,07]",
    "SLURM_NODELIST": "node[01-04,07]", "SLURM_NTASKS": "10", "SLURM_TASKS_PER_NODE": "2(x5)",
    "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_CPUS_ON_NODE": "16",
}

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "DISTRIBUUUU_LAUNCHER", "TORCHELASTIC_USE_AGENT_STORE",
               "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS")


@pytest.fixture
def plain_env(monkeypatch):
    """The test process as a plain `python` run, whatever the shell around pytest set."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["pytest"])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child we did not reap would still answer as a zombie; spawn() joins its children.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def read_pids(out_dir, n: int) -> list[int]:
    return [int((out_dir / f"pid{r}").read_text()) for r in range(n) if (out_dir / f"pid{r}").exists()]


# ---------------------------------------------------------------------------------------------
# detect()
# ---------------------------------------------------------------------------------------------


def test_detect_plain():
    assert launcher.detect({}, ["train_net.py"]) == launcher.LaunchInfo("plain", 0, 0, 1, 1, 0, "127.0.0.1", 0)


def test_detect_torchrun():
    info = launcher.detect(TORCHRUN_ENV, ["train_net.py", "--cfg", "x.yaml"])
    assert info == launcher.LaunchInfo("torchrun", 3, 1, 4, 2, 1, "10.0.0.1", 29500)


@pytest.mark.parametrize("argv", [
    ["train_net.py", "--local-rank=1", "--cfg", "x.yaml"],
    ["train_net.py", "--local_rank", "1", "--cfg", "x.yaml"],
    ["train_net.py", "--local_rank=1"],
])
def test_detect_legacy_launch(argv):
    # torch.distributed.launch without --use-env: LOCAL_RANK only on the command line.
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_RANK"}
    info = launcher.detect(env, argv)
    assert (info.launcher, info.rank, info.local_rank, info.world_size) == ("launch", 3, 1, 4)
    # With --use-env-style LOCAL_RANK as well it is still the legacy launcher.
    assert launcher.detect(TORCHRUN_ENV, argv).launcher == "launch"


def test_detect_legacy_launch_disagreeing_local_rank():
    with pytest.raises(UserError, match="LOCAL_RANK"):
        launcher.detect(TORCHRUN_ENV, ["train_net.py", "--local-rank=0"])


def test_local_rank_flag_without_rank_env_is_ignored():
    assert launcher.detect({}, ["train_net.py", "--local-rank=0"]).launcher == "plain"


def test_strip_local_rank_args():
    argv = ["--local-rank=1", "--cfg", "a.yaml", "--local_rank", "1", "OUT_DIR", "x"]
    assert launcher.strip_local_rank_args(argv) == ["--cfg", "a.yaml", "OUT_DIR", "x"]


def test_detect_spawn():
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4242", "DISTRIBUUUU_LAUNCHER": "spawn"}
    assert launcher.detect(env, ["x"]) == launcher.LaunchInfo("spawn", 1, 1, 2, 2, 0, "127.0.0.1", 4242)


def test_detect_slurm_srun_step():
    info = launcher.detect(SLURM_SRUN_ENV, ["train_net.py"])
    # The master is the first host of the STEP's nodes; the port comes from the job id.
    assert info == launcher.LaunchInfo("slurm", 3, 1, 4, 2, 1, "node01", 10000 + 123456 % 20000)


def test_detect_slurm_other_hostlist_and_fallbacks():
    env = dict(SLURM_SRUN_ENV, SLURM_STEP_NODELIST="a1,b[2-3]")
    assert launcher.detect(env, []).master_addr == "a1"
    # Without the step's variables the job-wide ones are used.
    env = {k: v for k, v in SLURM_SRUN_ENV.items() if k not in ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")}
    env.update(SLURM_JOB_NODELIST="a1,b[2-3]", SLURM_TASKS_PER_NODE="2(x2)")
    info = launcher.detect(env, [])
    assert (info.master_addr, info.local_world_size) == ("a1", 2)


def test_detect_slurm_master_overrides():
    env = dict(SLURM_SRUN_ENV, MASTER_ADDR="10.1.2.3", MASTER_PORT="23456")
    info = launcher.detect(env, [])
    assert (info.launcher, info.master_addr, info.master_port) == ("slurm", "10.1.2.3", 23456)


def test_detect_slurm_uneven_tasks_per_node():
    env = dict(SLURM_SRUN_ENV, SLURM_STEP_NUM_TASKS="5", SLURM_STEP_TASKS_PER_NODE="3,2",
               SLURM_PROCID="4", SLURM_LOCALID="1", SLURM_NODEID="1")
    assert launcher.detect(env, []).local_world_size == 2


def test_torchrun_inside_slurm_is_torchrun():
    env = {**SLURM_SRUN_ENV, **TORCHRUN_ENV}
    assert launcher.detect(env, ["train_net.py"]) == launcher.detect(TORCHRUN_ENV, ["train_net.py"])
    env = {**SLURM_BATCH_ENV, **TORCHRUN_ENV}
    assert launcher.detect(env, ["train_net.py"]).launcher == "torchrun"


@pytest.mark.parametrize("extra", [
    {},  # the batch step: no SLURM_STEP_* at all
    {"SLURM_STEP_ID": "4294967291", "SLURM_STEPID": "4294967291"},  # batch step id, new Slurm
    {"SLURM_STEP_ID": "batch"},
    {"SLURM_STEP_ID": "0"},  # a step id but no step task count: not started by srun
])
def test_sbatch_without_srun_is_plain(extra):
    info = launcher.detect({**SLURM_BATCH_ENV, **extra}, ["train_net.py"])
    assert (info.launcher, info.rank, info.world_size) == ("plain", 0, 1)


@pytest.mark.parametrize("env, name", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=4"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({**TORCHRUN_ENV, "LOCAL_RANK": "2"}, "LOCAL_RANK=2"),
    ({**TORCHRUN_ENV, "LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8"),
    ({**TORCHRUN_ENV, "MASTER_PORT": "http"}, "MASTER_PORT"),
    ({**TORCHRUN_ENV, "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    ({k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_ADDR"}, "MASTER_ADDR"),
    ({k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_RANK"}, "LOCAL_RANK"),
    ({**SLURM_SRUN_ENV, "SLURM_PROCID": "three"}, "SLURM_PROCID"),
    ({**SLURM_SRUN_ENV, "SLURM_PROCID": "4"}, "SLURM_PROCID=4"),
    ({**SLURM_SRUN_ENV, "SLURM_NODEID": "2"}, "SLURM_NODEID=2"),
    ({**SLURM_SRUN_ENV, "SLURM_STEP_TASKS_PER_NODE": "2(y2)"}, "2\\(y2\\)"),
    ({**SLURM_SRUN_ENV, "SLURM_STEP_NODELIST": "node[01-"}, "SLURM_STEP_NODELIST"),
    ({k: v for k, v in SLURM_SRUN_ENV.items() if k not in ("SLURM_JOB_ID", "SLURM_JOBID")}, "MASTER_PORT"),
])
def test_detect_bad_values(env, name, monkeypatch):
    # No scontrol fallback: where Slurm is installed it "expands" even a malformed hostlist.
    monkeypatch.setenv("PATH", "")
    with pytest.raises(UserError, match=name):
        launcher.detect(env, ["train_net.py"])


# ---------------------------------------------------------------------------------------------
# Slurm notations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, hosts", [
    ("node[01-04,07],gpu2", ["node01", "node02", "node03", "node04", "node07", "gpu2"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("single-host", ["single-host"]),
    ("host.example.org", ["host.example.org"]),
    ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
    ("gpu[1,3]-ib", ["gpu1-ib", "gpu3-ib"]),
    (" a[1-2] ", ["a1", "a2"]),
])
def test_parse_hostlist(spec, hosts):
    assert launcher.parse_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["", "a,,b", "n[1-", "n]1[", "n[[1]]", "n[3-1]", "n[a-b]", "n[]"])
def test_parse_hostlist_errors(spec):
    with pytest.raises(UserError, match="hostlist"):
        launcher.parse_hostlist(spec)


@pytest.mark.parametrize("spec, counts", [
    ("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("2(x2)", [2, 2]), ("1,2,3", [1, 2, 3]), ("8(x1)", [8]),
])
def test_parse_tasks_per_node(spec, counts):
    assert launcher.parse_tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["", "x", "2(3)", "2(x)", "2,,1", "-1"])
def test_parse_tasks_per_node_errors(spec):
    with pytest.raises(UserError, match="tasks-per-node"):
        launcher.parse_tasks_per_node(spec)


# ---------------------------------------------------------------------------------------------
# setup / teardown / helpers in one process
# ---------------------------------------------------------------------------------------------


def test_setup_plain_single_process(plain_env, capsys):
    threads = torch.get_num_threads()
    try:
        with comm.session(make_cfg(base=TINY)) as ctx:
            assert ctx.launcher == "plain"
            assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.is_main, ctx.distributed) == (0, 0, 1, True, False)
            assert ctx.device == torch.device("cpu") and ctx.backend == "gloo"
            assert not dist.is_initialized()  # no process group for one process
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out.splitlines()
    assert out == ["[dist] rank 0/1 | local rank 0/1 | node 0 | master - | device cpu | backend - | launcher plain"]


def test_helpers_without_process_group():
    assert not dist.is_initialized()
    assert comm.get_world_size() == 1
    comm.barrier()
    t = torch.tensor([2.0])
    assert comm.all_reduce_sum(t) is t and t.item() == 2.0
    assert comm.broadcast_object({"a": 1}) == {"a": 1}
    comm.teardown()
    comm.teardown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_setup_cuda_without_gpu_is_user_error(plain_env):
    with pytest.raises(UserError, match="no CUDA GPU"):
        comm.setup(make_cfg("DEVICE", "cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_setup_nccl_on_cpu_is_user_error(plain_env):
    with pytest.raises(UserError, match="nccl"):
        comm.setup(make_cfg("DIST.BACKEND", "nccl"))


def test_free_port_is_bindable():
    port = free_port()  # the tests' helper (tests/conftest.py)
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))
        s.listen(1)


# ---------------------------------------------------------------------------------------------
# spawn(): real processes, real gloo
# ---------------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_spawn_all_reduce_and_session_teardown(plain_env, tmp_path, capfd):
    assert spawn.spawn(workers.all_reduce_worker, 2, (str(tmp_path),)) == 0
    for rank in range(2):
        facts = (tmp_path / f"rank{rank}.txt").read_text().split()
        # sum | launcher | rank | world | local rank | get_rank | get_world_size | is_main | broadcast | backend
        assert facts == ["3.0", "spawn", str(rank), "2", str(rank), str(rank), "2", str(int(rank == 0)), "0", "gloo"]
    out = capfd.readouterr().out
    assert "[spawn] 2 processes, master 127.0.0.1:" in out
    for rank in range(2):
        assert f"[dist] rank {rank}/2 | local rank {rank}/2 | node 0 | master 127.0.0.1:" in out
    # Then each child ran session() twice with a body that raised ValueError, then
    # KeyboardInterrupt: the process group was gone after each.
    assert out.count("| device cpu | backend gloo | launcher spawn") == 2 + 4
    for rank in range(2):
        assert (tmp_path / f"session{rank}.txt").read_text() == "ValueError:0 KeyboardInterrupt:0"


@pytest.mark.parametrize("worker, status", [
    (workers.exit_on_rank1_worker, 2),
    (workers.raise_on_rank1_worker, 1),
])
@pytest.mark.e2e
def test_spawn_failure_stops_everyone(plain_env, tmp_path, capfd, worker, status):
    start = time.monotonic()
    assert spawn.spawn(worker, 2, (str(tmp_path),)) == status
    assert time.monotonic() - start < 30  # rank 0 would sleep 120 s: it was stopped
    pids = read_pids(tmp_path, 2)
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)
    err = capfd.readouterr().err
    assert f"process 1 (pid {pids[1]}) exited with status {status}" in err
    if status == 1:
        assert "ValueError: boom from rank 1" in err  # the child's own traceback


@pytest.mark.e2e
def test_spawn_user_error_in_child(plain_env, tmp_path, capfd):
    # One process is enough to see the status: a UserError that escapes the worker is status 2.
    assert spawn.spawn(workers.user_error_worker, 1, (str(tmp_path),)) == 2
    assert "error: bad thing in rank 0" in capfd.readouterr().err


@pytest.mark.e2e
def test_spawn_master_port_in_use(plain_env, tmp_path, capfd):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        s.listen(8)
        port = s.getsockname()[1]
        # The port asked for is taken: the spawner says so, picks a free one, and the run works.
        assert spawn.spawn(workers.setup_worker, 2, (str(tmp_path),), port=port) == 0
    assert f"[spawn] master port {port} is in use; using free port " in capfd.readouterr().out


def test_spawn_refuses_inside_another_launcher(monkeypatch):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match="already started by torchrun"):
        spawn.spawn(workers.sleep_worker, 2, ("unused",))


def test_spawn_rejects_zero_processes():
    with pytest.raises(UserError, match="nproc-per-node"):
        spawn.spawn(workers.sleep_worker, 0)


@pytest.mark.parametrize("whole_group", [True, False], ids=["ctrl-c", "sigint-parent-only"])
@pytest.mark.e2e
def test_spawn_ctrl_c(tmp_path, whole_group):
    """Ctrl-C reaches the parent (and, from a terminal, the children too): status 130, no child left."""
    script = textwrap.dedent(f"""
        import sys
        from distribuuuu.launch import spawn
        from tests import _dist_workers as w
        sys.exit(spawn.spawn(w.sleep_worker, 2, ({str(tmp_path)!r},)))
    """)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 30
        while len(read_pids(tmp_path, 2)) < 2 and time.monotonic() < end:
            time.sleep(0.1)
        pids = read_pids(tmp_path, 2)
        assert len(pids) == 2, proc.communicate(timeout=30)
        if whole_group:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal does
        else:
            os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err.decode()
    assert not any(pid_alive(p) for p in pids)


@pytest.mark.e2e
def test_under_real_torchrun(tmp_path):
    """torchrun's own variables (and its agent store) drive setup(); the sum crosses processes."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        import torch
        from distribuuuu.config import load_config
        from distribuuuu.launch import comm
        with comm.session(load_config(None, ["DEVICE", "cpu"])) as ctx:
            t = comm.all_reduce_sum(torch.tensor([ctx.rank + 1.0]))
            print(f"sum {{ctx.rank}} {{t.item()}} threads {{torch.get_num_threads()}}", flush=True)
    """))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k != "OMP_NUM_THREADS"}
    # --standalone: torchrun picks a free port itself, so parallel test runs do not collide.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        assert f"[dist] rank {rank}/2 | local rank {rank}/2 | node 0 | master " in proc.stdout
        # torchrun exports OMP_NUM_THREADS=1 for several processes; NUM_THREADS 0 keeps it.
        assert f"sum {rank} 3.0 threads 1" in proc.stdout
    assert proc.stdout.count("| device cpu | backend gloo | launcher torchrun") == 2


def test_setup_threads_default_and_omp(plain_env, monkeypatch):
    """NUM_THREADS 0, resolved (inferred/machine.py): the cores free to this process (one process, an idle machine:
    all it may use); an explicit OMP_NUM_THREADS is kept. comm sets the resolved value."""
    threads = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        torch.set_num_threads(1)
        comm.setup(make_cfg("DEVICE", "cpu"))
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(2)
        comm.setup(make_cfg("DEVICE", "cpu"))
        assert torch.get_num_threads() == 1
        comm.setup(make_cfg(base=TINY))
        assert torch.get_num_threads() == 1  # NUM_THREADS wins
    finally:
        torch.set_num_threads(threads)


def test_setup_cudnn_flags(plain_env):
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    try:
        comm.setup(make_cfg("CUDNN.DETERMINISTIC", "True", base=TINY))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        comm._set_cuda_flags(make_cfg("CUDNN.DETERMINISTIC", "True", base=TINY))  # what setup() does on a GPU
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        comm.setup(make_cfg(base=TINY))  # the defaults undo it: setup() leaves no state of an earlier call
        assert not torch.are_deterministic_algorithms_enabled()
        comm._set_cuda_flags(make_cfg(base=TINY))
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved


def _reads_launcher_variable(node: ast.AST) -> bool:
    """`environ.get("RANK")`, `environ["SLURM_..."]`, `"WORLD_SIZE" in environ` and the like."""
    def launcher_name(n: ast.AST) -> bool:
        return isinstance(n, ast.Constant) and isinstance(n.value, str) and (
            n.value in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT"}
            or n.value.startswith(("SLURM_", "TORCHELASTIC_")))

    def is_environ(n: ast.AST) -> bool:
        return (isinstance(n, ast.Attribute) and n.attr == "environ") or (isinstance(n, ast.Name) and n.id == "environ")

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop"):
        return is_environ(node.func.value) and any(launcher_name(a) for a in node.args[:1])
    if isinstance(node, ast.Subscript):
        return is_environ(node.value) and launcher_name(node.slice)
    if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
        return launcher_name(node.left) and is_environ(node.comparators[0])
    return False


def test_only_dist_launch_reads_the_launcher_variables():
    """#15: RANK / WORLD_SIZE / SLURM_* ... are read in launch/launcher.py alone; the rest asks it."""
    package = os.path.join(ROOT, "distribuuuu")
    readers = []
    for folder, _, files in os.walk(package):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path == os.path.join(package, "dist", "launcher.py"):
                continue
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            readers += [f"{os.path.relpath(path, ROOT)}:{n.lineno}" for n in ast.walk(tree)
                        if _reads_launcher_variable(n)]
    assert not readers, readers
