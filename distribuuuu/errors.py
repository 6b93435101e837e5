"""The one exception type that means "the user asked for something
wrong".

The CLI turns it into exit status 2 and a single message without a
traceback; anything else that escapes is a crash (status 1) and keeps
its traceback.
"""

import os
import sys

USER_ERROR_EXIT = 2


class UserError(Exception):
    """Bad config, path or argument: say what is wrong and what would be
    right."""


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


def report_line(line: str) -> None:
    """A rank's last line on stderr, in one write: print() writes text
    and newline apart, and the ranks of a spawned job share stderr, so
    two ranks' lines came out glued together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
