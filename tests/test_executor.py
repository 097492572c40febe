"""MultiprocExecutor against real worker processes running the model-free EchoWorker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from messages import (
    PROTOCOL_VERSION,
    CachedRequestData,
    Encoder,
    Hello,
    ModelConfig,
    ParallelConfig,
    SchedulerOutput,
    WorkerConfig,
)
from zmqworker.executor import multiproc
from zmqworker.executor.calls import Call, Liveness, OwedAnswers
from zmqworker.executor.errors import (
    ExecutorError,
    RpcTimeoutError,
    StepTimeoutError,
    WorkerDiedError,
    WorkerError,
    WorkerStartupError,
    WorkerStuckError,
)
from zmqworker.executor.handshake import Handshake, polite_shutdown
from zmqworker.executor.message_limits import message_limits
from zmqworker.executor.multiproc import MultiprocExecutor


def echo_config(tp: int = 1, pp: int = 1, **kw) -> WorkerConfig:
    return WorkerConfig(
        model=ModelConfig(path="unused"),
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        worker_cls=kw.pop("worker_cls", "bench.echo_worker.EchoWorker"),
        worker_extension_cls=kw.pop("worker_extension_cls", "bench.echo_worker.EchoExtension"),
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return process_state(pid) != "Z"  # a zombie is dead for our purposes


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0]


def stop(pid: int) -> None:
    """SIGSTOP pid and wait until it is stopped: the signal lands asynchronously, and a
    process still running for a moment could answer a call sent meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + 10
    while process_state(pid) not in ("T", "t"):
        assert time.monotonic() < end, f"process {pid} did not stop"
        time.sleep(0.001)


def wait_gone(pids: list[int], within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def ex2():
    ex = MultiprocExecutor(echo_config(tp=2))
    yield ex
    ex.shutdown()


def test_collective_rpc_results_by_rank(ex2):
    assert ex2.collective_rpc("echo", ("hi",)) == ["hi", "hi"]
    assert ex2.collective_rpc("fail_on_rank", (-1,)) == [0, 1]
    assert ex2.collective_rpc("fail_on_rank", (-1,), unique_reply_rank=1) == 1
    # A list of ranks (a step's over pipeline stages with KV transfer): theirs, in order.
    assert ex2.collective_rpc("fail_on_rank", (-1,), unique_reply_rank=[1, 0]) == [0, 1]
    assert ex2.collective_rpc("fail_on_rank", (-1,), unique_reply_rank=[1]) == [1]
    for ranks in ([2], []):
        with pytest.raises(ValueError, match="is not one of the ranks"):
            ex2.collective_rpc("echo", ("hi",), unique_reply_rank=ranks)
    assert ex2.determine_available_memory() == [1 << 30, 1 << 30]
    assert [s.layer_names for s in ex2.get_kv_cache_specs()] == [["layer.0"], ["layer.1"]]


def test_many_calls_in_flight_matched_by_id(ex2):
    futures = [ex2.collective_rpc("echo", (i,), non_block=True) for i in range(50)]
    slow = ex2.collective_rpc("sleep_for", (0.2,), non_block=True)
    assert [f.result(timeout=30) for f in reversed(futures)] == [
        [i, i] for i in reversed(range(50))
    ]
    assert slow.result(timeout=30) == [0.2, 0.2]


def test_calls_run_in_arrival_order_whoever_receives_them(ex2):
    # The first call finds the compute thread idle and is received by it; those sent
    # while it sleeps are received by the event loop and queued; the last finds it idle.
    first = ex2.collective_rpc("log_call", (-1,), non_block=True)
    slow = ex2.collective_rpc("sleep_for", (0.3,), non_block=True)
    queued = [ex2.collective_rpc("log_call", (i,), non_block=True) for i in range(20)]
    assert [f.result(timeout=30) for f in queued][-1] == [list(range(-1, 20))] * 2
    assert first.result(timeout=30) == [[-1], [-1]] and slow.result(timeout=30) == [0.3, 0.3]
    assert ex2.collective_rpc("log_call", (20,)) == [list(range(-1, 21))] * 2


def test_an_output_still_copying_is_answered_once_it_lands_and_holds_up_nothing(ex2):
    """An output whose ids are still on their way to the host (a CUDA step's) is answered
    by a side thread once they land; the calls after it run meanwhile. A copy that fails
    answers with its error."""
    late = ex2.collective_rpc("late_output", ([3, 5], 0.5), non_block=True)
    assert ex2.collective_rpc("echo", (1,), timeout=5) == [1, 1]
    assert not late.done()
    for output in late.result(timeout=30):
        assert output.req_handles.tolist() == [3, 5]
        assert output.sampled_token_ids.tolist() == [4, 6]
    with pytest.raises(ExecutorError, match="the copy failed"):
        ex2.collective_rpc("late_output", ([3], 0.05, "the copy failed"), timeout=30)
    assert ex2.collective_rpc("echo", (2,)) == [2, 2]


def test_a_call_in_flight_cannot_be_cancelled(ex2):
    slow = ex2.collective_rpc("sleep_for", (0.2,), non_block=True)
    other = ex2.collective_rpc("echo", (1,), non_block=True)
    assert not slow.cancel()
    assert slow.result(timeout=30) == [0.2, 0.2] and other.result(timeout=30) == [1, 1]


def waiting_on_a_long_call(ex: MultiprocExecutor) -> tuple[threading.Thread, dict]:
    """A started thread that waits, with no timeout, on a 30 s call (so it pumps the
    socket); the ExecutorError that ends its wait lands in the dict under "error"."""
    outcome: dict[str, BaseException] = {}

    def wait_long() -> None:
        try:
            ex.collective_rpc("sleep_for", (30.0,))
        except ExecutorError as e:
            outcome["error"] = e

    waiter = threading.Thread(target=wait_long)
    waiter.start()
    return waiter, outcome


def test_a_thread_waiting_without_timeout_does_not_hold_up_the_others():
    """One thread waits on a long call with no timeout (it pumps the socket); another
    still gets its own call out and its own timeout, and fail_all gets through."""
    ex = MultiprocExecutor(echo_config())
    try:
        waiter, outcome = waiting_on_a_long_call(ex)
        with pytest.raises(RpcTimeoutError, match="echo timed out"):  # the worker is busy
            ex.collective_rpc("echo", (1,), timeout=0.5)
        ex.rpc.fail_all(ExecutorError("given up"))
        waiter.join(30)
        assert not waiter.is_alive() and "given up" in str(outcome["error"])
    finally:
        ex.shutdown()


def test_step_round_trip_with_columnar_scheduler_output(ex2):
    so = SchedulerOutput([], CachedRequestData.build([3, 7], [10, 11], [1, 1]), 2)
    out = ex2.execute_model(so)
    assert out.req_handles.tolist() == [3, 7]
    assert out.sampled_token_ids.tolist() == [4, 8]


def test_remote_exception_is_structured_and_worker_keeps_serving(ex2):
    with pytest.raises(WorkerError) as info:
        ex2.collective_rpc("fail_on_rank", (1,))
    err = info.value
    assert (err.rank, err.exc_type, err.method) == (1, "RuntimeError", "fail_on_rank")
    assert "failing on purpose on rank 1" in err.remote_message
    assert "fail_on_rank" in err.remote_traceback and "Traceback" in err.remote_traceback
    assert ex2.collective_rpc("echo", (1,)) == [1, 1]


def test_method_outside_the_allowlist_is_refused(ex2):
    for method in ("__init__", "config", "_call", "wrapper"):
        with pytest.raises(WorkerError, match="not callable over RPC"):
            ex2.collective_rpc(method)


def test_result_that_cannot_be_encoded_is_an_error(ex2):
    assert ex2.collective_rpc("echo", ([1, 2],)) == [[1, 2], [1, 2]]
    with pytest.raises(WorkerError, match="unencodable cannot be sent: the result is a object"):
        ex2.collective_rpc("unencodable")
    with pytest.raises(TypeError, match="cannot be encoded"):
        ex2.collective_rpc("echo", (object(),))
    with pytest.raises(TypeError, match=r"args\[0\]\[1\] is a dict"):
        ex2.collective_rpc("echo", ([1, {"a": 1}],))
    assert ex2.collective_rpc("echo", (5,)) == [5, 5]


def test_a_result_no_engine_could_take_is_an_error_and_the_workers_serve_on(ex2):
    """A result that encodes but is no Value (the engine could not decode it), or that has
    a frame past the engine's bound (libzmq would drop the worker's connection), is
    answered with an error that says so, at once."""
    with pytest.raises(WorkerError, match="the result is a dict, not a Value"):
        ex2.collective_rpc("mapping", timeout=30)
    limits = message_limits(echo_config(tp=2))
    assert limits.request_bytes > limits.reply_bytes  # the echo's request goes out
    with pytest.raises(WorkerError, match=f"more than the {limits.reply_bytes} bytes the engine"):
        ex2.collective_rpc("echo", ("x" * limits.reply_bytes,), timeout=30)
    assert ex2.collective_rpc("echo", ("hi",)) == ["hi", "hi"]


def test_deadline_names_method_and_silent_ranks(ex2):
    with pytest.raises(RpcTimeoutError) as info:
        ex2.collective_rpc("sleep_for", (1.0,), timeout=0.2)
    assert info.value.method == "sleep_for"
    assert info.value.missing_ranks == [0, 1]
    assert "sleep_for" in str(info.value) and "0, 1" in str(info.value)
    assert not isinstance(info.value, StepTimeoutError)  # a step's alone says wedged
    assert ex2.collective_rpc("echo", (2,), timeout=30) == [2, 2]  # still serving


def test_health_check_answered_while_a_long_step_runs(ex2):
    long_call = ex2.collective_rpc("sleep_for", (3.0,), non_block=True)
    ex2.check_health(timeout=30)
    assert not long_call.done(), "the health check waited for the step"
    assert long_call.result(timeout=30) == [3.0, 3.0]


def test_stray_connection_garbage_is_dropped_and_counted(ex2):
    before = ex2.rpc.dropped_messages
    ctx = zmq.Context.instance()
    stray = ctx.socket(zmq.DEALER)
    stray.setsockopt(zmq.LINGER, 0)
    stray.connect(ex2.address)
    stray.send_multipart([b"\x93garbage", b"x"])
    fake = Hello(protocol_version=PROTOCOL_VERSION, rank=0, pid=os.getpid(), token="wrong")
    stray.send_multipart(Encoder().encode(fake))
    deadline = time.monotonic() + 10
    while ex2.rpc.dropped_messages < before + 2 and time.monotonic() < deadline:
        assert ex2.collective_rpc("echo", (3,)) == [3, 3]
    stray.close()
    assert ex2.rpc.dropped_messages >= before + 2
    assert ex2.collective_rpc("echo", (4,)) == [4, 4]


def test_worker_killed_mid_step_fails_pending_calls_fast():
    ex = MultiprocExecutor(echo_config(tp=2))
    try:
        pending = [ex.collective_rpc("sleep_for", (30,), non_block=True) for _ in range(3)]
        time.sleep(0.3)
        os.kill(ex.pids[1], signal.SIGKILL)
        # They fail on the death itself, not on a deadline (bench/failure_latency.py
        # measures how soon): the 30 s steps are far from over.
        for f in pending:
            with pytest.raises(WorkerDiedError) as info:
                f.result(timeout=10)
            assert info.value.rank == 1 and info.value.exit_status == -signal.SIGKILL
        assert "rank 1" in str(info.value) and "SIGKILL" in str(info.value)
        with pytest.raises(WorkerDiedError):  # at once: not RpcTimeoutError
            ex.collective_rpc("echo", (1,), timeout=10)
    finally:
        ex.shutdown()
    assert wait_gone(ex.pids, 10)


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_worker_that_reads_nothing_fails_the_send_after_its_timeout(stopped: int):
    """A worker alive but stopped (SIGSTOP) lets the engine's queue to it fill up; the
    send then fails after send_timeout_s, naming the rank, instead of blocking for ever
    with the client's lock held. Stopped first in rank order, nothing else got that call
    and the executor goes on once the worker reads again; stopped later, the ranks
    before it run a call it never got, so the executor is out of step and fails."""
    ex = MultiprocExecutor(echo_config(tp=2))
    try:
        ex.rpc.send_timeout_s = 0.3
        stop(ex.pids[stopped])
        payload = "x" * 4096  # fills the queues in a few thousand calls
        for _ in range(100_000):
            call = ex.collective_rpc("echo", (payload,), non_block=True)
            if call.done():
                break
        with pytest.raises(WorkerStuckError, match=f"rank {stopped} is alive but has not read"):
            call.result(timeout=0)
        os.kill(ex.pids[stopped], signal.SIGCONT)
        if stopped == 0:
            assert ex.collective_rpc("echo", (1,), timeout=60) == [1, 1]  # it catches up
        else:
            with pytest.raises(WorkerStuckError):  # at once: not a timeout
                ex.collective_rpc("echo", (1,), timeout=60)
    finally:
        os.kill(ex.pids[stopped], signal.SIGCONT)
        ex.shutdown()


def test_a_timeout_holds_while_other_replies_keep_coming(ex2):
    """The waiting thread receives the replies of other calls meanwhile; its own limit
    still ends the wait."""
    calls = [ex2.collective_rpc("sleep_for", (0.02,), non_block=True) for _ in range(60)]
    with pytest.raises(TimeoutError):
        calls[-1].result(timeout=0.3)
    assert calls[-1].result(timeout=60) == [0.02, 0.02]


def test_a_deadline_expires_while_other_replies_keep_coming(ex2):
    """A call's own deadline fails it on time even while the thread that pumps waits,
    without a bound, on a later call whose earlier ones keep answering."""
    finished: dict[str, float] = {}
    calls = [ex2.collective_rpc("sleep_for", (0.02,), non_block=True) for _ in range(70)]
    timed = ex2.collective_rpc("sleep_for", (0.02,), timeout=0.3, non_block=True)
    later = ex2.collective_rpc("sleep_for", (0.02,), non_block=True)
    timed.add_done_callback(lambda _: finished.setdefault("timed", time.monotonic()))
    # 40 calls of 20 ms end 0.8 s on, well past the deadline.
    calls[39].add_done_callback(lambda _: finished.setdefault("40th", time.monotonic()))
    assert later.result() == [0.02, 0.02]
    assert isinstance(timed.exception(timeout=0), RpcTimeoutError)
    assert finished["timed"] < finished["40th"]
    assert [c.result(timeout=0) for c in calls] == [[0.02, 0.02]] * 70


def test_a_deadline_set_from_a_done_callback_expires_on_time(ex2):
    """A done-callback runs on the thread that pumps, inside the pump: a timed call it
    starts must still be failed on time, not once that pump is over."""
    finished: dict[str, float] = {}
    started = []

    def start_a_timed_call(_) -> None:
        call = ex2.collective_rpc("sleep_for", (0.02,), timeout=0.3, non_block=True)
        call.add_done_callback(lambda _: finished.setdefault("timed", time.monotonic()))
        started.append(call)

    calls = [ex2.collective_rpc("sleep_for", (0.02,), non_block=True) for _ in range(70)]
    calls[0].add_done_callback(start_a_timed_call)
    calls[39].add_done_callback(lambda _: finished.setdefault("40th", time.monotonic()))
    assert calls[-1].result() == [0.02, 0.02]
    assert isinstance(started[0].exception(timeout=0), RpcTimeoutError)
    assert finished["timed"] < finished["40th"]


def test_a_step_has_a_default_bound():
    """execute_model, which engines call without a timeout, still fails with
    RpcTimeoutError when a live worker never answers (here: stopped), after the
    executor's step_timeout_s; the worker serves again once it runs."""
    ex = MultiprocExecutor(echo_config())
    step = SchedulerOutput([], CachedRequestData.build([3], [10], [1]), 1)
    try:
        assert ex.step_timeout_s == 300.0
        ex.step_timeout_s = 0.3
        stop(ex.pids[0])
        with pytest.raises(StepTimeoutError) as info:  # an RpcTimeoutError
            ex.execute_model(step)
        assert info.value.method == "execute_model" and info.value.missing_ranks == [0]
        assert "got no reply within 0.3 s" in str(info.value)
        assert "from rank(s) 0, which it waited on" in str(info.value)
        assert "may be stuck on any rank" in str(info.value)
        os.kill(ex.pids[0], signal.SIGCONT)
        ex.step_timeout_s = 60.0
        assert ex.execute_model(step).sampled_token_ids.tolist() == [4]
    finally:
        os.kill(ex.pids[0], signal.SIGCONT)
        ex.shutdown()


def test_shutdown_fails_the_call_another_thread_waits_on():
    ex = MultiprocExecutor(echo_config())
    waiter, outcome = waiting_on_a_long_call(ex)
    time.sleep(0.3)  # most likely in its receive by now; the outcome is the same if not
    ex.shutdown()
    waiter.join(30)
    assert not waiter.is_alive() and "shut down" in str(outcome["error"])


ENGINE_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from tests.test_executor import echo_config
    from zmqworker.executor.multiproc import MultiprocExecutor
    ex = MultiprocExecutor(echo_config(tp=2))
    print(ex._dir, *ex.pids, flush=True)
    time.sleep(600)
    """
)


def test_engine_killed_workers_exit_and_socket_removed(tmp_path):
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE_SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        folder, *pids = engine.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert Path(folder, "engine.sock").exists()
        engine.kill()
        engine.wait()
        assert wait_gone(pids, 10.0), "workers outlived their engine"
        end = time.monotonic() + 5
        while Path(folder).exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert not Path(folder).exists(), f"left behind: {sorted(Path(folder).iterdir())}"
    finally:
        engine.kill()


def test_shutdown_is_complete_and_idempotent():
    ex = MultiprocExecutor(echo_config(tp=2), transport="tcp")
    assert ex.address.startswith("tcp://127.0.0.1:")
    assert ex.collective_rpc("echo", (1,)) == [1, 1]
    folder, pids = Path(ex._dir), ex.pids
    ex.shutdown()
    ex.shutdown()
    assert not any(alive(p) for p in pids)  # shutdown waited for them
    assert not folder.exists()
    with pytest.raises(ExecutorError, match="shut down"):
        ex.collective_rpc("echo", (1,))


def test_shutdown_escalates_when_a_worker_is_stuck():
    ex = MultiprocExecutor(echo_config(tp=1))
    ex.collective_rpc("sleep_for", (120,), non_block=True)
    time.sleep(0.2)
    start = time.monotonic()
    ex.shutdown()
    assert time.monotonic() - start < 30  # not the 120 s step
    assert not any(alive(p) for p in ex.pids)


class Exits(Liveness):
    """Ranks' exit statuses as polite_shutdown sees them (None: running); stopped ranks."""

    def __init__(self, statuses: list[int | None], stopped: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.statuses, self.stopped_ranks, self.killed = statuses, stopped, []

    def exit_status(self, rank: int) -> int | None:
        return self.statuses[rank]

    def stopped(self, rank: int) -> bool:
        return rank in self.stopped_ranks

    def kill(self, rank: int) -> None:
        self.killed.append(rank)


class DiesAnswering:  # what polite_shutdown reads of an RpcClient
    """Rank 0 leaves with status before its answer; the ranks as liveness says."""

    dead = None
    owing: list[int] = []

    def __init__(self, status: int, liveness: Exits) -> None:
        self.status, self.liveness = status, liveness
        self.identities = {rank: b"rank-%d" % rank for rank in range(len(liveness.statuses))}

    def call(self, method: str, timeout: float) -> Future:
        died: Future = Future()
        died.set_exception(WorkerDiedError(0, self.status))
        return died


@pytest.mark.parametrize(("status", "polite"), [(0, True), (1, False), (-9, False)])
def test_a_worker_that_exits_cleanly_as_asked_has_shut_down_politely(status, polite):
    """A worker leaves at once after answering shutdown (its socket lingers 0): its death
    with exit status 0 may come before its answer, and is the shutdown asked for."""
    assert polite_shutdown(DiesAnswering(status, Exits([status])), 1, 1.0) is polite


@pytest.mark.parametrize(
    ("statuses", "stopped", "polite"),
    [([0, 0], (), True), ([0, None], (1,), False), ([0, 1], (), False), ([0, None], (), False)],
)
def test_one_rank_exiting_cleanly_is_not_the_others_shutting_down(statuses, stopped, polite):
    """Polite only when every rank exited 0: a stopped rank (it would answer nothing,
    SIGTERM included) is killed at once; a rank still running once the bound is out
    makes it impolite too."""
    liveness = Exits(statuses, stopped)
    start = time.monotonic()
    assert polite_shutdown(DiesAnswering(0, liveness), 2, 0.5) is polite
    assert liveness.killed == list(stopped)
    assert time.monotonic() - start < (1.0 if stopped or polite else 2.0)


def test_a_rank_stopped_at_shutdown_makes_it_impolite_and_is_killed_at_once(monkeypatch):
    seen: list[bool] = []

    def spy(*args):
        seen.append(polite_shutdown(*args))
        return seen[-1]

    monkeypatch.setattr(multiproc, "polite_shutdown", spy)
    ex = MultiprocExecutor(echo_config(tp=2))
    stop(ex.pids[1])
    start = time.monotonic()
    ex.shutdown()
    assert seen == [False]  # rank 0 left as asked; rank 1 never did
    assert time.monotonic() - start < 3.0
    assert not any(alive(p) for p in ex.pids)


def test_a_rank_stopped_while_the_engine_is_idle_is_stuck_not_dead():
    """Heartbeats drop a stopped rank's connection while nobody receives; the next call
    finds it unreachable: no death follows, so it is stuck, named, and killed."""
    ex = MultiprocExecutor(echo_config(tp=2), stuck_after_s=0.5)
    try:
        stop(ex.pids[1])
        time.sleep(1.5)  # past the heartbeat bound: its connection is dropped
        with pytest.raises(WorkerStuckError) as info:
            ex.collective_rpc("echo", (1,), timeout=30)
        assert info.value.rank == 1 and "worker rank 1 is alive" in str(info.value)
        assert wait_gone([ex.pids[1]], 5.0), "the stuck worker was not killed"
    finally:
        start = time.monotonic()
        ex.shutdown()
    assert time.monotonic() - start < 2.0
    assert not any(alive(p) for p in ex.pids)


def test_a_welcome_that_cannot_be_sent_names_the_rank_and_kills_it():
    class Unreachable:  # what Handshake.run uses of an RpcClient
        dead = None
        liveness = Exits([None])
        failed: list[Exception] = []

        def wait_for(self, done, timeout):
            handshake.hellos[0] = Hello(PROTOCOL_VERSION, 0, 1, "t")

        def send_to(self, rank, msg):
            raise zmq.ZMQError(zmq.EHOSTUNREACH)

        def fail_all(self, error):
            self.failed.append(error)

    handshake = Handshake(1, "t", [1])
    rpc = Unreachable()
    with pytest.raises(WorkerStuckError, match="the Welcome: worker rank 0 is alive") as info:
        handshake.run(rpc, echo_config(), 5.0)
    assert info.value.rank == 0 and rpc.liveness.killed == [0] and rpc.failed == [info.value]


def test_startup_failure_reports_the_worker_error_and_stops_the_others():
    cfg = echo_config(tp=2, worker_cls="bench.echo_worker.NoSuchWorker")
    before = set(_children())
    with pytest.raises(WorkerStartupError) as info:
        MultiprocExecutor(cfg, start_timeout=60)
    text = str(info.value)
    assert "NoSuchWorker" in text and "rank" in text
    assert wait_gone(list(set(_children()) - before), 10)


def test_per_rank_environment_reaches_the_worker():
    ex = MultiprocExecutor(echo_config(tp=2), per_rank_env=[{"ZW_T": "a"}, {"ZW_T": "b"}])
    try:
        assert ex.collective_rpc("getenv", ("ZW_T",)) == ["a", "b"]
    finally:
        ex.shutdown()


def test_bad_layout_arguments():
    with pytest.raises(ValueError, match="transport"):
        MultiprocExecutor(echo_config(), transport="udp")
    with pytest.raises(ValueError, match="per_rank_env"):
        MultiprocExecutor(echo_config(tp=2), per_rank_env=[{}])
    # A bound libzmq's int milliseconds cannot hold is refused before any socket takes it.
    for bound in (0.0, 3e6):
        with pytest.raises(
            ValueError, match=r"stuck_after_s must be seconds > 0, at most 2,147,483"
        ):
            MultiprocExecutor(echo_config(), stuck_after_s=bound)


def test_worker_entry_point_refuses_a_missing_token():
    env = {k: v for k, v in os.environ.items() if k != "ZMQWORKER_TOKEN"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "zmqworker.runtime",
            "--engine",
            "ipc:///nonexistent",
            "--rank",
            "0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2 and "no handshake token" in out.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "zmqworker.runtime", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "--engine" in help_text and "--rank" in help_text


def test_start_up_ends_with_the_heap_frozen():
    """Once compile_or_warm_up_model has run, a worker process's start-up objects are
    out of the collector's sight (gc.freeze), so no step pays for a full collection
    walking them."""
    with MultiprocExecutor(echo_config()) as ex:
        assert ex.collective_rpc("frozen_objects") == [0]
        ex.compile_or_warm_up_model()
        assert ex.collective_rpc("frozen_objects")[0] > 10_000


def test_a_worker_whose_engine_socket_closes_stops_without_a_parent_check(tmp_path):
    """Across hosts (Ray) a worker has no parent to watch: the drop of its connection
    to the engine alone must stop it. Here the engine end closes before the Welcome;
    the handshake itself would wait 60 s."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    address = f"ipc://{tmp_path}/engine.sock"
    router.bind(address)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zmqworker.runtime",
            "--engine",
            address,
            "--rank",
            "0",
            "--log-level",
            "INFO",
        ],
        env={**os.environ, "ZMQWORKER_TOKEN": "t"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert router.poll(60_000), "no Hello from the worker"
        router.recv_multipart()
        router.close(linger=0)
        assert worker.wait(timeout=30) == 0
        assert "connection to the engine dropped" in worker.stderr.read()
    finally:
        worker.kill()
        worker.wait()
        ctx.term()


def _children() -> list[int]:
    me = str(os.getpid())
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "stat").read_text().split(")")[-1].split()[1] == me:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def test_columnar_message_types_survive_the_wire(ex2):
    arr = np.arange(5, dtype=np.int32)
    so = SchedulerOutput([], CachedRequestData.build(arr, arr, arr), 15)
    assert msgspec.structs.asdict(so)["total_num_scheduled_tokens"] == 15
    assert ex2.execute_model(so).sampled_token_ids.tolist() == (arr + 1).tolist()


def test_owed_answers_are_the_newest_in_order_call_each_rank_has_not_answered() -> None:
    """A rank that let a call time out owes its answer until it answers that call or a
    later one that runs in order (a rank runs them so); a health check, which runs
    beside them, neither puts a rank on the list nor takes it off."""

    def call(method: str, ranks: set[int]) -> Call:
        return Call(method, set(ranks), None, 1.0, None)

    owed = OwedAnswers()
    owed.timed_out(3, call("check_health", {0, 1}))
    assert owed.ranks == []
    owed.timed_out(5, call("sleep_for", {0, 1}))
    owed.timed_out(7, call("sleep_for", {1}))
    assert owed.ranks == [0, 1]
    owed.answered(1, 5, None)  # an older call's late answer: 7 is still owed
    owed.answered(1, 9, call("check_health", {1}))  # beside: says nothing of call 7
    assert owed.ranks == [0, 1]
    owed.answered(0, 5, None)
    owed.answered(1, 8, call("echo", {0, 1}))  # a later call, in order: 7 has ended
    assert owed.ranks == []
    owed.timed_out(11, call("sleep_for", {0}))
    owed.clear()
    assert owed.ranks == []
