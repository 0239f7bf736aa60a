"""One exception type for every problem a user can fix; the CLI prints its message on one line."""


class MoeserveError(Exception):
    """A user-facing error: bad path, unsupported model, invalid option. Never a bug."""
