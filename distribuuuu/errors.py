"""The one exception type that means "the user asked for something wrong".

The CLI turns it into exit status 2 and a single message without a traceback; anything else
that escapes is a crash (status 1) and keeps its traceback.
"""

USER_ERROR_EXIT = 2


class UserError(Exception):
    """Bad config, path or argument: say what is wrong and what would be right."""
