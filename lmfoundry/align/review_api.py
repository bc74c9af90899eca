"""The review queue over HTTP on Ray Serve, behind the same API keys as the inference API. Every
route but /health needs a key with the `reviewer` role (a decision flips a preference pair, so a
customer's `user` key gets 403); the key's tenant is the reviewer.

    GET  /v1/review/items?status=pending&kind=review     GET /v1/review/items/{id}
    POST /v1/review/items/{id}/claim                      POST /v1/review/next {"kind": "audit"}
    POST /v1/review/items/{id}/decide {"decision": "a", "dimensions": {"honesty": "disagree"}}
    POST /v1/review/items/{id}/comments {"body": "..."}   GET  /health (no key)

(No `from __future__ import annotations`: FastAPI reads the handlers' annotations at run time,
and Serve ships this class by value, without the module's globals to resolve strings in.)
"""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmfoundry.align.review import ReviewError, ReviewStore
from lmfoundry.platform import gate
from lmfoundry.platform.keys import ApiKeysConfig, Authenticator
from lmfoundry.platform.text import TextBody

# No /docs or /redoc; the schema only with a key (GET /openapi.json below), as in every app.
app = FastAPI(title="lmfoundry review queue", docs_url=None, redoc_url=None, openapi_url=None)
app.add_middleware(gate.Gate, name="review")
app.add_exception_handler(StarletteHTTPException, gate.http_error)
app.add_exception_handler(RequestValidationError, gate.invalid_body(422))
app.add_exception_handler(Exception, gate.unexpected)


class ReviewServeConfig(ApiKeysConfig):
    db: str = Field(..., description="the queue: a SQLite path or a postgresql:// DSN")
    host: str = "127.0.0.1"
    port: int = Field(8001, ge=1, le=65535)
    route_prefix: str = "/review-queue"


class Decision(TextBody):
    model_config = ConfigDict(extra="forbid")
    decision: str
    dimensions: dict[str, str] = {}


class Comment(TextBody):
    model_config = ConfigDict(extra="forbid")
    body: str


class Next(TextBody):
    model_config = ConfigDict(extra="forbid")
    kind: str | None = None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": status}})


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(app)
class ReviewAPI:
    def __init__(self, db: str, keys_file: str | None, env_digests: list[str], env_roles: list[str] | None = None):
        self.store = ReviewStore(db)
        gate.configure("review", Authenticator(keys_file, env_digests, env_roles=env_roles))

    def _do(self, request: Request, action):
        gate.require_role(request, "reviewer")  # the Gate has checked the key already
        try:
            return action(request.state.tenant)
        except ReviewError as e:
            return _error(e.status, str(e))

    @app.get("/health")
    def health(self):
        return {"status": "ok"}

    @app.get("/openapi.json", include_in_schema=False)
    def openapi_schema(self, request: Request):
        return app.openapi()

    @app.get("/v1/review/items")
    def items(self, request: Request, status: str | None = None, kind: str | None = None):
        return self._do(request, lambda _: {"items": self.store.list(status, kind)})

    @app.get("/v1/review/items/{item_id}")
    def item(self, request: Request, item_id: str):
        return self._do(request, lambda _: self.store.get(item_id))

    @app.post("/v1/review/items/{item_id}/claim")
    def claim(self, request: Request, item_id: str):
        return self._do(request, lambda who: self.store.claim(item_id, who))

    @app.post("/v1/review/next")
    def next(self, request: Request, body: Next):
        return self._do(request, lambda who: self.store.claim_next(who, body.kind) or _error(404, "nothing pending"))

    @app.post("/v1/review/items/{item_id}/decide")
    def decide(self, request: Request, item_id: str, body: Decision):
        return self._do(request, lambda who: self.store.decide(item_id, who, body.decision, body.dimensions))

    @app.post("/v1/review/items/{item_id}/comments")
    def comment(self, request: Request, item_id: str, body: Comment):
        return self._do(request, lambda who: self.store.comment(item_id, who, body.body))

    def check_health(self):
        self.store.list("pending")  # the database answers


def start_review_api(cfg: ReviewServeConfig) -> str:
    """Deploy the queue's API on the connected Ray cluster (beside any other Serve app); its URL."""
    from lmfoundry.platform.keys import digest, env_keys

    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    digests = [digest(k) for k in env_keys(cfg.api_keys_env)]
    if not digests and not cfg.keys_file:
        raise ValueError(f"the review API needs keys: a keys_file or keys in ${cfg.api_keys_env}")
    serve.run(
        ReviewAPI.bind(cfg.db, cfg.keys_file, digests, cfg.api_keys_env_roles),
        name="review-queue",
        route_prefix=cfg.route_prefix,
        blocking=False,
    )
    return f"http://{cfg.host}:{cfg.port}{cfg.route_prefix}"
