"""The agent service on Ray Serve: an API deployment (same API keys and tenants as the inference
API) and a deployment of workers that execute runs from the shared store.

    POST /v1/agents/runs {"workflow": NAME, "input": TEXT}  -> {"id"} at once (429 when the tenant is full)
    GET  /v1/agents/runs/{id}                               -> {"id", "state", "steps", "output", ...}
    GET  /v1/agents/runs/{id}/events                        -> the steps as server-sent events
    POST /v1/agents/runs/{id}/approve | reject               (a key with the `approver` role that did not
                                                             start the run; 409 names the decision that won)
    POST /v1/agents/runs/{id}/cancel
Every route but /health needs a key (the Gate checks it before the body is read). A tenant sees
only its own runs (another tenant's are 404).

(No `from __future__ import annotations`: FastAPI reads the handlers' annotations at run time,
and Serve ships these classes by value.)
"""

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ConfigDict, Field
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmfoundry.agents.metrics import AgentMetrics
from lmfoundry.agents.store import TERMINAL, AgentStore
from lmfoundry.agents.worker import AgentWorker
from lmfoundry.agents.workflow import load_workflows
from lmfoundry.platform import gate
from lmfoundry.platform.keys import ApiKeysConfig, Authenticator
from lmfoundry.platform.text import TextBody
from lmfoundry.platform.tracing import TracingConfig

# No /docs or /redoc; the schema only with a key (GET /openapi.json below), as in every app.
app = FastAPI(title="lmfoundry agents", docs_url=None, redoc_url=None, openapi_url=None)
app.add_middleware(gate.Gate, name="agents")
app.add_exception_handler(StarletteHTTPException, gate.http_error)
app.add_exception_handler(RequestValidationError, gate.invalid_body(422))
app.add_exception_handler(Exception, gate.unexpected)


class AgentServeConfig(ApiKeysConfig):
    workflows: str = Field(..., description="a YAML file (or folder) with a 'workflows:' mapping")
    store: str = Field(..., description="the run store: a SQLite path or a postgresql:// DSN")
    workers: int = Field(2, ge=1, description="worker replicas executing runs")
    runs_per_worker: int = Field(16, ge=1)
    per_tenant_running: int = Field(8, ge=1, description="runs of one tenant executing at once, all workers")
    per_tenant_active: int = Field(200, ge=1, description="queued + running runs of one tenant before 429")
    lease_s: float = Field(15.0, gt=0, description="a dead worker's runs resume elsewhere after this")
    route_prefix: str = "/agents"
    py_modules: list[str] = Field(
        [],
        description="local packages (folders) or .py files with custom tools, "
        "shipped to the worker replicas (Ray runtime_env py_modules)",
    )
    tracing: TracingConfig = Field(TracingConfig(), description="where ended runs' spans go (OTLP, JSON lines)")
    env_from_driver: list[str] = Field(
        [],
        description="environment variables copied from the launching process "
        "into the replicas (the model endpoint's API key, the workflows' secrets)",
    )


class StartRun(TextBody):
    model_config = ConfigDict(extra="forbid")
    workflow: str
    input: str = Field(..., min_length=1, max_length=20000)


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        headers=headers,
        content={"error": {"message": message, "type": "invalid_request_error", "code": status}},
    )


def own_run_refusal(run: dict, key_id: str) -> str | None:
    """An approver may not decide the calls of a run its own key started (four eyes)."""
    if run.get("created_by") == key_id:
        return f"key {key_id} started run {run['id']}: a run's own key cannot approve or reject its calls"
    return None


def decision_conflict(run_id: str, decision) -> str:
    """The 409 message: the decision that won, or why there was none to make."""
    if decision.approved is None:
        return f"run {run_id} is {decision.state}, not waiting for an approval"
    verdict = "approved" if decision.approved else "rejected"
    return f"run {run_id} was already {verdict} by {decision.by}; it is {decision.state}"


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class AgentWorkers:
    def __init__(
        self, store: str, workflows: str, runs_per_worker: int, per_tenant_running: int, lease_s: float, tracing: dict
    ):
        self.worker = AgentWorker(
            store,
            load_workflows(workflows),
            runs_per_worker,
            per_tenant_running,
            lease_s,
            tracing=TracingConfig.model_validate(tracing),
        )

    def check_health(self):
        if not self.worker.thread.is_alive():
            raise RuntimeError("the worker loop has stopped")

    def active(self) -> list[str]:
        return sorted(self.worker.active)


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
@serve.ingress(app)
class AgentAPI:
    def __init__(
        self,
        store: str,
        workflows: str,
        keys_file,
        env_digests: list,
        per_tenant_active: int,
        workers,
        env_roles: list | None = None,
    ):
        self.store = AgentStore(store)
        self.workflows = load_workflows(workflows)
        gate.configure("agents", Authenticator(keys_file, env_digests, env_roles=env_roles))
        self.per_tenant_active = per_tenant_active
        self.metrics = AgentMetrics()
        self.workers = workers  # held so the worker deployment is part of this app

    @staticmethod
    def _tenant(request: Request) -> str:
        return request.state.tenant  # set by the Gate, which refused the request if it had no valid key

    def _run(self, request: Request, run_id: str):
        tenant = self._tenant(request)
        run = self.store.get(run_id, tenant)
        if run is None:
            return None, _error(404, f"no run {run_id}")
        return run, None

    @app.get("/health")
    def health(self):
        return {"status": "ok"}

    @app.get("/openapi.json", include_in_schema=False)
    def openapi_schema(self, request: Request):
        return app.openapi()

    @app.post("/v1/agents/runs")
    def start(self, request: Request, body: StartRun):
        tenant = self._tenant(request)
        if body.workflow not in self.workflows:
            return _error(400, f"workflow {body.workflow!r} is unknown; known: {sorted(self.workflows)}")
        if not self.workflows[body.workflow].allows(tenant):
            return _error(403, f"tenant {tenant} may not run workflow {body.workflow!r}")
        run_id = self.store.create(tenant, body.workflow, body.input, request.state.key_id, self.per_tenant_active)
        if run_id is None:
            self.metrics.refused(tenant)
            return _error(
                429,
                f"tenant {tenant} has {self.per_tenant_active} runs queued or running; retry later",
                {"Retry-After": "5"},
            )
        self.metrics.started(body.workflow, tenant)
        return {"id": run_id, "state": "queued"}

    @app.get("/v1/agents/runs/{run_id}")
    def get(self, request: Request, run_id: str):
        run, err = self._run(request, run_id)
        return err or {k: v for k, v in run.items() if k != "tenant"}

    @app.get("/v1/agents/runs/{run_id}/events")
    async def events(self, request: Request, run_id: str):
        run, err = self._run(request, run_id)
        if err:
            return err

        async def stream():
            seen = -1
            while True:
                for step in self.store.steps(run_id, seen):
                    if step["kind"] == "tool" and step["status"] == "started":
                        break  # sent once it is done
                    seen = step["n"]
                    yield f"event: step\ndata: {json.dumps(step, default=str)}\n\n"
                state = self.store.get(run_id)["state"]
                if state in TERMINAL or state == "waiting_approval":
                    yield f"event: state\ndata: {json.dumps({'state': state})}\n\n"
                    return
                await asyncio.sleep(0.2)

        return StreamingResponse(stream(), media_type="text/event-stream")

    def _decide(self, request: Request, run_id: str, approved: bool):
        gate.require_role(request, "approver")  # a tool call's go-ahead is not every key's to give
        run, err = self._run(request, run_id)
        if err:
            return err
        key_id = request.state.key_id
        refusal = own_run_refusal(run, key_id)
        if refusal:
            return _error(403, refusal)
        decision = self.store.decide(run_id, approved, key_id)
        if not decision.won:
            return _error(409, decision_conflict(run_id, decision))
        return {"id": run_id, "state": "queued", "approved": approved, "by": key_id}

    @app.post("/v1/agents/runs/{run_id}/approve")
    def approve(self, request: Request, run_id: str):
        return self._decide(request, run_id, True)

    @app.post("/v1/agents/runs/{run_id}/reject")
    def reject(self, request: Request, run_id: str):
        return self._decide(request, run_id, False)

    @app.post("/v1/agents/runs/{run_id}/cancel")
    def cancel(self, request: Request, run_id: str):
        run, err = self._run(request, run_id)
        if err:
            return err
        if run["state"] in TERMINAL:
            return _error(409, f"run {run_id} has ended ({run['state']})")
        self.store.request_cancel(run_id)
        return {"id": run_id, "state": self.store.get(run_id)["state"], "cancel_requested": True}


def build_agent_app(cfg: AgentServeConfig, env_digests: list[str]):
    import os

    load_workflows(cfg.workflows)  # fail now, not in a replica
    absent = [m for m in cfg.py_modules if not os.path.exists(m)]
    if absent:
        raise ValueError(f"py_modules: {absent} do not exist (give package folders or .py files)")
    missing = [name for name in cfg.env_from_driver if name not in os.environ]
    if missing:
        raise ValueError(f"env_from_driver: {missing} are not set in this environment")
    env = {name: os.environ[name] for name in cfg.env_from_driver}
    runtime_env = {"env_vars": env}
    if cfg.py_modules:
        # A deployment's runtime_env takes URIs only; this is the upload `ray.init(runtime_env=...)`
        # does for a job's py_modules (local folder or .py file -> a gcs:// package).
        from ray._private.runtime_env.py_modules import upload_py_modules_if_needed

        runtime_env = upload_py_modules_if_needed(
            {**runtime_env, "py_modules": [os.path.abspath(m) for m in cfg.py_modules]}, include_gitignore=True
        )
    workers = AgentWorkers.options(
        num_replicas=cfg.workers, ray_actor_options={"num_cpus": 0.1, "runtime_env": runtime_env}
    ).bind(cfg.store, cfg.workflows, cfg.runs_per_worker, cfg.per_tenant_running, cfg.lease_s, cfg.tracing.model_dump())
    return AgentAPI.bind(
        cfg.store, cfg.workflows, cfg.keys_file, env_digests, cfg.per_tenant_active, workers, cfg.api_keys_env_roles
    )
