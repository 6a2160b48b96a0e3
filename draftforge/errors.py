"""One exception family so the CLI can print a single clear line for any user error."""


def first_line(err: BaseException) -> str:
    """An exception's first line of text (its type's name when it has none), for a one-line error message."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


class DraftforgeError(Exception):
    """A user-facing error: the message says what is wrong and what to do about it."""


class RecipeError(DraftforgeError):
    """A recipe key is unknown, mistyped or holds an impossible value."""


class DataError(DraftforgeError):
    """A data source is missing, empty, or has rows that cannot be used."""


class CheckpointError(DraftforgeError):
    """A checkpoint or export is missing, corrupted, or from another run/method."""


class CompatibilityError(DraftforgeError):
    """Two artifacts cannot work together (e.g. drafter and target tokenizers differ)."""
