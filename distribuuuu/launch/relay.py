"""The spawner's error relay: each distinct message of its ranks
printed once. Each rank leaves its error in a folder, which the spawner
reads after every rank ended (launch/spawn.py). Light (no torch): the
CLI reports through it.
"""

import os

from distribuuuu.errors import report_line

# Set by distribuuuu's spawner for its ranks: a folder where each leaves
# its error, which the spawner prints once per distinct message after
# every rank ended (launch/spawn.py).
ERROR_DIR_ENV = "DISTRIBUUUU_ERROR_DIR"


def report_error(message: str, rank: str) -> None:
    """A rank's error: one line on stderr, or, under the spawner, a file
    that the spawner prints. The ranks of a job usually refuse the same
    input together, and two copies of one message on one terminal read
    as two problems."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder:
        try:
            with open(os.path.join(folder, f".{rank}"), "w", encoding="utf-8") as f:
                f.write(message)
            os.replace(
                os.path.join(folder, f".{rank}"), os.path.join(folder, rank)
            )  # whole or absent
            return
        except OSError:  # the folder is gone or full: the terminal still gets the message
            pass
    report_line(f"{'error' if rank == '0' else f'error (rank {rank})'}: {message}")


def spawned_errors(folder: str) -> list[str]:
    """The spawner's lines for the errors its ranks left in folder
    (taken away as they are read): each distinct message once, with the
    ranks that reported it unless rank 0 is one of them."""
    by_message: dict[str, list[str]] = {}
    names = (
        os.listdir(folder) if os.path.isdir(folder) else []
    )  # "": none made; or removed meanwhile
    for rank in sorted((n for n in names if n.isdigit()), key=int):
        with open(os.path.join(folder, rank), encoding="utf-8") as f:
            by_message.setdefault(f.read(), []).append(rank)
        os.remove(os.path.join(folder, rank))
    return [
        f"error: {message}"
        if "0" in ranks
        else f"error (rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}): {message}"
        for message, ranks in by_message.items()
    ]
