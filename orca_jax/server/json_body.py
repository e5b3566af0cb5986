"""Request bodies as JSON: UTF-8 only (RFC 8259 section 8.1), and parsed off the event loop when large.

Starlette's Request.json() hands the body's bytes to json.loads, which guesses UTF-16 or UTF-32 from
its first bytes; the nesting check (middleware.BodyLimitMiddleware) reads bytes as UTF-8, so a UTF-16
body passed it and then nested as deep as it liked (a RecursionError, a 500). Here, as there, the text
is UTF-8 or refused, so what was measured is what is parsed. A body over PARSE_OFF_LOOP_BYTES is
parsed on a worker thread (by orjson, 5x faster on numbers): a 2 MB one takes json.loads ~10-90 ms,
which every other client would otherwise wait for. The routes get this through FastAPI's documented seam, a custom APIRoute.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute

if TYPE_CHECKING:
    from fastapi._compat import ModelField

# Smaller bodies parse in well under a millisecond: a thread hop would cost more than it saves.
PARSE_OFF_LOOP_BYTES = 64 * 1024
_BOM = "\ufeff"


def utf8_problem(body: bytes) -> str | None:
    """Why `body` is not JSON text as RFC 8259 allows it between systems (UTF-8, no byte order mark),
    or None. Never quotes the body."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"the request body must be UTF-8 (RFC 8259); byte {error.start} is not"
    if text.startswith(_BOM):
        return "the request body starts with a byte order mark, which JSON text must not (RFC 8259)"
    return None


def parse(body: bytes) -> Any:
    """json.loads of UTF-8 text only (json.JSONDecodeError otherwise, which FastAPI answers 400)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise json.JSONDecodeError("the body is not UTF-8 text", body.decode("latin-1"), error.start) from None
    return json.loads(text)


def parse_large(body: bytes) -> Any:
    """parse() for a large body, by orjson first: 2.5 MB of token ids in 20 ms against json.loads' 92,
    and it holds the GIL throughout. What orjson refuses (NaN, a lone surrogate: Python's parser takes
    them, and the body's validators name the field) goes to parse() for the same answer as ever."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return parse(body)


class JSONBodyRequest(Request):
    """A Request whose json() is `parse`; for a large body, on a worker thread, and validated there too
    against `body_field` (the route's): the route then gets the body model itself, which FastAPI's
    own validation hands through untouched (a model instance is not validated again), so a body of
    500,000 token ids is not walked on the loop either. A body that fails there is handed on as JSON,
    for FastAPI to refuse with its usual error."""

    body_field: ModelField | None = None

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = (await asyncio.to_thread(self._parse_and_validate, body) if len(body) > PARSE_OFF_LOOP_BYTES
                          else parse(body))
        return self._json

    def _parse_and_validate(self, body: bytes) -> Any:
        value = parse_large(body)
        if self.body_field is None:
            return value
        validated, errors = self.body_field.validate(value, {}, loc=("body",))
        return value if errors else validated


class JSONBodyRoute(APIRoute):
    """An APIRoute whose handler reads the body through JSONBodyRequest (APIRouter(route_class=...))."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        body_field = self.body_field

        async def with_json_body(request: Request) -> Response:
            request = JSONBodyRequest(request.scope, request.receive)
            request.body_field = body_field
            return await handler(request)

        return with_json_body
