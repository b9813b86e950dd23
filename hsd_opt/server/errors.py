"""Errors the server answers with: an HTTP status and an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server refuses (or cannot serve): ``status`` and the fields of the error body.

    Attributes:
        status: HTTP status (400 bad request, 401 bad key, 404 unknown route or model, 429 queue full, ...).
        message: one line for a person.
        type: the error's class as the OpenAI API names them (``invalid_request_error``, ``rate_limit_error``,
            ``server_error``, ...).
        param: the request field at fault, if one is (``"max_tokens"``, ``"messages[1].content"``).
        code: a short machine-readable code, if any (``"context_length_exceeded"``, ``"invalid_api_key"``).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI API's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return ApiError(400, message, "invalid_request_error", param, code)
