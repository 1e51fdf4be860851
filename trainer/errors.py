"""The one exception type that means "the user's input is wrong".

The CLI turns it into a single line on stderr and exit status 2; everything else is a bug or a
fault and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: a config key, a value, a file, a dataset, a run id."""
