"""The one exception type that means "the user asked for something wrong".

The CLI turns it into exit status 2 and a single message without a traceback; anything else
that escapes is a crash (status 1) and keeps its traceback.
"""

import sys

USER_ERROR_EXIT = 2
NOT_SAVED_EXIT = 3  # the run trained but could not save finite weights (RunNotSaved)


class UserError(Exception):
    """Bad config, path or argument: say what is wrong and what would be right."""


class RunNotSaved(Exception):
    """The run ended without a checkpoint it could use: its weights or buffers are not finite at the
    end, or none of the checkpoints it was due to write was written. Not "done": the CLI says why in
    one line and exits with NOT_SAVED_EXIT."""


def report_line(line: str) -> None:
    """A rank's last line on stderr, in one write: print() writes text and newline apart, and the
    ranks of a spawned job share stderr, so two ranks' lines came out glued together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
