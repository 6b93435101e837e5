"""The built-in spawner: `distribuuuu train --nproc-per-node N` starts N
processes on this host.

It plays torchrun's part on one machine: it hosts the rendezvous store,
gives each child the torchrun variables, relays stop signals to the
children once, and reports the first failure as its own exit status,
leaving no child behind (see ``spawn``).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from distribuuuu.errors import USER_ERROR_EXIT, UserError
from distribuuuu.launch import launcher, signals
from distribuuuu.launch.comm import is_addr_in_use
from distribuuuu.launch.launcher import SPAWN_MASTER_ADDR
from distribuuuu.launch.relay import ERROR_DIR_ENV, report_error, spawned_errors

__all__ = ["spawn", "STOP_GRACE_S", "FAILURE_GRACE_S"]


STOP_GRACE_S = (
    30.0  # how long stopped children may take to exit before SIGKILL (torchrun's default too)
)
# After one child fails: how long the others may take to end by
# themselves (an error that every rank finds together, such as
# engine.NonFiniteLoss, is then left by each, and printed once), before
# SIGTERM and, that long again later, SIGKILL.
FAILURE_GRACE_S = 5.0


def _host_store(port: int) -> tuple[Any, int]:
    """Start the rendezvous store in the spawner, as torchrun's agent
    does; return it and its port.

    The children only connect to it (see _spawn_entry), so no other
    program can take the port between our choosing it and rank 0 binding
    it. port 0 lets the OS choose; a port in use is replaced by a free
    one, and the log says so.
    """
    if port:
        try:
            return dist.TCPStore(
                SPAWN_MASTER_ADDR, port, is_master=True, wait_for_workers=False
            ), port
        except (dist.DistNetworkError, RuntimeError) as e:
            if not is_addr_in_use(e):
                raise
    store = dist.TCPStore(SPAWN_MASTER_ADDR, 0, is_master=True, wait_for_workers=False)
    if port:
        print(
            f"[spawn] master port {port} is in use; using free port {store.port} instead",
            flush=True,
        )
    return store, store.port


def _spawn_entry(
    local_rank: int, worker: Callable[..., None], nprocs: int, port: int, errors: str, args: tuple
) -> None:
    """First code of every spawned child: export the launcher variables,
    run the worker."""
    # A session of its own (as torchrun does for its workers): a
    # terminal's Ctrl-C or a signal to the job's process group then
    # reaches only the spawner, which relays it once (_stop). Without it
    # each child got SIGTERM twice, from the group and from the spawner,
    # and the second one aborted the step checkpoint on some ranks only.
    # A spawner killed outright still takes the children along (torch
    # sets PR_SET_PDEATHSIG, which does not depend on the session).
    try:
        os.setsid()
    except OSError:  # already a session leader: nothing to leave
        pass
    # TORCHELASTIC_USE_AGENT_STORE=True: env:// connects to the store
    # the spawner hosts at MASTER_ADDR:MASTER_PORT instead of having
    # rank 0 start one (torchrun's protocol).
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        MASTER_ADDR=SPAWN_MASTER_ADDR,
        MASTER_PORT=str(port),
        DISTRIBUUUU_LAUNCHER="spawn",
        TORCHELASTIC_USE_AGENT_STORE="True",
        **{ERROR_DIR_ENV: errors},
    )
    # The exit code is the child's message to the parent, so decide it
    # here: torch's wrapper would turn Ctrl-C into status 0 and hide a
    # traceback in a pickle file.
    try:
        worker(*args)
    except UserError as e:  # the CLI normally reports these itself; this is the safety net
        report_error(str(e), str(local_rank))
        sys.exit(USER_ERROR_EXIT)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP (Terminated)
        sys.exit(signals.stop_status(e))
    except Exception:  # noqa: BLE001 -- any crash: its traceback here, then exit 1 for the spawner
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)


def _signal_children(processes: Sequence[Any], signum: int) -> None:
    """Send signum to every child that has not exited (an unreaped
    child's pid is not reused)."""
    for p in processes:
        if p.is_alive():
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:  # exited meanwhile
                pass


def _relay_to(children: list[Any], names: Sequence[str]) -> dict[int, Any]:
    """Handlers that pass each named signal (not a stop signal: those
    stop the spawner, _stopped) on to the children, the ones started so
    far; returns the handlers they replace."""
    nums = {getattr(signal, name) for name in names} - set(signals.STOP_SIGNALS)
    return {
        num: signal.signal(num, lambda n, _f: _signal_children(children, n)) for num in sorted(nums)
    }


@contextmanager
def _relaying(processes: Sequence[Any]) -> Iterator[None]:
    """While the children wind down, pass every further stop signal
    (SIGINT, SIGTERM, SIGHUP) on to them.

    Repeated signals then do in the children what they do when received
    directly: a third cuts a stuck step checkpoint short
    (launch/signals.py). The spawner itself keeps waiting.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {}
    for signum in signals.STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            saved[signum] = signal.signal(signum, lambda n, _f: _signal_children(processes, n))
    try:
        yield
    finally:
        for signum, previous in saved.items():
            signal.signal(signum, previous)


def _stop(
    processes: Sequence[Any], grace_s: float = STOP_GRACE_S, signum: int = signal.SIGTERM
) -> None:
    """Send signum to every live child, then SIGKILL whatever is still
    there after grace_s.

    signum is the stop signal the spawner received (SIGTERM when it
    stops the children itself), so the children act as if it had reached
    them directly: a TRAIN.PREEMPT_SIGNALS signal writes a step
    checkpoint first. Stop signals that arrive meanwhile are relayed too
    (_relaying).
    """
    with _relaying(processes):
        _signal_children(processes, signum)
        deadline = time.monotonic() + grace_s
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()


def _status_of(exitcode: int) -> int:
    """A child's exit code as a shell status: signals become 128 +
    signal number."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _report_odd_endings(processes: Sequence[Any], status: int) -> None:
    """After a stop: name each child that ended otherwise than with
    status (killed, crashed)."""
    for rank, p in enumerate(processes):
        if p.exitcode is not None and _status_of(p.exitcode) not in (0, status):
            print(
                f"[spawn] process {rank} (pid {p.pid}) ended with status {_status_of(p.exitcode)}",
                file=sys.stderr,
                flush=True,
            )


def _check_spawn(nprocs: int, port: int | None) -> int:
    """Refuse a spawn that cannot work (before anything starts); return
    the port to use."""
    if nprocs < 1:
        raise UserError(f"--nproc-per-node must be >= 1, got {nprocs}")
    outer = launcher.detect()
    if outer.launcher != "plain" and not (outer.launcher == "slurm" and outer.world_size == 1):
        raise UserError(
            f"this process was already started by {outer.launcher} ({outer.world_size} processes); "
            f"drop --nproc-per-node, or let {outer.launcher} start the processes"
        )
    if port is None:
        port = launcher.master_port()
    if not 0 <= port < 65536:
        raise UserError(f"master port {port} must be in [0, 65535]")
    return port


def _error_folder() -> str:
    """A new folder for the ranks' errors (_print_errors); "" where none
    can be made: each rank then prints its own."""
    try:
        return tempfile.mkdtemp(prefix="distribuuuu-errors-")
    except OSError:
        return ""


def _print_errors(errors: str) -> None:
    """Print the errors the ranks left in the folder errors, each
    message once, and take them away."""
    for line in spawned_errors(errors):
        print(line, file=sys.stderr, flush=True)


def _exited(e: mp.ProcessExitedException, relayed: Collection[int], errors: str) -> int:
    """The first child that ended with a non-zero status: its status,
    the errors the ranks left (each message once; every child has ended
    by now), and the spawner's one line."""
    _print_errors(errors)
    status = _status_of(e.exit_code)
    if status - 128 in relayed:  # the ranks' way out of a relayed preemption signal
        print(
            f"[spawn] stopped by {signal.Signals(status - 128).name}, relayed to every process",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"[spawn] process {e.error_index} (pid {e.error_pid}) exited with status {status}; the "
            "other processes were stopped",
            file=sys.stderr,
            flush=True,
        )
    return status


def _stopped(processes: Sequence[Any], exc: KeyboardInterrupt) -> int:
    """The spawner was stopped (Ctrl-C, SIGTERM, SIGHUP): the same
    signal, once, to every child."""
    status = signals.stop_status(exc)
    _stop(processes, signum=status - 128)
    print(
        f"[spawn] stopped by {signal.Signals(status - 128).name}; all processes stopped",
        file=sys.stderr,
        flush=True,
    )
    _report_odd_endings(processes, status)
    return status


def spawn(
    worker: Callable[..., None],
    nprocs: int,
    args: tuple = (),
    *,
    port: int | None = None,
    relay: Sequence[str] = (),
) -> int:
    """Run ``worker(*args)`` in nprocs fresh processes on this host;
    return the exit status.

    Each child sees the torchrun variables (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, MASTER_ADDR=127.0.0.1,
    MASTER_PORT) and DISTRIBUUUU_LAUNCHER=spawn, so its ``setup()``
    needs nothing else. worker must be a module-level function (it is
    pickled), and the script that calls spawn() must guard its entry
    point with ``if __name__ == "__main__"``.

    port: the rendezvous port; default MASTER_PORT from the environment,
    else one the OS picks. The spawner listens on it itself before any
    child starts (_host_store); a port in use is replaced by a free one
    and logged.

    Returns 0 when all children exit 0, else the status of the first
    child that failed: its own exit code (2 for a UserError), 1 for an
    exception (its traceback is printed by the child), 128+N for a
    signal. The other children get FAILURE_GRACE_S seconds to end by
    themselves, then are stopped; none is left behind. SIGINT (Ctrl-C),
    SIGTERM or SIGHUP (the terminal closed) to the spawner, whether sent
    to its pid or to its process group (the children run in sessions of
    their own, so only the spawner receives it): every child gets the
    same signal once, and STOP_GRACE_S seconds to exit (then SIGKILL); a
    further signal is relayed too; the status is 130, 143 or 129. A
    spawner killed outright (SIGKILL) takes the children with it:
    torch.multiprocessing asks Linux to send them SIGINT then
    (PR_SET_PDEATHSIG), and their loader workers die with them.

    relay: more signals, by name (a training's TRAIN.PREEMPT_SIGNALS,
    e.g. SIGUSR1), that the spawner passes on to every child as they
    come and then keeps waiting: the children write their preemption
    checkpoint and exit with 128 + the signal, and so does the spawner.
    Without it SIGUSR1's default action would end the spawner at once,
    and its children with it, before any checkpoint.
    """
    port = _check_spawn(nprocs, port)
    signals.handle_stop_signals()
    context, children, relayed = None, [], {}
    errors = _error_folder()
    try:
        store, port = _host_store(port)  # kept alive until the children are done
        print(f"[spawn] {nprocs} processes, master {SPAWN_MASTER_ADDR}:{port}", flush=True)
        relayed = _relay_to(
            children, relay
        )  # one that comes before any child runs finds none: dropped
        with signals.held_stop_signals():
            context = mp.start_processes(
                _spawn_entry,
                args=(worker, nprocs, port, errors, tuple(args)),
                nprocs=nprocs,
                join=False,
                start_method="spawn",
            )
        children.extend(context.processes)
        # join() returns True once all exited 0, and on the first
        # failure stops the rest and raises.
        while not context.join(grace_period=FAILURE_GRACE_S):
            pass
        return 0
    except mp.ProcessExitedException as e:
        return _exited(e, relayed, errors)
    except mp.ProcessRaisedException as e:  # only if a worker bypassed _spawn_entry's handler
        print(e, file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as e:  # a stop signal to the spawner (signals.handle_stop_signals)
        return _stopped(context.processes if context is not None else [], e)
    finally:
        # Belt and braces for any other way out: no child may outlive
        # the parent's return.
        if context is not None:
            _stop(context.processes, grace_s=1.0)
        for signum, previous in relayed.items():
            signal.signal(signum, previous)
        signals.restore_signal_handlers()
        _print_errors(errors)  # those of a stopped spawner's ranks
        shutil.rmtree(errors, ignore_errors=True)
