"""The agent worker: takes runs from the store under a lease and advances them step by step (the
model's tool call, the tool, the result back to the model), guarding what the model sees."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import uuid

from lmfoundry.agents import tools as toolkit
from lmfoundry.agents.metrics import AgentMetrics
from lmfoundry.agents.store import TERMINAL, AgentStore, Lease, LeaseLost
from lmfoundry.agents.tracing import RunTracer
from lmfoundry.agents.workflow import (
    INJECTION_PATTERNS,
    UNTRUSTED_NOTE,
    WorkflowConfig,
    build_registry,
    final_answer_spec,
    readings,
)
from lmfoundry.platform.log import get_logger
from lmfoundry.platform.tracing import TracingConfig

logger = get_logger(__name__)

INVALID = "_invalid_reply"  # a model step that was not a complete tool call
RETRIED_STATUSES = (429, 503)  # the model endpoint is overloaded, or its schema compile threads are busy
MODEL_BACKOFF_S, MODEL_BACKOFF_MAX_S = 0.5, 8.0


class Guard:
    """Secrets out, injected instructions withheld."""

    def __init__(self, secret_envs: list[str]):
        self.secrets = [v for v in (os.environ.get(e, "") for e in secret_envs) if len(v) >= 4]
        self.injection = re.compile("|".join(f"(?:{p})" for p in INJECTION_PATTERNS), re.IGNORECASE)

    def redact(self, text: str) -> tuple[str, bool]:
        found = False
        for s in self.secrets:
            if s in text:
                text, found = text.replace(s, "[redacted]"), True
        return text, found

    def injected(self, text: str) -> bool:
        return any(self.injection.search(form) for form in readings(text))

    def injected_across(self, previous: str, current: str) -> bool:
        """A payload split over two tool outputs: the end of one and the start of the next read
        together carry instructions that neither carries alone."""
        tail, head = previous[-2000:], current[:2000]
        return self.injected(f"{tail} {head}") and not self.injected(tail)


def _call_model(
    wf: WorkflowConfig, messages: list[dict], specs: list[dict], force: str | None, deadline: float
) -> tuple[str, dict, dict]:
    """The model's tool call (name, arguments) and the reply's token counts. A 429 or 503 is
    retried with exponential backoff, at most `wf.model_retries` times and never past `deadline`
    (the run's time budget)."""
    from lmfoundry.clients.openai import EndpointError, OpenAIClient

    key = os.environ.get(wf.api_key_env) if wf.api_key_env else None
    attempt = 0
    while True:
        try:
            with OpenAIClient(wf.model_url, wf.model, key) as client:
                reply = client.chat(
                    messages,
                    tools=specs,
                    max_tokens=wf.max_tokens,
                    temperature=0,
                    tool_choice={"type": "function", "function": {"name": force}} if force else "required",
                )
            break
        except EndpointError as e:
            wait = min(MODEL_BACKOFF_S * 2**attempt, MODEL_BACKOFF_MAX_S)
            # overload and busy compile threads pass; anything else (a 400, a 500) would answer the same again
            if e.status in RETRIED_STATUSES and attempt < wf.model_retries and time.time() + wait < deadline:
                attempt += 1
                logger.info(
                    "model endpoint answered %d; retry %d of %d in %.1f s", e.status, attempt, wf.model_retries, wait
                )
                time.sleep(wait)
                continue
            tries = f" (after {attempt} retries)" if attempt else ""
            raise toolkit.ToolError(
                f"the model endpoint answered {e.status}{tries}: {e.text[:200]}", retryable=e.retryable
            ) from None
    usage = {k: (reply.get("usage") or {}).get(k) for k in ("prompt_tokens", "completion_tokens")}
    message = reply["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    if not calls:  # e.g. cut by max_tokens before the call was complete: an invalid step, not an answer
        return (
            INVALID,
            {
                "finish_reason": reply["choices"][0].get("finish_reason"),
                "content": (message.get("content") or "")[:500],
            },
            usage,
        )
    try:
        return calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"] or "{}"), usage
    except json.JSONDecodeError:
        return calls[0]["function"]["name"], {"_unparsed": calls[0]["function"]["arguments"]}, usage


def tool_text(result: toolkit.ToolResult) -> str:
    """A tool call's result as the model is shown it (before redaction and the injection guard)."""
    return json.dumps(result.output, default=str)[:20000] if result.ok else f"error: {result.error}"


def conversation(wf: WorkflowConfig, run: dict, steps: list[dict]) -> list[dict]:
    """The messages the model sees, rebuilt from the written steps (so a resumed run sees what
    the dead worker's model saw)."""
    messages = [
        {"role": "system", "content": f"{wf.system_prompt}\n\n{UNTRUSTED_NOTE}"},
        {"role": "user", "content": run["input"]},
    ]
    call_id = None
    for s in steps:
        if s["kind"] == "model" and s["tool"] != "final_answer":
            call_id = f"call_{s['n']}"
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": s["tool"], "arguments": json.dumps(s["arguments"])},
                        }
                    ],
                }
            )
        elif s["kind"] == "tool" and s["status"] == "done":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": f"<untrusted-tool-output>\n{s['model_view']}\n</untrusted-tool-output>",
                }
            )
    return messages


def protect_process_secrets() -> None:
    """Make this process non-dumpable (Linux prctl PR_SET_DUMPABLE 0): its /proc files, among them
    `environ`, which holds the secrets the worker was started with, become root's, so code the
    python tool runs as the same user cannot read them through /proc/<parent>/environ."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_dumpable = 4
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed: the worker's secrets would be readable")


def needs_approval(wf: WorkflowConfig, registry: toolkit.ToolRegistry, tool: str) -> bool:
    """Listed in approval_required, or a tool with side effects the workflow did not explicitly
    let run unattended (`without_approval`): side effects need a human by default."""
    if tool in wf.approval_required:
        return True
    return registry.get(tool).side_effects and tool not in wf.without_approval


def advance(store: AgentStore, wf: WorkflowConfig, registry: toolkit.ToolRegistry, lease: Lease, lease_s: float) -> str:
    """Run the leased run from its last written step until it ends or waits for approval; the
    state it is left in. Raises `LeaseLost` (from the first write it tries) once another worker
    has taken the run over: no tool is called after that."""
    protect_process_secrets()  # before any tool runs: sandboxed code must not read this process's environ
    try:
        return _advance(store, wf, registry, lease, lease_s)
    except LeaseLost:
        logger.warning("run %s: lease %s lost; %s stops working on it", lease.run_id, lease.token, lease.worker)
        return "lease lost"


def _refuse(store: AgentStore, lease, n: int, tool: str, arguments, why: str, model_view: str, shown=None) -> None:
    """A tool call the service refused: recorded as done, not ok, with what the model is told."""
    step = {"tool": tool, "arguments": arguments if shown is None else shown, "ok": False}
    store.write_step(lease, n, "tool", "done", {**step, "refused": why, "model_view": model_view})


def _advance(store: AgentStore, wf: WorkflowConfig, registry: toolkit.ToolRegistry, lease: Lease, lease_s: float):
    run_id, worker = lease.run_id, lease.worker
    guard = Guard(wf.secret_envs())
    specs = registry.specs(list(wf.tools)) + [final_answer_spec(wf.max_answer_chars)]
    while True:
        run = store.get(run_id)
        steps = run["steps"]
        if run["cancel_requested"]:
            store.set_state(lease, "cancelled")
            return "cancelled"
        elapsed = time.time() - run["created_at"]
        model_steps = sum(s["kind"] == "model" for s in steps)
        last = steps[-1] if steps else None
        n = last["n"] + 1 if last else 0
        if not store.renew(lease, lease_s):
            raise LeaseLost(f"run {run_id}: lease {lease.token} of {worker} could not be renewed")
        pending_call = last is not None and last["kind"] in ("model", "approval") and last.get("tool") != "final_answer"
        if last is not None and last["kind"] == "tool" and last["status"] == "started":
            pending_call, n = True, last["n"]  # a call that was under way when a worker died
        if pending_call:
            call = next(s for s in reversed(steps) if s["kind"] == "model")
            tool, arguments = call["tool"], call["arguments"]
            approval = last if last["kind"] == "approval" else None
            if tool == INVALID:
                _refuse(
                    store,
                    lease,
                    n,
                    tool,
                    arguments,
                    "not a complete tool call",
                    "error: your reply was not a complete tool call; call one tool, briefly",
                )
                continue
            if tool not in wf.tools:
                _refuse(store, lease, n, tool, arguments, "not allowed", f"error: tool {tool!r} is not allowed here")
                continue
            if approval is None and needs_approval(wf, registry, tool):
                store.await_approval(lease, n, {"tool": tool, "arguments": arguments})
                return "waiting_approval"
            if approval is not None and not approval.get("approved"):
                _refuse(
                    store,
                    lease,
                    n,
                    tool,
                    arguments,
                    "rejected by a reviewer",
                    "error: a human reviewer rejected this tool call",
                )
                continue
            if guard.redact(json.dumps(arguments))[1]:
                _refuse(
                    store,
                    lease,
                    n,
                    tool,
                    arguments,
                    "a secret in the arguments",
                    "error: the call would send a secret out; refused",
                    shown="[redacted]",
                )
                continue
            key = f"{run_id}:{n}"
            store.write_step(lease, n, "tool", "started", {"tool": tool, "arguments": arguments, "worker": worker}, key)
            result = registry.call(tool, arguments, idempotency_key=key, tenant=run["tenant"])
            raw = tool_text(result)
            view, leaked = guard.redact(raw)
            # this output alone, and with the previous tool output: a payload split across two
            previous = next((str(s.get("output") or "") for s in reversed(steps) if s["kind"] == "tool"), "")
            flagged = guard.injected(view) or guard.injected_across(previous, view)
            if flagged:
                view = "[tool output withheld: it contained instructions (possible prompt injection)]"
            store.write_step(
                lease,
                n,
                "tool",
                "done",
                {
                    "tool": tool,
                    "arguments": arguments,
                    "ok": result.ok,
                    "output": guard.redact(raw)[0],
                    "error": result.error,
                    "attempts": result.attempts,
                    "model_view": view,
                    "injection_flagged": flagged,
                    "secret_redacted": leaked,
                    "worker": worker,
                },
                key,
                round(result.seconds, 4),
            )
            continue
        if last is not None and last["kind"] == "model" and last["tool"] == "final_answer":
            answer, _ = guard.redact(str(last["arguments"].get("answer", "")))
            store.set_state(lease, "succeeded", output=answer)
            return "succeeded"
        if model_steps >= wf.max_steps or elapsed > wf.max_seconds:
            why = (
                f"budget reached: {model_steps} model steps"
                if model_steps >= wf.max_steps
                else f"budget reached: {elapsed:.0f} s"
            )
            store.set_state(lease, "failed", error=why)
            return "failed"
        started = time.perf_counter()
        force = wf.first_tool if model_steps == 0 else None
        if wf.answer_on_last_step and model_steps == wf.max_steps - 1:
            force = "final_answer"  # what the run has found so far, rather than nothing
        try:
            deadline = run["created_at"] + wf.max_seconds
            tool, arguments, usage = _call_model(wf, conversation(wf, run, steps), specs, force, deadline)
        except toolkit.ToolError as e:
            store.set_state(lease, "failed", error=str(e))
            return "failed"
        arguments = json.loads(guard.redact(json.dumps(arguments))[0])
        store.write_step(
            lease,
            n,
            "model",
            "done",
            {"tool": tool, "arguments": arguments, "worker": worker, **usage},
            seconds=round(time.perf_counter() - started, 4),
        )


class AgentWorker:
    """Claims runnable runs and advances them, up to `concurrency` at once, until stopped.
    Several workers (Serve replicas) share one store; per-tenant limits hold across all."""

    def __init__(
        self,
        store_dsn: str,
        workflows: dict[str, WorkflowConfig],
        concurrency: int = 8,
        per_tenant: int = 4,
        lease_s: float = 30.0,
        poll_s: float = 0.1,
        tracing: TracingConfig | None = None,
    ):
        self.store = AgentStore(store_dsn)
        self.workflows = workflows
        self.registries = {name: build_registry(wf) for name, wf in workflows.items()}
        self.tracer = RunTracer(tracing) if tracing and tracing.exporter != "none" else None
        self.metrics = AgentMetrics()
        self.id = f"worker-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # the process, for operators and fault drills
        self.concurrency, self.per_tenant, self.lease_s, self.poll_s = concurrency, per_tenant, lease_s, poll_s
        self.active: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=self.id, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                room = len(self.active) < self.concurrency
            lease = self.store.claim(self.id, self.lease_s, self.per_tenant) if room else None
            if lease is None:
                self._stop.wait(self.poll_s)
                continue
            with self._lock:
                self.active.add(lease.run_id)
                self.metrics.active(self.id, len(self.active))
            threading.Thread(target=self._run, args=(lease,), daemon=True).start()

    def _run(self, lease: Lease) -> None:
        run_id = lease.run_id
        try:
            ended = self._advance(lease)
            if ended in TERMINAL:
                run = self.store.get(run_id)
                self.metrics.ended(run)
                if self.tracer:
                    try:
                        self.tracer.export(run)
                    except Exception:  # a collector that is down costs the trace, never the run
                        logger.exception("could not export the trace of run %s", run_id)
        finally:
            with self._lock:
                self.active.discard(run_id)
                self.metrics.active(self.id, len(self.active))

    def _advance(self, lease: Lease) -> str:
        try:
            run = self.store.get(lease.run_id)
            wf = self.workflows.get(run["workflow"])
            if wf is None:
                self.store.set_state(lease, "failed", error=f"unknown workflow {run['workflow']!r}")
                return "failed"
            return advance(self.store, wf, self.registries[wf.name], lease, self.lease_s)
        except Exception as e:  # a run's failure ends that run, never the worker
            logger.exception("run %s failed", lease.run_id)
            try:
                self.store.set_state(lease, "failed", error=f"{type(e).__name__}: {e}")
            except LeaseLost:  # another worker has the run now: its state is that worker's to set
                return "lease lost"
            return "failed"

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()
        if self.tracer:
            self.tracer.shutdown()
