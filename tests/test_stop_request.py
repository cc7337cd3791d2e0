"""A stop signal that arrives while the worker writes a log line: its own line is said once, after that one."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from runner.worker import StopRequest


def _drain_after(read_fd: int, delay: float, into: list[bytes]) -> threading.Thread:
    def drain() -> None:
        time.sleep(delay)
        with os.fdopen(read_fd, "rb") as pipe:
            into.append(pipe.read())
    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    return thread


def test_a_signal_while_a_log_line_is_written_is_said_after_it_without_a_logging_error(
        capsys: pytest.CaptureFixture) -> None:
    """The handler runs inside the write it interrupts (a pipe to the launcher that is full), holding that stream:
    writing its line there was a 'reentrant call inside BufferedWriter', a logging error and its traceback."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    read_fd, write_fd = os.pipe()
    stream = open(write_fd, "w")  # noqa: SIM115 - closed below, after the handler's line
    handler = logging.StreamHandler(stream)
    runner_log = logging.getLogger("runner")
    runner_log.addHandler(handler)
    level, runner_log.level = runner_log.level, logging.INFO
    propagates, runner_log.propagate = runner_log.propagate, False  # the long line stays out of pytest's report
    received: list[bytes] = []
    reader = _drain_after(read_fd, 0.6, received)
    main = threading.main_thread().ident
    sender = threading.Timer(0.2, signal.pthread_kill, args=(main, signal.SIGTERM))
    request = StopRequest()
    try:
        with request.installed():
            sender.start()
            runner_log.info("x" * 300_000)  # more than the pipe holds: the write waits for the reader
            for thread in threading.enumerate():
                if thread.name == "runner-signal-line":
                    thread.join(timeout=10)
    finally:
        sender.cancel()
        runner_log.removeHandler(handler)
        runner_log.level, runner_log.propagate = level, propagates
        stream.close()
        reader.join(timeout=10)
    written = b"".join(received).decode()
    assert request.signal == signal.SIGTERM
    errors = capsys.readouterr().err
    assert "Logging error" not in errors, errors[:2000]
    assert written.count("received SIGTERM: stopping after this step") == 1, written[-300:]
    assert written.index("x" * 300_000) < written.index("received SIGTERM")
