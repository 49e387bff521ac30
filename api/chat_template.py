"""Render a model's Jinja chat template the way Hugging Face `apply_chat_template` does.

Chat templates are code, so they run in Jinja's immutable sandbox. The environment mirrors
transformers' (trim_blocks, lstrip_blocks, loop controls, a `tojson` that does not HTML-escape,
`raise_exception`, `strftime_now`, the `{% generation %}` tag) so a prompt rendered here is
byte-identical to the one transformers renders.

Two levels of trust:
- the model's own template (from its files, chosen by whoever deployed it) renders in-process,
  with cheap guards (no `'x' * 10**9`, Jinja's 100,000-item range cap);
- a template sent in a request can cost anything (a 177-byte template once took 32 s and 4 GB),
  so servers refuse it unless started with `--trust-request-chat-template`, and even then
  `render_untrusted_chat_template` renders it in a short-lived child process with hard limits on
  CPU time, wall time, address space and output size, so no request can hurt the server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# vLLM's flag name: a server only runs templates sent in requests when started with it.
from kvgate.api.cli_args import REQUEST_TEMPLATE_FLAG

__all__ = [
    "REQUEST_TEMPLATE_FLAG",
    "ChatTemplateError",
    "UntrustedTemplateLimits",
    "compile_chat_template",
    "render_chat_template",
    "render_untrusted_chat_template",
    "request_chat_template",
]

# One `*` or `**` in a template may not build a value larger than this (characters / items).
MAX_OPERATOR_RESULT = 1_000_000


class ChatTemplateError(ValueError):
    """The template rejected the conversation (e.g. via `raise_exception`) or failed to render."""


class _GuardedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus: `*` and `**` cannot build huge values (`'x' * 10**9`)."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * n > MAX_OPERATOR_RESULT:
                        raise SecurityError(f"'*' would build a value of {len(seq) * n:,} items")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * max(abs(left), 2).bit_length() > 4096:
                raise SecurityError("'**' result too large")
        return super().call_binop(context, operator, left, right)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render its body."""

    tags = {"generation"}  # noqa: RUF012  (jinja reads this class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = _GuardedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from e


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    special_tokens: dict[str, str] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` with the template; `special_tokens` (bos_token, eos_token...) and `extra`
    kwargs are visible to the template as variables, as in transformers."""
    for message in messages:
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be objects, got {message!r}")
    template = compile_chat_template(source)
    variables: dict[str, Any] = {**(special_tokens or {}), **extra}
    try:
        return template.render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except (jinja2.exceptions.TemplateError, OverflowError) as e:  # OverflowError: range() cap
        raise ChatTemplateError(str(e)) from e
    except (TypeError, ValueError, LookupError, ArithmeticError, RecursionError) as e:
        # the template's own code failed on this conversation (e.g. `{{ messages[5] }}`)
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from e


def request_chat_template(body: dict[str, Any]) -> str | None:
    """The chat template a request carries, top-level (vLLM) or in `chat_template_kwargs`."""
    template = body.get("chat_template")
    kwargs = body.get("chat_template_kwargs")
    if template is None and isinstance(kwargs, dict):
        template = kwargs.get("chat_template")
    if template is None:
        return None
    if not isinstance(template, str):
        raise ChatTemplateError("chat_template must be a string")
    return template


@dataclass(frozen=True)
class UntrustedTemplateLimits:
    """Hard limits on rendering a template that came with a request."""

    timeout_s: float = 2.0  # wall time of the render itself (CPU time is capped alike)
    max_memory_bytes: int = 256 * 1024 * 1024  # address space the render may add
    max_output_chars: int = 4 * 1024 * 1024
    start_timeout_s: float = 20.0  # the child interpreter's start-up, on a loaded machine


_WORKER = "kvgate.api.template_worker"


def render_untrusted_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    limits: UntrustedTemplateLimits | None = None,
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """Render a request-supplied template in a child process under hard limits.

    Blocking (it waits for the child): call it from a worker thread, never an event loop.
    Raises ChatTemplateError with a message fit for the client on any failure or limit hit.
    """
    limits = limits or UntrustedTemplateLimits()
    job = json.dumps(
        {
            "source": source,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "variables": variables,
            "timeout_s": limits.timeout_s,
            "max_memory_bytes": limits.max_memory_bytes,
            "max_output_chars": limits.max_output_chars,
        },
        default=str,
    ).encode()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", _WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd="/",
    )
    try:
        out, _ = proc.communicate(job, timeout=limits.start_timeout_s + limits.timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise ChatTemplateError(
            f"the request's chat template did not finish rendering within {limits.timeout_s:g} s"
        ) from None
    try:
        result = json.loads(out)
    except ValueError:
        # killed by its CPU or memory limit before it could answer
        raise ChatTemplateError(
            "the request's chat template exceeded its time or memory limit "
            f"({limits.timeout_s:g} s, {limits.max_memory_bytes // 2**20} MiB)"
        ) from None
    if "error" in result:
        raise ChatTemplateError(str(result["error"]))
    return str(result["text"])


def _render_job(job: dict[str, Any]) -> dict[str, Any]:
    """The child's side of `render_untrusted_chat_template` (see template_worker)."""
    deadline = time.monotonic() + float(job["timeout_s"])
    try:
        template = compile_chat_template(job["source"])
        pieces: list[str] = []
        size = 0
        cap = int(job["max_output_chars"])
        variables = dict(job["variables"])
        for piece in template.generate(
            messages=job["messages"],
            add_generation_prompt=job["add_generation_prompt"],
            tools=variables.pop("tools", None),  # the request's tools travel with the variables
            documents=None,
            **variables,
        ):
            size += len(piece)
            if size > cap:
                return {"error": f"the request's chat template rendered more than {cap:,} characters"}
            if time.monotonic() > deadline:
                return {"error": f"the request's chat template took longer than {job['timeout_s']:g} s"}
            pieces.append(piece)
        return {"text": "".join(pieces)}
    except ChatTemplateError as e:
        return {"error": str(e)}
    except MemoryError:
        return {"error": "the request's chat template exceeded its memory limit"}
    except (jinja2.exceptions.TemplateError, OverflowError) as e:
        return {"error": f"cannot render the request's chat template: {e}"}
    except Exception as e:  # the template's own code failed; the message is about the template
        return {"error": f"cannot render the request's chat template: {type(e).__name__}: {e}"}
