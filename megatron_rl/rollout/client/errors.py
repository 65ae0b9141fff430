"""What a call to a server can fail with (SGLangClient and everything above it)."""

from __future__ import annotations

from typing import Any, Optional


class ServerError(RuntimeError):
    """A call failed; ``status`` is the HTTP status (None for transport failures)."""

    def __init__(self, message: str, url: str, status: Optional[int] = None, payload: Any = None):
        super().__init__(message)
        self.url, self.status, self.payload = url, status, payload

    def __reduce__(self):  # picklable (Ray sends a failed actor call's exception to the driver)
        return type(self), (str(self), self.url, self.status, self.payload)


class RequestRejected(ServerError):
    """4xx: the server refused the request (its message is in the exception's text)."""


class ServerUnavailableError(ServerError):
    """The server could not be reached (or kept failing) after every attempt the policy allows."""
