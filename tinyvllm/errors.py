"""The one exception type for mistakes a user can make (a bad path, a corrupt file, a bad flag).

The CLI prints its message as one line and exits with code 2; anything else is a bug and keeps its traceback.
"""


class TinyVLLMError(Exception):
    """A user's mistake: the message says what is wrong and how to fix it, in one line."""
