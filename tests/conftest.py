"""The tests' one shared module: session settings, fixtures, and the helpers the test files import
by name (`from tests.conftest import TINY, check, distribuuuu`).

Tiers: a test that starts a process (the installed command, torchrun, srun, the spawner, a tutorial
script) is marked `e2e`, per file (`pytestmark`) or per test; the rest runs in this process. An
in-process test that is long by nature (a real training run checked for accuracy, several seconds)
is marked `slow`. `make test-fast` runs the rest (`-m "not e2e and not slow"`), `make test` everything.

Files: `make test` runs them on two pytest-xdist workers (`-n 2 --dist loadfile`), each file's tests
in order in one worker, its module fixtures built once. The tests that submit jobs to the one-host,
two-CPU Slurm cluster are all in test_slurm.py, so two jobs never wait for each other.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "config", "synthetic_tiny.yaml")

# A suite started in the background by a non-interactive shell (`make test &` in a script, nohup) inherits
# SIGINT ignored, and every process a test starts would inherit that too: the tests of Ctrl-C would then
# see their SIGINT ignored. Python's own default handler here makes the children start with the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# ---- In-process tests share pytest's process: what one changes process-wide is put back ----------
# The stop signals the package handles (TRAIN.PREEMPT_SIGNALS, the spawner); SIGALRM is pytest-timeout's.
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _group_exists() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _torch_state() -> tuple | None:
    torch = sys.modules.get("torch")  # never import torch for a test that did not
    return None if torch is None else (
        torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic)


def _restore_torch(before: tuple | None, had_group: bool) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and _group_exists() and not had_group:  # it would make the next setup() fail
        sys.modules["torch.distributed"].destroy_process_group()
    if torch is None or before is None or _torch_state() == before:
        return
    threads, deterministic, warn_only, benchmark, cudnn_deterministic = before
    torch.set_num_threads(threads)
    if (deterministic, warn_only) != _torch_state()[1:3]:  # the call is slow: only on a change
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = benchmark, cudnn_deterministic


def _restore_environ(before: dict[str, str]) -> None:
    for name in [n for n in os.environ if n not in before]:
        del os.environ[name]  # e.g. MASTER_PORT left by a session: the next detect() must not see it
    os.environ.update({k: v for k, v in before.items() if os.environ.get(k) != v})


def _restore_logging(package: tuple, root_before: list) -> None:
    """The package's logger as it was; from the root logger, what the test added (not pytest's)."""
    log, root = logging.getLogger("distribuuuu"), logging.getLogger()
    handlers, level, propagate = package
    added = [h for h in log.handlers if h not in handlers]
    added += [h for h in root.handlers if h not in root_before and not type(h).__module__.startswith("_pytest")]
    for handler in added:
        log.removeHandler(handler)
        root.removeHandler(handler)
        handler.close()
    log.handlers[:], log.propagate = handlers, propagate
    log.setLevel(level)  # through setLevel: it clears the loggers' cached levels


@contextlib.contextmanager
def process_state_restored():
    """cwd, environment, signal and logging handlers, torch's global switches back as they were: a CLI
    run in process sets them all, and a handler left on a closed capture stream fails the next test.
    Every test runs inside it (below); a module-scoped fixture that trains in process uses it too."""
    cwd, environ = os.getcwd(), dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    log = logging.getLogger("distribuuuu")
    package_log, root_handlers = (list(log.handlers), log.level, log.propagate), list(logging.getLogger().handlers)
    torch_state, had_group = _torch_state(), _group_exists()
    try:
        yield
    finally:
        os.chdir(cwd)
        _restore_environ(environ)
        for signum, handler in handlers.items():
            if handler is not None and signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)
        _restore_logging(package_log, root_handlers)
        _restore_torch(torch_state, had_group)


@pytest.fixture(autouse=True)
def _restore_process_state():
    with process_state_restored():
        yield


@pytest.fixture
def one_thread():
    """One intra-op thread for an in-process test on the 2-core machine (_restore_process_state,
    autouse and so set up first, puts the count back after it)."""
    import torch

    torch.set_num_threads(1)
    yield


# ---- Running the real command line in subprocesses ------------------------------------------------
def env() -> dict[str, str]:
    """One intra-op thread per process (the machine has 2 cores), unbuffered output."""
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_ID", "DISTRIBUUUU_LAUNCHER"):
        e.pop(var, None)
    return e


def run(args: list[str], timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    """Run a command from the repo root, capturing text output."""
    return subprocess.run(args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout, **kw)


def distribuuuu(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "distribuuuu", *args], timeout=timeout)


def torchrun(nproc: int, script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", script, *args], timeout=timeout)


def cli_main(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    """`distribuuuu ARGS` run in this process by distribuuuu.cli.main, from the repo root as
    distribuuuu() runs it (or from cwd: a user's folder outside the repository): the same status
    and output, without a new interpreter. Only for a command that ends before it starts a
    process group or a child (a user error, `config`)."""
    from distribuuuu import cli

    out, err, argv, before = io.StringIO(), io.StringIO(), sys.argv, os.getcwd()
    root, captured = logging.getLogger(), logging.getLogger().handlers[:]
    # argv: what launch detection reads for --local-rank. Without pytest's handlers on the root logger,
    # a warning logged before setup_logging reaches stderr (logging.lastResort), as in a new process.
    sys.argv, root.handlers = ["distribuuuu", *args], []
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli.main(list(args))
    finally:
        sys.argv, root.handlers = argv, captured
        os.chdir(before)
    return subprocess.CompletedProcess(["distribuuuu", *args], status, out.getvalue(), err.getvalue())


def read_text_or_empty(path) -> str:
    """A file that a running process may not have written yet."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def check(proc: subprocess.CompletedProcess, status: int = 0) -> subprocess.CompletedProcess:
    assert proc.returncode == status, (
        f"exit {proc.returncode} (wanted {status})\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def check_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """A user error as the CLI reports it: exit 2, no traceback, and on stderr one `error...` line and
    nothing else, holding every fragment (however many processes were asked for). Returns the line."""
    check(proc, 2)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error"), proc.stderr[-4000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def free_port() -> int:
    """A TCP port that is free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ---- Processes, read from /proc (no psutil): for the launcher, signal and Slurm tests -------------
def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, start time) of every process."""
    table = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        table[int(name)] = (int(fields[1]), fields[0], fields[19])  # ppid, state, starttime
    return table


def process_tree(root: int) -> dict[int, str]:
    """root and all its descendants: pid -> start time (tells a reused pid apart)."""
    table, tree, todo = _proc_table(), {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in tree:
            tree[pid] = table[pid][2]
            todo.extend(p for p, (ppid, _, _) in table.items() if ppid == pid)
    return tree


def alive(procs: dict[int, str] | list[int]) -> list[int]:
    """Those of procs (process_tree's {pid: start time}, or pids) still running; a zombie has exited."""
    table = _proc_table()
    starts = procs if isinstance(procs, dict) else {}
    return [pid for pid in procs if pid in table and table[pid][1] not in ("Z", "X")
            and starts.get(pid, table[pid][2]) == table[pid][2]]


def wait_gone(procs: dict[int, str] | list[int], timeout: float) -> list[int]:
    """Wait up to timeout seconds for every process of procs to end; the ones still running."""
    end = time.monotonic() + timeout
    while alive(procs) and time.monotonic() < end:
        time.sleep(0.1)
    return alive(procs)


def start_until(argv: list[str], out, until: Callable[[Any], bool], timeout: float = 180
                ) -> tuple[subprocess.Popen, dict[int, str], Any]:
    """argv (a train command writing into out) in a session of its own, its output in <out>.console.txt,
    returned once until(out) holds: (the launcher, every process seen, the console file)."""
    console = out.parent / f"{out.name}.console.txt"
    with open(console, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    job: dict[int, str] = {}
    try:
        deadline = time.monotonic() + timeout
        while not until(out):
            assert proc.poll() is None, f"exited {proc.returncode} early:\n{console.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not there after {timeout} s\n{console.read_text()[-4000:]}"
            job.update(process_tree(proc.pid))
            time.sleep(0.05)
    except BaseException:
        kill_tree(proc, job)
        raise
    job.update(process_tree(proc.pid))
    return proc, job, console


def logged(text: str) -> Callable[[Any], bool]:
    """until for start_until: log.txt in out holds text."""
    return lambda out: text in read_text_or_empty(out / "log.txt")


def start_until_training(argv: list[str], out) -> tuple[subprocess.Popen, dict[int, str], Any]:
    """start_until the first training step of a one-epoch run shows in log.txt."""
    return start_until(argv, out, logged("[train] epoch 1/1 iter"))


def kill_tree(proc: subprocess.Popen, tree: dict[int, str]) -> None:
    """Clean-up after a test: SIGKILL whatever of the tree still runs, and reap the launcher."""
    for pid in alive(tree):
        os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def stop_and_wait(proc: subprocess.Popen, job: dict[int, str], console, sig: int = signal.SIGTERM,
                  timeout: float = 120) -> None:
    """sig to the launcher: it must end with 128 + sig and leave nothing of its job running; whatever
    is left is killed either way."""
    try:
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=timeout) == 128 + sig, console.read_text()[-4000:]
        assert not wait_gone(job, 15)
    finally:
        kill_tree(proc, job)


def cmdline(pid: int) -> str:
    """The command line of pid, arguments joined by spaces ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def pids_matching(pattern: str) -> list[int]:
    """Running pids whose command line matches the regex pattern (like `pgrep -f`, without procps)."""
    regex = re.compile(pattern)
    return [p for p in alive([p for p in _proc_table() if p != os.getpid()]) if regex.search(cmdline(p))]


def describe(pids: list[int]) -> str:
    """One "pid: command line" line per pid that still runs, for failure messages."""
    return "\n".join(f"{p}: {cmdline(p)}" for p in alive(pids)) or "(none running)"


# ---- Small on-disk data: configs, image trees, fake CIFAR pickles ---------------------------------
def make_cfg(*opts, base: str | None = None, resolve: bool = True):
    """The tests' one way to a config: load_config(base, opts), then the unset keys decided from the
    data (inferred.resolve, as the API does before a run) unless resolve=False. opts are KEY VALUE
    words or {KEY: value} dicts, mixed as reads best: a value that is not a string is passed as a
    Python literal, a path as its text."""
    from distribuuuu import inferred
    from distribuuuu.config import load_config

    def word(value) -> str:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        return value if isinstance(value, str) else repr(value)

    words: list[str] = []
    for opt in opts:
        words += [word(w) for pair in opt.items() for w in pair] if isinstance(opt, dict) else [word(opt)]
    cfg = load_config(base, words)
    return inferred.resolve(cfg) if resolve else cfg


def fit(cfg, hooks=()) -> dict:
    """engine.fit in this process, in the process-group session the API opens around it (without the
    API's checks and run lock): for tests of the loop and its hooks."""
    from distribuuuu import engine
    from distribuuuu.launch import comm

    with comm.session(cfg) as ctx:
        return engine.fit(cfg, ctx, hooks=hooks)


def write_image(path: str, size: tuple[int, int], mode: str, seed: int) -> None:
    """A random image of the given PIL mode (L, RGB, RGBA); the format follows the extension."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    chans = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    shape = (size[1], size[0]) if chans == 1 else (size[1], size[0], chans)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)


def write_glyph(path: str, size: tuple[int, int], seed: int) -> None:
    """A gray glyph: a white stroke on a black background (two-toned, as digits and letters are)."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.new("L", size, 0)
    w, h = size
    points = [(int(rng.integers(0, w)), int(rng.integers(0, h))) for _ in range(3)]
    ImageDraw.Draw(image).line(points, fill=255, width=max(1, min(size) // 6))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    image.save(path)


def write_image_tree(root: str, split: str, classes: dict[str, int], mode: str = "RGB",
                     ext: str = "png", size: tuple[int, int] = (12, 10)) -> None:
    """root/split/<class>/<i>.<ext> with classes[name] images each (mode "glyph": gray glyphs)."""
    for c_idx, (name, n) in enumerate(sorted(classes.items())):
        for i in range(n):
            path = os.path.join(root, split, name, f"{i}.{ext}")
            if mode == "glyph":
                write_glyph(path, size, seed=100 * c_idx + i)
            else:
                write_image(path, size, mode, seed=100 * c_idx + i)


def write_constant_image_tree(root: str, split: str, classes: dict[str, int], value: int = 120,
                              size: tuple[int, int] = (20, 16)) -> None:
    """root/split/<class>/<i>.png, every image one flat RGB colour: any crop or flip of it is the
    same flat image, so what makes two of them differ is the rest of the augmentation."""
    from PIL import Image

    for name, n in sorted(classes.items()):
        for i in range(n):
            path = os.path.join(root, split, name, f"{i}.png")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            Image.new("RGB", size, (value, value, value)).save(path)


def _pickle(folder: str, name: str, obj: dict) -> None:
    with open(os.path.join(folder, name), "wb") as f:
        pickle.dump(obj, f)


def write_fake_cifar10(folder: str, per_batch: int = 2, test_size: int = 3):
    """folder/ holding data_batch_1..5, test_batch and batches.meta (the python pickle layout);
    returns the test batch's images as uint8 [N, 3, 32, 32] to compare against."""
    import numpy as np

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    for b in range(1, 6):
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        _pickle(folder, f"data_batch_{b}", {"data": data, "labels": [(b + i) % 10 for i in range(per_batch)]})
    test = rng.integers(0, 256, (test_size, 3072), dtype=np.uint8)
    _pickle(folder, "test_batch", {"data": test, "labels": [i % 10 for i in range(test_size)]})
    _pickle(folder, "batches.meta", {"label_names": names})
    return test.reshape(-1, 3, 32, 32)


def write_fake_cifar100(folder: str, n_train: int = 4, n_test: int = 2) -> None:
    """folder/ holding train, test and meta of CIFAR-100's python layout."""
    import numpy as np

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(1)
    for name, n in (("train", n_train), ("test", n_test)):
        _pickle(folder, name, {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                               "fine_labels": [99 - i for i in range(n)], "coarse_labels": [0] * n})
    _pickle(folder, "meta", {"fine_label_names": [f"c{i:02d}" for i in range(100)]})


# ---- Slurm: tests that use a real cluster (scripts/local_slurm.sh starts a one-host one) ----------
START_HINT = "start a local cluster with `scripts/local_slurm.sh` (root, Debian), as .ci/run does"
USABLE_STATES = ("idle", "mixed", "allocated", "completing")  # node states that take new work (OverSubscribe)
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE")


def _out(args: list[str], timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


@functools.cache
def slurm_available() -> tuple[bool, str]:
    """(True, "") when srun exists, the controller answers and a node can take jobs; else (False, why)."""
    missing = [c for c in ("srun", "sbatch", "scontrol", "sinfo", "squeue", "scancel") if not shutil.which(c)]
    if missing:
        return False, f"Slurm commands not found: {', '.join(missing)}; {START_HINT}"
    try:
        ping = _out(["scontrol", "ping"])
        if ping.returncode != 0 or " is UP" not in ping.stdout:
            text = (ping.stdout + ping.stderr).strip().split("\n")[0]
            return False, f"no Slurm controller answers (`scontrol ping`: {text}); {START_HINT}"
        nodes = _out(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split("\n")
    except subprocess.TimeoutExpired as e:
        return False, f"`{' '.join(e.cmd)}` did not answer within {e.timeout:.0f} s; {START_HINT}"
    states = [line.split() for line in nodes if line.strip()]
    if not any(s[1] in USABLE_STATES for s in states if len(s) == 2):
        return False, f"the Slurm controller answers but no node takes jobs (sinfo: {states}); {START_HINT}"
    return True, ""


@functools.cache  # once per reason
def _announce(reason: str) -> None:
    print(f"\nSKIP (Slurm): {reason}", file=sys.__stderr__, flush=True)


def require_slurm() -> None:
    """Skip the calling test unless a Slurm cluster takes jobs, the reason also printed: pytest's
    default report hides skip reasons, and a silently skipped Slurm test looks like a passing one."""
    ok, reason = slurm_available()
    if not ok:
        _announce(reason)
        pytest.skip(reason)


def hostnames(nodelist: str) -> list[str]:
    """Slurm's own expansion of a hostlist (independent of launch.hostlist.parse_hostlist)."""
    return _out(["scontrol", "show", "hostnames", nodelist]).stdout.split()


def job_of(name: str) -> dict[str, str]:
    """The newest job named `name`, finished or not: {"id", "state", "nodes"} ({} if none).
    Finished jobs stay visible for MinJobAge seconds (600 in local_slurm.sh's config)."""
    out = _out(["squeue", "-h", "-t", "all", "-n", name, "-o", "%i|%T|%N"]).stdout.split("\n")
    rows = [line.split("|") for line in out if line.strip()]
    return dict(zip(("id", "state", "nodes"), max(rows, key=lambda r: int(r[0])))) if rows else {}


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, NodeList, StdOut, ...); {} if unknown."""
    out = _out(["scontrol", "show", "job", "-o", job_id]).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def wait_job(job_id: str, timeout: float) -> dict[str, str]:
    """Poll until the job has finished; its scontrol record ({} fields if it never finished)."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(job_id)
        if info.get("JobState") in FINISHED or time.monotonic() > deadline:
            return info
        time.sleep(0.5)


def cancel(name: str) -> None:
    """scancel every job named `name` (cleanup after a failed or timed-out test)."""
    subprocess.run(["scancel", "-n", name], capture_output=True, timeout=30)


def pipeline_name(cfg, key: str) -> str:
    """The pipeline that reads cfg[key], by its short name: memory, loader, shards or gpu."""
    from distribuuuu.data.loading import pipeline_class

    names = {"MemoryPipeline": "memory", "LoaderPipeline": "loader", "ShardPipeline": "shards",
             "DeviceDecodePipeline": "gpu"}
    return names[pipeline_class(cfg, key).__name__]
