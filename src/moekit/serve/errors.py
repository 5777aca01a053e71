"""One error shape for every failure, OpenAI's: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from starlette.responses import JSONResponse

# The error `type` OpenAI's API sends for each status we answer with.
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


@dataclass
class ApiError(Exception):
    status: int
    message: str
    param: Optional[str] = None
    code: Optional[str] = None

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code)


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    body = {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param, code)
