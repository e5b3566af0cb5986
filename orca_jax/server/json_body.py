"""Request bodies as JSON: UTF-8 only (RFC 8259 section 8.1), and parsed off the event loop when large.

Starlette's Request.json() hands the body's bytes to json.loads, which guesses UTF-16 or UTF-32 from
its first bytes; the nesting check (middleware.BodyLimitMiddleware) reads bytes as UTF-8, so a UTF-16
body passed it and then nested as deep as it liked (a RecursionError, a 500). Here, as there, the text
is UTF-8 or refused, so what was measured is what is parsed. A body over PARSE_OFF_LOOP_BYTES is
parsed on a worker thread: a 2 MB one takes json.loads ~20-40 ms, which every other client would
otherwise wait for. The routes get this through FastAPI's documented seam, a custom APIRoute.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

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


class JSONBodyRequest(Request):
    """A Request whose json() is `parse`, on a worker thread for a large body."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(parse, body) if len(body) > PARSE_OFF_LOOP_BYTES else parse(body)
        return self._json


class JSONBodyRoute(APIRoute):
    """An APIRoute whose handler reads the body through JSONBodyRequest (APIRouter(route_class=...))."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_json_body(request: Request) -> Response:
            return await handler(JSONBodyRequest(request.scope, request.receive))

        return with_json_body
