"""Notice that the engine is gone, so that no worker outlives it.

Two signals, either is enough: the DEALER's connection to the engine drops (socket
monitor, works across hosts), or the parent process changes (a worker spawned by
MultiprocExecutor is re-parented when its engine dies, even by SIGKILL).

A drop counts once a handshake with the engine has succeeded. Before that, a handshake
cut short (the engine's ZAP thread slow to answer, past its handshake interval) is
tried again by libzmq, and the wait for the Welcome bounds how long; an engine that
refuses this worker's keys (ZAP's answer) ends it at once.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

PARENT_POLL_S = 0.25


class EngineWatch:
    def __init__(
        self,
        sock: zmq.Socket,
        loop: asyncio.AbstractEventLoop,
        on_lost: Callable[[str], None],
        parent_pid: int | None,
    ) -> None:
        self._loop = loop
        self._on_lost = on_lost
        self._parent_pid = parent_pid
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        self._reached = False  # a handshake with the engine succeeded
        self._fd = self._monitor.getsockopt(zmq.FD)
        self._fired = False
        loop.add_reader(self._fd, self._read_monitor)
        # A look now: until the monitor socket has once found its pipe empty, an event
        # written to it signals nothing on the FD, and the reader would never run.
        loop.call_soon(self._read_monitor)
        self._task = loop.create_task(self._watch_parent()) if parent_pid else None

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        if self._task is not None:
            self._task.cancel()
        self._monitor.close(linger=0)

    def _lost(self, why: str) -> None:
        if not self._fired:
            self._fired = True
            self._on_lost(why)

    def _read_monitor(self) -> None:
        if self._monitor.closed:  # the first look, run after an early close()
            return
        while self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._reached = True
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._lost("the engine refused this worker's CURVE keys")
            elif event == zmq.EVENT_DISCONNECTED and self._reached:
                self._lost("the connection to the engine dropped")

    async def _watch_parent(self) -> None:
        while True:
            await asyncio.sleep(PARENT_POLL_S)
            if os.getppid() != self._parent_pid:
                self._lost(f"the engine process {self._parent_pid} exited")
                return
