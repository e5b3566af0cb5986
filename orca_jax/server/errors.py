"""OpenAI-style error bodies, and handlers that give every failure one (no FastAPI 422s)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orca_jax.server.responses import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    429: "rate_limit_error", 503: "service_unavailable_error",
}
# Union member tags pydantic puts in an error's location; they are not field names.
_PLAIN_UNION_TAGS = frozenset({"str", "constrained-str", "int", "float", "bool", "none", "TextPart", "StreamOptions",
                               "NamedToolChoice"})


def _is_union_tag(part: str) -> bool:
    return part in _PLAIN_UNION_TAGS or "[" in part  # "list[int]", "function-after[...]"


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict:
    error_type = _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
    detail = ErrorDetail(message=message, type=error_type, param=param, code=code)
    return ErrorResponse(error=detail).model_dump()


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status,
                        headers=headers)


class APIError(Exception):
    """Raised anywhere in a handler; becomes an OpenAI-style error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, code=self.code,
                              headers=self.headers)


def _describe_validation_error(error: dict) -> tuple[str, str | None]:
    """(message, param) of one pydantic error as FastAPI reports it."""
    if error.get("type") == "json_invalid":
        return f"malformed JSON body: {error.get('ctx', {}).get('error', 'cannot parse')}", None
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    fields = [part for part in location if not _is_union_tag(part)]
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if error.get("type") == "string_unicode":  # pydantic's words for a lone surrogate ("\ud800"), which JSON allows
        message = "the text is not valid Unicode: it holds a lone surrogate, which UTF-8 cannot encode"
    if not fields:
        if error.get("type") == "value_error":  # a check across fields (a model validator)
            return message, getattr(error.get("ctx", {}).get("error"), "param", None)
        return "the request body must be a JSON object (Content-Type: application/json)", None
    if error.get("type") == "extra_forbidden":
        message = "unknown field; see /docs for the fields this server accepts"
    return f"{'.'.join(fields)}: {message}", fields[0]


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can meet to an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        # A value that fits no member of a union fails once per member; the deepest failure
        # (e.g. messages.0.content.0.type rather than messages.0.content) says most.
        deepest = max(errors, key=lambda e: len(e.get("loc", ())), default=None)
        message, param = _describe_validation_error(deepest) if deepest else ("invalid request", None)
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problems)"
        return error_response(400, message, param=param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), headers=error.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.error("unhandled error", exc_info=error)
        return error_response(500, "internal server error", code="internal_error")
