"""The ASGI middleware in front of the API: API key first, then the body-size limit.

Its state lives in this module, set by the replica's __init__ through `configure`. (Not in
api.py: Serve pickles the ingress class by value, with a copy of the module globals it uses,
while the middleware class is imported by name in the replica; a module both refer to by name
is the one place they share.)
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmfoundry.platform.keys import Authenticator

_STATE: dict = {"auth": None, "max_body_bytes": 1 << 20}


def configure(auth: Authenticator, max_body_bytes: int) -> None:
    _STATE["auth"], _STATE["max_body_bytes"] = auth, max_body_bytes


def error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        headers=headers,
        content={"error": {"message": message, "type": kind, "param": param, "code": code}},
    )


def _route(scope) -> str:
    """The path inside the app: Serve mounts an app under its route prefix (the root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body over {limit} bytes (max_body_bytes)")


class Gate:
    """What every request passes before FastAPI reads it: the API key (so that a caller without
    one learns nothing, not even the request schema; the tenant goes into `request.state`), then
    the body-size limit, checked on Content-Length before reading and on the bytes as they arrive
    (chunked uploads), so that a huge body never sits in memory."""

    def __init__(self, asgi):
        self.asgi = asgi

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _route(scope) == "/health":
            return await self.asgi(scope, receive, send)
        if _STATE["auth"] is None:  # fail closed until the replica has its keys
            return await error(503, "the server is starting", "server_overloaded")(scope, receive, send)
        headers = dict(scope["headers"])
        who = _STATE["auth"].principal(headers.get(b"authorization", b"").decode("latin-1") or None)
        if who is None:
            reply = error(
                401,
                "missing, invalid or revoked API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                code="invalid_api_key",
            )
            return await reply(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = who.tenant
        limit = _STATE["max_body_bytes"]
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            reply = (
                error(413, str(BodyTooLarge(limit).detail), code="request_too_large")
                if declared.isdigit()
                else error(400, f"invalid Content-Length {declared.decode(errors='replace')!r}")
            )
            return await reply(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit)  # an HTTPException: FastAPI's body reader passes it on
            return message

        await self.asgi(scope, counted, send)
