"""The Starlette app: OpenAI's Files and Batches endpoints over the store, the worker in its lifespan."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvgate.batch import objects
from kvgate.batch.blobs import Blobs
from kvgate.batch.jsonl import ENDPOINTS, InputError, parse_input
from kvgate.batch.metrics import BatchMetrics
from kvgate.batch.store import (
    CANCELLABLE,
    CANCELLING,
    BatchRow,
    FileRow,
    Store,
    TransitionError,
    new_id,
    owner_of,
)
from kvgate.batch.worker import Worker

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_METADATA_PAIRS = 16


@dataclass
class Limits:
    max_file_bytes: int = MAX_FILE_BYTES
    max_lines: int = 50_000


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def build_app(
    store: Store,
    blobs: Blobs,
    worker: Worker | None,
    limits: Limits | None = None,
    tenant_of: Callable[[str | None], str | None] | None = None,
) -> Starlette:
    """``tenant_of``: with tenants, the tenant an Authorization header names (None: 401); a
    tenant's files and batches are its own, whichever of its keys made them. Without it every
    key (and no key) owns what it made."""
    lim = limits or Limits()
    registry = (worker.metrics if worker is not None else BatchMetrics(store)).registry

    def owner_of_auth(auth: str | None) -> str:
        if tenant_of is None:
            return owner_of(auth)
        tenant = tenant_of(auth)
        if tenant is None:
            raise ApiError(
                401,
                "Incorrect API key provided: send a tenant's key as Authorization: Bearer KEY",
                code="invalid_api_key",
            )
        return owner_of("tenant " + tenant)

    def endpoint(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
                owner_of_auth(request.headers.get("authorization"))  # 401 before anything is read
                return await fn(request)
            except ApiError as exc:
                return objects.error_response(exc.status, exc.message, code=exc.code, param=exc.param)
            except Exception:
                log.exception("%s %s failed", request.method, request.url.path)
                return objects.error_response(500, "internal error in the batch service")

        return wrapped

    def owner(request: Request) -> str:
        return owner_of_auth(request.headers.get("authorization"))

    def file_or_404(request: Request) -> FileRow:
        file_id = request.path_params["file_id"]
        row = store.get_file(file_id, owner(request))
        if row is None:
            raise ApiError(404, f"No such File object: {file_id}", param="id")
        return row

    def batch_or_404(request: Request) -> BatchRow:
        batch_id = request.path_params["batch_id"]
        row = store.get_batch(batch_id, owner(request))
        if row is None:
            raise ApiError(404, f"No batch found with id '{batch_id}'.", param="batch_id")
        return row

    def batch_json(row: BatchRow) -> JSONResponse:
        return JSONResponse(objects.batch_object(row, store.counts(row.id)))

    def limit_param(request: Request) -> int:
        raw = request.query_params.get("limit", "20")
        try:
            n = int(raw)
        except ValueError:
            raise ApiError(400, "limit must be an integer", param="limit") from None
        if not 1 <= n <= 100:
            raise ApiError(400, "limit must be between 1 and 100", param="limit")
        return n

    async def create_file(request: Request) -> Response:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > lim.max_file_bytes + 64 * 1024:
            raise ApiError(413, f"the file is larger than {lim.max_file_bytes} bytes", param="file")
        try:
            form = await request.form(max_files=1, max_fields=8)
        except Exception:
            raise ApiError(400, "expected a multipart/form-data body with fields file and purpose") from None
        try:
            purpose = form.get("purpose")
            upload = form.get("file")
            if purpose != "batch":
                raise ApiError(400, "purpose must be 'batch' (the only purpose served here)", param="purpose")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "a file is required", param="file")
            data = await upload.read(lim.max_file_bytes + 1)
            filename = (upload.filename or "input.jsonl")[:512]
        finally:
            await form.close()
        if len(data) > lim.max_file_bytes:
            raise ApiError(413, f"the file is larger than {lim.max_file_bytes} bytes", param="file")
        try:
            parse_input(data, max_lines=lim.max_lines)
        except InputError as exc:
            raise ApiError(
                400, f"Line {exc.line}: {exc.message}", code="invalid_file", param=exc.param
            ) from None
        file_id = new_id("file-")
        path = blobs.write(file_id, data)
        row = FileRow(
            id=file_id,
            owner=owner(request),
            filename=filename,
            purpose="batch",
            bytes=len(data),
            created_at=int(time.time()),
            path=str(path),
        )
        store.add_file(row)
        return JSONResponse(objects.file_object(row))

    async def get_file(request: Request) -> Response:
        return JSONResponse(objects.file_object(file_or_404(request)))

    async def file_content(request: Request) -> Response:
        row = file_or_404(request)
        return Response(blobs.read(row.id), media_type="application/octet-stream")

    async def list_files(request: Request) -> Response:
        limit = limit_param(request) if "limit" in request.query_params else 100
        rows = store.list_files(
            owner(request), request.query_params.get("purpose"), request.query_params.get("after"), limit + 1
        )
        data = [objects.file_object(r) for r in rows[:limit]]
        return JSONResponse(objects.list_object(data, len(rows) > limit))

    async def delete_file(request: Request) -> Response:
        row = store.delete_file(request.path_params["file_id"], owner(request))
        if row is None:
            raise ApiError(404, f"No such File object: {request.path_params['file_id']}", param="id")
        blobs.delete(row.id)
        return JSONResponse({"id": row.id, "object": "file", "deleted": True})

    async def create_batch(request: Request) -> Response:
        try:
            doc = await request.json()
        except ValueError:
            raise ApiError(400, "the body must be a JSON object") from None
        if not isinstance(doc, dict):
            raise ApiError(400, "the body must be a JSON object")
        endpoint_ = doc.get("endpoint")
        if endpoint_ not in ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        window = doc.get("completion_window")
        if window not in COMPLETION_WINDOWS:
            raise ApiError(400, "completion_window must be '24h'", param="completion_window")
        metadata = doc.get("metadata")
        if metadata is not None and (
            not isinstance(metadata, dict)
            or len(metadata) > MAX_METADATA_PAIRS
            or not all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items()
            )
        ):
            raise ApiError(
                400, "metadata: at most 16 string pairs (keys 64, values 512 characters)", param="metadata"
            )
        file_id = doc.get("input_file_id")
        if not isinstance(file_id, str):
            raise ApiError(400, "input_file_id is required", param="input_file_id")
        auth = request.headers.get("authorization")
        f = store.get_file(file_id, owner_of_auth(auth))
        if f is None:
            raise ApiError(404, f"No such File object: {file_id}", param="input_file_id")
        if f.purpose != "batch":
            raise ApiError(400, "the input file's purpose must be 'batch'", param="input_file_id")
        lines = parse_input(blobs.read(f.id), max_lines=lim.max_lines)
        wrong = next((line for line in lines if line.url != endpoint_), None)
        if wrong is not None:
            raise ApiError(
                400,
                f"Line {wrong.index + 1}: url {wrong.url} does not match the batch's endpoint {endpoint_}",
                code="invalid_file",
                param="input_file_id",
            )
        now = int(time.time())
        row = BatchRow(
            id=new_id("batch_"),
            owner=owner_of_auth(auth),
            authorization=auth,
            input_file_id=file_id,
            endpoint=endpoint_,
            completion_window=window,
            metadata_json=json.dumps(metadata) if metadata is not None else None,
            status="validating",
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS[window],
        )
        store.create_batch(row, lines)
        if worker is not None:
            worker.wake()
        return batch_json(row)

    async def get_batch(request: Request) -> Response:
        return batch_json(batch_or_404(request))

    async def list_batches(request: Request) -> Response:
        limit = limit_param(request)
        rows = store.list_batches(owner(request), request.query_params.get("after"), limit + 1)
        data = [objects.batch_object(r, store.counts(r.id)) for r in rows[:limit]]
        return JSONResponse(objects.list_object(data, len(rows) > limit))

    async def cancel_batch(request: Request) -> Response:
        row = batch_or_404(request)
        if row.status == CANCELLING:
            return batch_json(row)
        try:
            row = store.transition(row.id, CANCELLABLE, CANCELLING)
        except TransitionError:
            raise ApiError(409, f"Cannot cancel a batch with status '{row.status}'.") from None
        if worker is not None:
            worker.wake()
        return batch_json(row)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(_: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, _exc: Exception) -> Response:
        return objects.error_response(404, f"Unknown request URL: {request.method} {request.url.path}")

    async def method_not_allowed(request: Request, _exc: Exception) -> Response:
        return objects.error_response(405, f"Method {request.method} not allowed on {request.url.path}")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        import asyncio

        task = asyncio.create_task(worker.run()) if worker is not None else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            store.close()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/files", endpoint(create_file), methods=["POST"]),
        Route("/v1/files", endpoint(list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", endpoint(get_file), methods=["GET"]),
        Route("/v1/files/{file_id}", endpoint(delete_file), methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", endpoint(file_content), methods=["GET"]),
        Route("/v1/batches", endpoint(create_batch), methods=["POST"]),
        Route("/v1/batches", endpoint(list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", endpoint(get_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", endpoint(cancel_batch), methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: method_not_allowed},
    )
