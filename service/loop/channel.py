"""``CommandChannel``: wakes the long-polls of ``GET /v1/runs/{run_id}/commands?wait=S`` the
moment the loop issues a command for their run.

The loop runs in threads, the long-polls are coroutines on the app's event loop: ``notify`` may be
called from any thread and hands over with ``call_soon_threadsafe``. Waiters hold no thread while
they wait. The notification carries the run's pending commands as the loop's pass read them in
the transaction that issued them (in the same round trip as its commit), so a woken long-poll
answers without reading the database again: that re-read (a thread hand-off and a transaction of
its own, on a host busy with the next batches) was the tail of the decision latency. A command
issued by another service process is not notified here; the long-poll also re-reads the database
every ``Settings.command_poll_interval_s``, which bounds its delay.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from fp8guard import wire

__all__ = ["CommandChannel", "Wakeup"]


class Wakeup(asyncio.Event):
    """A ``watch`` ticket; once set, ``commands`` holds the run's pending commands as notified
    (None when the notifier did not send them)."""

    def __init__(self) -> None:
        super().__init__()
        self.commands: tuple[wire.Command, ...] | None = None


class CommandChannel:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, Wakeup] = {}
        self._waiters: dict[str, int] = {}

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Called once the app's event loop runs (in the lifespan)."""
        self._loop = loop

    def notify(self, run_id: str, pending: Sequence[wire.Command] | None = None) -> None:
        """A command for ``run_id`` was committed (any thread); ``pending``: the run's pending
        commands as of that commit, if known."""
        loop = self._loop
        commands = None if pending is None else tuple(pending)
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
                loop.call_soon_threadsafe(self._fire, run_id, commands)

    def _fire(self, run_id: str, commands: tuple[wire.Command, ...] | None) -> None:
        event = self._events.pop(run_id, None)
        if event is not None:
            event.commands = commands
            event.set()

    def watch(self, run_id: str) -> Wakeup:
        """Register interest in ``run_id`` *before* reading its commands, so a notification that
        comes between the read and the wait is not lost; pass the result to ``wait``."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        event = self._events.setdefault(run_id, Wakeup())
        self._waiters[run_id] = self._waiters.get(run_id, 0) + 1
        return event

    async def wait(self, run_id: str, event: Wakeup, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds on a ``watch`` ticket; True if a notification came (its
        commands are then on the ticket). Each ticket is waited on once."""
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                await event.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self.release(run_id, event)

    def waiting(self, run_id: str) -> int:
        """Long-polls waiting on ``run_id`` now."""
        return self._waiters.get(run_id, 0)

    def release(self, run_id: str, event: Wakeup) -> None:
        """Give a ``watch`` ticket back without waiting (``wait`` does this itself)."""
        left = self._waiters[run_id] - 1
        if left:
            self._waiters[run_id] = left
        else:
            del self._waiters[run_id]
            if self._events.get(run_id) is event:
                del self._events[run_id]
