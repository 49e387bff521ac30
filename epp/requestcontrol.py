"""Request control (GIE's requestcontrol/): what the EPP does with one request, whatever protocol
carries it. The tenant its API key names, the InferenceRequest its headers and body make, its
admission through flow control and the pick, and the accounting once it is over (the endpoint's
in-flight slot, the service flow control charged, the request metrics).

epp/extproc.py is the Envoy ext_proc protocol around it (GIE's handlers/): messages in, header
and body mutations out.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

from kvgate.api.tracing import Span, Tracer
from kvgate.epp.director import Decision, Director
from kvgate.epp.flow_control import FlowGate, Held
from kvgate.epp.metrics import EppMetrics
from kvgate.epp.request import InferenceRequest, PromptPolicy, Tokenizer
from kvgate.epp.tenants import Tenant, TenantRegistry, valid_fairness_id

log = logging.getLogger("kvgate.epp.extproc")

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
# llm-d's per-request latency objectives (milliseconds), read by the predicted-latency scorer.
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
MODEL_REWRITE_HEADER = "x-gateway-model-name-rewrite"

# The response's last bytes kept to read its token usage from (flow control's correction).
USAGE_TAIL_BYTES = 4096
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,9})')


@dataclass
class Exchange:
    """What request control keeps of one request, from its headers to the end of its response."""

    started: float = field(default_factory=time.perf_counter)
    headers: dict[str, str] = field(default_factory=dict)
    request_id: str = ""
    traceparent: str | None = None  # the pick's span, sent on to the engine when tracing
    subset: list[str] | None = None
    tenant: Tenant | None = None  # who the request's API key says sent it (with a tenants file)
    request: InferenceRequest | None = None
    decision: Decision | None = None
    finished: bool = False
    running_label: str = ""  # the model label its running-requests gauge was raised under
    held: Held | None = None  # its place in flow control, once dispatched
    response_tail: bytes = b""  # the end of the response body, where the usage block is


class RequestControl:
    """Tenancy, flow admission, the pick and usage accounting for the protocol handler."""

    # Flow control (kvgate.epp.flow_control); None: every request is picked as it completes.
    flow: FlowGate | None = None

    def __init__(
        self,
        director: Director,
        metrics: EppMetrics | None = None,
        tokenizer: Tokenizer | None = None,
        objectives: dict[str, int] | None = None,
        policy: PromptPolicy | None = None,
        tracer: Tracer | None = None,
        tenants: TenantRegistry | None = None,
    ) -> None:
        self.director = director
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.objectives = objectives or {}
        self.policy = policy or PromptPolicy()
        self.tracer = tracer or Tracer(None, "kvgate-epp")
        # Tenants (a tenants file): every request must carry one's API key; None: no key asked for.
        self.tenants = tenants

    # -- tenancy ----------------------------------------------------------------------------
    def authenticate(self, x: Exchange) -> bool:
        """With tenants, the tenant the request's API key names (in ``x.tenant``); False: none
        does (a 401). The key is checked before the body is read: a stranger's request costs
        no buffering."""
        if self.tenants is None:
            return True
        x.tenant = self.tenants.authenticate(x.headers.get("authorization", ""))
        if x.tenant is None:
            self.count_error(x, "", "", 401)
            return False
        return True

    # -- the request ------------------------------------------------------------------------
    def request(self, x: Exchange, body: dict[str, Any] | None) -> InferenceRequest:
        headers = x.headers
        model = body["model"] if body else ""
        objective = headers.get(OBJECTIVE_HEADER) or None
        if objective and objective in self.objectives:
            priority = self.objectives[objective]
        else:  # no objective names a priority: the tenant's own (0 without tenants)
            priority = x.tenant.priority if x.tenant is not None else 0
        if self.tenants is not None:
            # The API key named the tenant; a client's own fairness header is never believed.
            fairness_id = x.tenant.name if x.tenant is not None else None
        else:  # GIE: the client's fairness header, if it could be a tenant's name
            fairness_id = valid_fairness_id(headers.get(FAIRNESS_HEADER))
        return InferenceRequest(
            request_id=x.request_id,
            model=model,
            target_model=headers.get(MODEL_REWRITE_HEADER) or model,
            body=body,
            objective=objective,
            priority=priority,
            fairness_id=fairness_id,
            slo_ttft_s=_milliseconds(headers.get(SLO_TTFT_HEADER)),
            slo_tpot_s=_milliseconds(headers.get(SLO_TPOT_HEADER)),
            path=headers.get(":path", ""),
            subset=x.subset,
            headers=headers,
            tokenizer=self.tokenizer,
            policy=self._policy(),
        )

    def _policy(self) -> PromptPolicy:
        """The configured policy; the context length, unless configured, is what the pool's
        engines report (GET /v1/models)."""
        if self.policy.max_model_len:
            return self.policy
        return PromptPolicy(self.policy.trust_request_chat_template, self.director.datastore.context_limit())

    def held_back(self, x: Exchange) -> bool:
        """Whether the pick waits for flow control's dispatch (`admit`) rather than being made
        now (`pick`). A request without a body, GET /v1/models, is never held."""
        return self.flow is not None and x.request is not None and x.request.body is not None

    # -- the pick ---------------------------------------------------------------------------
    def begin(self, x: Exchange, body_bytes: int) -> Span:
        """The pick's span, and the request counted."""
        req = x.request
        assert req is not None
        model, target = req.model, req.target_model
        if self.metrics is not None:
            label = self.metrics.model_label
            self.metrics.requests.labels(label(model), label(target)).inc()
            self.metrics.request_sizes.labels(label(model), label(target)).observe(body_bytes)
        return self.tracer.start(
            "kvgate.epp.pick",
            x.headers,
            {
                "kvgate.request_id": x.request_id,
                "gen_ai.request.model": model,
                "kvgate.profile": self.director.profile.name,
            },
        )

    def pick(self, x: Exchange) -> Decision:
        return self.director.pick(x.request)  # type: ignore[arg-type]

    async def admit(self, x: Exchange, span: Span, body_bytes: int) -> Decision:
        """Wait in flow control until the pool has room (or the request's 429/503)."""
        assert self.flow is not None
        held = await self.flow.admit(x.request, body_bytes)  # type: ignore[arg-type]
        assert held.decision is not None
        span.set_attribute("kvgate.flow.queued_ms", 1000 * held.queued_seconds)
        span.set_attribute("kvgate.flow.fairness_id", held.key.fairness_id)
        if held.decision.routed:
            x.held = held
        return held.decision

    def failed(self, x: Exchange, span: Span) -> None:
        """The scheduler raised: logged and counted (the handler answers 500)."""
        req = x.request
        assert req is not None
        log.exception("request %s: scheduler failed", x.request_id)
        self.count_error(x, req.model, req.target_model, 500)
        span.set_attribute("kvgate.pick.status", 500)
        span.end()

    def decided(self, x: Exchange, decision: Decision, span: Span) -> None:
        """Trace, log and count the decision; a routed one is the exchange's from now on."""
        req = x.request
        assert req is not None
        model, target = req.model, req.target_model
        span.set_attributes(
            {
                "kvgate.pick.status": decision.status,
                "kvgate.pick.reason": decision.reason,
                "kvgate.pick.candidates": decision.candidates,
                "kvgate.pick.scheduler_ms": decision.scheduler_seconds * 1000,
                "kvgate.pick.prompt_tokens": len(req.token_ids) if req.body else 0,
            }
        )
        if decision.pd_decision:
            span.set_attribute("kvgate.pick.pd", decision.pd_decision)
        if decision.routed:
            span.set_attribute("kvgate.pick.endpoint", decision.targets[0])
            if decision.prefill:
                span.set_attribute("kvgate.pick.prefill_endpoint", decision.prefill)
            # the engine's span becomes this pick's child: client -> pick -> engine
            x.traceparent = span.traceparent()
        span.end()
        if not decision.routed:
            self.count_error(x, model, target, decision.status)
            log.info("request %s answered %d: %s", x.request_id, decision.status, decision.reason)
            return
        x.decision = decision
        if self.metrics is not None:
            self.metrics.scheduler.observe(decision.scheduler_seconds)
            for name, secs in decision.plugin_seconds.items():
                self.metrics.observe_plugin(name, secs)
            x.running_label = self.metrics.model_label(model)
            self.metrics.running.labels(x.running_label).inc()
            if decision.pd_decision:
                self.metrics.pd_decisions.labels(decision.pd_decision, decision.pd_reason).inc()
        log.debug(
            "request %s model=%s -> %s (%s)",
            x.request_id,
            target,
            decision.targets[0],
            decision.reason,
            extra={"request_id": x.request_id, "endpoint": decision.targets[0]},
        )

    # -- the response and the end -----------------------------------------------------------
    def response_status(self, x: Exchange, status: str) -> None:
        """The engine's response status: anything but 200 counts against it."""
        if status != "200" and x.decision is not None and self.metrics is not None:
            self.metrics.endpoint_errors.labels(self.metrics.pool_name, x.decision.targets[0]).inc()
            req = x.request
            self.count_error(x, req.model if req else "", req.target_model if req else "", int(status or 0))

    def response_chunk(self, x: Exchange, chunk: bytes) -> None:
        """A response body chunk passed by: the in-flight counts are exact from now on, and the
        usage block (which closes the body, or the last SSE event) is kept for flow control."""
        self.director.response_seen()
        if x.held is not None:
            x.response_tail = (x.response_tail + chunk)[-USAGE_TAIL_BYTES:]

    def finish(self, x: Exchange) -> None:
        """The exchange is over (normally or not): release the endpoint's in-flight slot once."""
        if x.finished:
            return
        x.finished = True
        if x.decision is None:
            return
        self.director.finished(x.decision.targets[0])
        if self.flow is not None:
            if x.held is not None:
                self.flow.controller.completed(x.held, completion_tokens(x.response_tail))
            self.flow.poke()  # a slot may have opened
        if self.metrics is not None and x.request is not None:
            req = x.request
            label = self.metrics.model_label
            self.metrics.running.labels(x.running_label).dec()
            self.metrics.duration.labels(label(req.model), label(req.target_model)).observe(
                time.perf_counter() - x.started
            )

    def count_error(self, x: Exchange, model: str, target: str, code: int) -> None:
        if self.metrics is not None:
            label = self.metrics.model_label
            self.metrics.errors.labels(label(model), label(target), str(code)).inc()


def completion_tokens(tail: bytes) -> int | None:
    """The output token count of the response's usage block, when its tail carries one
    (non-streamed bodies always; streams with stream_options.include_usage)."""
    found = _COMPLETION_TOKENS.findall(tail)
    return int(found[-1]) if found else None


def _milliseconds(value: str | None) -> float | None:
    """A header's millisecond count as seconds; anything else (absent, junk, <= 0, inf) is None:
    an objective a client garbles must not change routing."""
    if not value:
        return None
    try:
        ms = float(value)
    except ValueError:
        return None
    return ms / 1000 if 0 < ms < 1e9 else None
