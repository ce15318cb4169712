"""Exceptions raised by hf-deltazip.

Every error says what went wrong and what to do about it. Catch :class:`DeltaZipError`
to handle all of them.
"""

from __future__ import annotations


class DeltaZipError(Exception):
    """Base class of every error raised by hf-deltazip."""


class DeltaZipConfigError(DeltaZipError, ValueError):
    """A :class:`~hf_deltazip.DeltaZipConfig` field has a value that is not allowed."""


class TargetRatioTooLowError(DeltaZipConfigError):
    """``target_ratio`` leaves more bytes than the most accurate settings offered would use.

    ``reachable`` is the whole-file ratio those settings reach: compress with a ``target_ratio`` of at
    least that (the most accurate delta the offered settings make), or without one.
    """

    def __init__(self, message: str, reachable: float):
        self.reachable = reachable
        super().__init__(message)


class DeltaZipFormatError(DeltaZipError):
    """A ``.dz`` file (or a delta folder) is corrupt, truncated or of an unknown version.

    The message names the file and the problem.
    """

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class BaseMismatchError(DeltaZipError):
    """The delta was made for another base model than the one it is being applied to."""


class UnsupportedModelError(DeltaZipError):
    """The model's architecture or layer types are not supported."""


class DeltaNotFoundError(DeltaZipError, KeyError):
    """A delta name is not loaded on this model."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class HubError(DeltaZipError):
    """A Hub operation failed (repository, file or revision missing, offline, ...)."""
