"""The embedding session for asyncio (``fedgrid.client.session.aconnect``): each blocking call
of a ``Session`` runs in a worker thread of its own, so the event loop never blocks."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, TypeVar

from fedgrid.client.api import EvaluateOutput, FitOutput
from fedgrid.client.session_host import Task
from fedgrid.client.task_feed import TaskReport

if TYPE_CHECKING:
    from fedgrid.client.session import Session

__all__ = ["AsyncSession"]

T = TypeVar("T")


class AsyncSession:
    """``Session`` for asyncio: each blocking call runs in the session's own worker thread
    (one, so calls keep their order); ``close`` runs beside it, so that a long poll in flight
    does not hold up the Leave. Made by ``aconnect``."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedgrid-session")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def __aenter__(self) -> "AsyncSession":
        try:
            await self._call(self.session.open)
        except BaseException:
            self._worker.shutdown(wait=False)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.session.__exit__, exc_type, exc, tb)
        finally:
            self._worker.shutdown(wait=False)

    async def tasks(self) -> AsyncIterator[Task]:
        """``Session.tasks`` without blocking the event loop."""
        feed = self.session.tasks()
        while (task := await self._call(next, feed, None)) is not None:
            yield task

    async def submit(self, result: FitOutput | EvaluateOutput) -> TaskReport | None:
        """``Session.submit``."""
        return await self._call(self.session.submit, result)

    async def report_failure(self, reason: str | BaseException) -> None:
        """``Session.report_failure``."""
        await self._call(self.session.report_failure, reason)

    async def close(self, reason: str = "the host program closed the session") -> None:
        """``Session.close``."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.session.close, reason)
        finally:
            self._worker.shutdown(wait=False)

    @property
    def finished(self) -> bool:
        return self.session.finished

    def compute(self) -> AbstractContextManager[None]:
        """``Session.compute``: a plain ``with`` around the host's training (it blocks nothing)."""
        return self.session.compute()
