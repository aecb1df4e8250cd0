"""User-facing errors.

Glossary: a *user error* is anything the caller can fix (a bad flag value, a missing
model, a prompt too long for the context). It carries a one-line message that the CLI
prints without a traceback and the server turns into a 4xx response.
"""


class SpecDecodeError(Exception):
    """An error the user can fix; its message is one line and names what to change."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field
