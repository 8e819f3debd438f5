"""Errors that headkit raises for bad user input.

:class:`HeadkitError` subclasses ``ValueError`` so callers that already catch ``ValueError`` keep working; the
command line turns it into one line on stderr and exit status 2.
"""


class HeadkitError(ValueError):
    """A user-facing error: bad argument, missing file, unsupported model."""
