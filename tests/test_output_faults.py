"""A step's output whose device fault shows only when the worker looks at it (a CUDA
event's query or synchronize raising after an asynchronous fault): the call is answered
with the error at once, wherever the worker looks, never left for the engine to time out.
Real worker processes (the model-free EchoWorker)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.echo_worker import EchoExtension
from tests.test_executor import echo_config
from zmqworker.executor.errors import WorkerError
from zmqworker.executor.multiproc import MultiprocExecutor
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput

FAULT = "CUDA error: an illegal memory access was encountered"


class _FaultyEvent:
    """An event after an asynchronous device fault: query() raises, or says done and
    synchronize() raises."""

    def __init__(self, query_raises: bool) -> None:
        self._query_raises = query_raises

    def query(self) -> bool:
        if self._query_raises:
            raise RuntimeError(FAULT)
        return True

    def synchronize(self) -> None:
        raise RuntimeError(FAULT)


class _HostIds:
    def __init__(self, ids: np.ndarray) -> None:
        self._ids = ids

    def numpy(self) -> np.ndarray:
        return self._ids


class FaultyOutputs(EchoExtension):
    def faulty_output(self, query_raises: bool) -> AsyncModelRunnerOutput:
        ids = np.array([1], np.int32)
        return AsyncModelRunnerOutput(ids, None, _HostIds(ids), event=_FaultyEvent(query_raises))


@pytest.mark.parametrize("query_raises", [True, False], ids=["is_ready", "get_output"])
def test_a_fault_found_completing_the_call_is_answered_at_once(query_raises: bool) -> None:
    ex = MultiprocExecutor(
        echo_config(worker_extension_cls="tests.test_output_faults.FaultyOutputs")
    )
    try:
        with pytest.raises(WorkerError, match="illegal memory access"):
            ex.collective_rpc("faulty_output", (query_raises,), timeout=10)
        assert ex.collective_rpc("echo", (1,), timeout=10) == [1]  # still serving
    finally:
        ex.shutdown()
