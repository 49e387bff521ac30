"""The served OpenAPI 3.1 document, generated from the request models the handlers use."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvgate.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}

# path -> (method, summary, request model or None, needs the API key)
_OPERATIONS: list[tuple[str, str, str, type | None, bool]] = [
    ("/v1/completions", "post", "Create a completion (SSE when stream=true)", CompletionRequest, True),
    (
        "/v1/chat/completions",
        "post",
        "Create a chat completion (SSE when stream=true)",
        ChatCompletionRequest,
        True,
    ),
    ("/v1/models", "get", "List the served model", None, True),
    ("/v1/models/{model}", "get", "One served model (404 for another name)", None, True),
    ("/tokenize", "post", "Tokenize a prompt or a chat", TokenizeRequest, True),
    ("/detokenize", "post", "Turn token ids back into text", DetokenizeRequest, True),
    ("/health", "get", "200 while the engine runs and admits requests, else 503", None, False),
    ("/ping", "get", "Same as /health", None, False),
    ("/ping", "post", "Same as /health", None, False),
    ("/version", "get", "Server version", None, False),
    ("/metrics", "get", "Prometheus metrics (vLLM names)", None, False),
]


def openapi_document(version: str) -> dict[str, Any]:
    models: list[type[BaseModel]] = [
        CompletionRequest,
        ChatCompletionRequest,
        TokenizeRequest,
        DetokenizeRequest,
    ]
    _, defs = models_json_schema(
        [(m, "validation") for m in models],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    schemas["Error"] = _ERROR_SCHEMA
    paths: dict[str, Any] = {}
    error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for path, method, summary, model, auth in _OPERATIONS:
        op: dict[str, Any] = {
            "summary": summary,
            "responses": {
                "200": {"description": "OK"},
                "default": {"description": "Error", "content": error_ref},
            },
        }
        if model is not None:
            op["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
                },
            }
        if auth:
            op["security"] = [{"bearer": []}, {}]
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvgate engine (OpenAI-compatible)", "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
