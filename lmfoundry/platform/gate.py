"""The ASGI middleware in front of every app: API key first, then the body-size limit.

Every app (inference, agents, review queue) adds it with its own name, and its replica's __init__
hands it the keys through `configure(name, ...)`. The state lives in this module, keyed by that
name. (Not in the apps' modules: Serve pickles an ingress class by value, with a copy of the
module globals it uses, while the middleware class is imported by name in the replica; a module
both refer to by name is the one place they share. The name keeps two apps in one process apart.)

Only GET /health is open, and it says nothing but "ok". `/docs` and `/redoc` are served by no app;
`/openapi.json` only to a caller with a key, like every other route.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmfoundry.platform.keys import ROLES, Authenticator

OPEN_ROUTES = frozenset({"/health"})
_STATE: dict[str, dict] = {}


def configure(name: str, auth: Authenticator, max_body_bytes: int = 1 << 20) -> None:
    _STATE[name] = {"auth": auth, "max_body_bytes": max_body_bytes}


def authenticator(name: str) -> Authenticator | None:
    state = _STATE.get(name)
    return state["auth"] if state else None


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


_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def invalid_body(status: int):
    """A handler of FastAPI's RequestValidationError: `status` with each field and what is wrong
    with it, never the value sent (FastAPI's own echoes it, and a value JSON cannot write, such
    as a lone surrogate, turned the error itself into a 500)."""

    async def handler(request: Request, exc) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        messages = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in errors
        )
        return error(status, f"invalid request: {messages}", param=param)

    return handler


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Anything else as a JSON error naming only the exception's type (not its text)."""
    return error(500, f"internal error: {type(exc).__name__}", "api_error")


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """An HTTPException (403 from require_role, 413 from the body limit, 404) as an error object."""
    return error(exc.status_code, str(exc.detail), _KINDS.get(exc.status_code, "invalid_request_error"))


def require_role(request: Request, role: str) -> None:
    """Refuse the request (403) unless its key has `role`. Call it first thing in a route."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is unknown; roles are {', '.join(ROLES)}")
    roles = getattr(request.state, "roles", None)
    if roles is None:  # no Gate in front of this route: fail closed
        raise StarletteHTTPException(401, "missing, invalid or revoked API key")
    if role not in roles:
        have = ", ".join(sorted(roles)) or "none"
        raise StarletteHTTPException(403, f"this route needs an API key with the {role!r} role; this key has: {have}")


def _route(scope) -> str:
    """The path inside the app: Serve mounts an app under its route prefix (the root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body over {limit} bytes (max_body_bytes)")


def _unauthorized() -> JSONResponse:
    return error(
        401,
        "missing, invalid or revoked API key: send 'Authorization: Bearer <key>'",
        "authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


class Gate:
    """What every request passes before the app reads it: the API key (so that a caller without
    one learns nothing, not even the request schema; tenant and roles go into `request.state`),
    then the body-size limit, checked on Content-Length before reading and on the bytes as they
    arrive (chunked uploads, lying lengths), so that a huge body never sits in memory. Neither
    check calls receive(): a refused body is never read."""

    def __init__(self, asgi, name: str = "inference"):
        self.asgi, self.name = asgi, name

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.asgi(scope, receive, send)
        if scope["type"] != "http":  # no app serves websockets: refuse before accepting
            return await send({"type": "websocket.close", "code": 1008})
        if _route(scope) in OPEN_ROUTES and scope["method"] in ("GET", "HEAD"):
            return await self.asgi(scope, receive, send)
        state = _STATE.get(self.name)
        if state is None:  # fail closed until the replica has its keys
            return await error(503, "the server is starting", "server_overloaded")(scope, receive, send)
        headers = dict(scope["headers"])
        who = state["auth"].principal(headers.get(b"authorization", b"").decode("latin-1") or None)
        if who is None:
            return await _unauthorized()(scope, receive, send)
        scope.setdefault("state", {}).update(tenant=who.tenant, roles=who.roles, key_id=who.key_id)
        limit = state["max_body_bytes"]
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
