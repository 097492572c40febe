"""The threads where a request's text work runs, off the event loop: decoding its body,
chat templates, tokenization, echo. The event loop stays free for /health and for the
streams in flight while a large request is prepared. A dedicated pool: the engine's steps
and health checks run in the loop's default one and never queue behind text.

Tokenization goes through the tokenizer's encode (tokenizers' encode_batch), which
releases the GIL, so several requests' prompts encode at once. Not through tokenizers'
Tokenizer.encode: in a thread beside the engine's detokenizer it stalls the whole process
until it returns."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
THREADS = min(4, os.cpu_count() or 1)


class TextPool:
    def __init__(self, threads: int = THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="zmqworker-text")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a pool thread. Cancelled, the caller stops waiting; a call already
        running finishes in its thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        """Drop the calls not started; those running finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
