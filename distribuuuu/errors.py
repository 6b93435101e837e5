"""The one exception type that means "the user asked for something
wrong".

The CLI turns it into exit status 2 and a single message without a
traceback; anything else that escapes is a crash (status 1) and keeps
its traceback.
"""

import sys

USER_ERROR_EXIT = 2


class UserError(Exception):
    """Bad config, path or argument: say what is wrong and what would be
    right."""


def report_line(line: str) -> None:
    """A rank's last line on stderr, in one write: print() writes text
    and newline apart, and the ranks of a spawned job share stderr, so
    two ranks' lines came out glued together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
