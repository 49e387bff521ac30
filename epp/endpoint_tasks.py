"""One asyncio task per endpoint, for the EPP's per-endpoint loops (the metrics scraper, the
KV-event subscribers): started when the datastore announces an endpoint, restarted when it is
announced again (its settings may have changed), cancelled when it leaves or on close."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class EndpointTasks:
    def __init__(self, kind: str) -> None:
        self.kind = kind  # names the tasks ("scrape 10.0.0.1:8000")
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def replace(self, address: str, run: Callable[[], Coroutine[Any, Any, None]] | None) -> None:
        """Cancel the endpoint's task, if any; with `run`, start it anew (needs a running loop)."""
        task = self._tasks.pop(address, None)
        if task is not None:
            task.cancel()
        if run is not None:
            self._tasks[address] = asyncio.get_running_loop().create_task(
                run(), name=f"{self.kind} {address}"
            )

    def __contains__(self, address: str) -> bool:
        return address in self._tasks

    async def close(self) -> None:
        """Cancel every task and wait for them to finish unwinding."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
