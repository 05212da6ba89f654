"""Errors of the tile language (importable without TVM)."""


class TileLangError(Exception):
    """A program the compiler cannot accept; the message names the user's line and the reason."""


class SharedMemoryError(TileLangError):
    """A kernel needing more shared memory than its target has (``needed``, ``limit`` bytes on ``arch``)."""
