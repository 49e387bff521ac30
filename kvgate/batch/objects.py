"""The OpenAI-shaped JSON of files, batches, result lines and errors."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from kvgate.batch.store import EXPIRED, BatchRow, Counts, FileRow, LineRow


def file_object(row: FileRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": row.created_at,
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def batch_object(row: BatchRow, counts: Counts) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": json.loads(row.errors_json) if row.errors_json else None,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": row.created_at,
        "in_progress_at": row.in_progress_at,
        "expires_at": row.expires_at,
        "finalizing_at": row.finalizing_at,
        "completed_at": row.completed_at,
        "failed_at": row.failed_at,
        # (no column of its own: a batch expires at the worker's first look past expires_at)
        "expired_at": row.expires_at if row.status == EXPIRED else None,
        "cancelling_at": row.cancelling_at,
        "cancelled_at": row.cancelled_at,
        "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
        "metadata": json.loads(row.metadata_json) if row.metadata_json else None,
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def output_line(line: LineRow) -> dict[str, Any]:
    """One line of the output or error file (OpenAI's batch output format)."""
    response = None
    if line.status_code is not None:
        try:
            body: Any = json.loads(line.result) if line.result else None
        except ValueError:
            body = line.result
        response = {"status_code": line.status_code, "request_id": line.request_id or "", "body": body}
    error = None
    if line.error is not None:
        code, _, message = line.error.partition(": ")
        error = {"code": code, "message": message or code}
    return {
        "id": f"batch_req_{line.id:024x}",
        "custom_id": line.custom_id,
        "response": response,
        "error": error,
    }


def error_response(
    status: int, message: str, *, code: str | None = None, param: str | None = None, etype: str | None = None
) -> JSONResponse:
    kind = etype or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status
    )
