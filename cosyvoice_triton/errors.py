"""Errors that a caller can act on. Each names the request field that caused it."""
from __future__ import annotations


class CosyVoiceError(Exception):
    """Base class of the library's own errors."""


class InvalidInput(CosyVoiceError, ValueError):
    """A request field is missing, malformed or out of range. Maps to INVALID_ARG / HTTP 400."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class NotFound(CosyVoiceError, KeyError):
    """A referenced object (a voice id, a stream id) does not exist. Maps to NOT_FOUND / HTTP 404."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")

    def __str__(self) -> str:  # KeyError would quote the message
        return f"{self.field}: {self.problem}"


class ModelFolderError(CosyVoiceError, FileNotFoundError):
    """The model folder is missing files or cannot be read."""


class Cancelled(CosyVoiceError):
    """The client went away or cancelled the request. Maps to CANCELLED / HTTP 499."""


class Unavailable(CosyVoiceError):
    """The server cannot take the request now (queue full, shutting down). Maps to UNAVAILABLE / HTTP 503."""
