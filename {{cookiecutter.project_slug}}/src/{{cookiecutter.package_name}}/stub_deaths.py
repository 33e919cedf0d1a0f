"""What the watchdog tells the BLS callers: which model lost a stub, and when.

On a GPU, Triton 2.51 never answers a request that a stub held when it died: the server waits for that stub for
good, and so does a BLS call waiting on it. The watchdog (health.StubWatchdog) sees the dead stub within about
two seconds and records the death here, one file per model whose modification time is the moment it was seen;
a BLS call still waiting on that model since before then gives up at once with an error that names the model
(python_backend.Instance.infer), instead of at its deadline. Both sides find the folder from the tritonserver
process's PID (the stubs' parent) in the temporary directory they share (the server inherits serve's TMPDIR).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from .mps import alive

PREFIX = "{{ cookiecutter.project_slug }}-stub-deaths-"
POLL_S = 0.5  # how often a waiting BLS call looks for a death of the model it waits on


class NoAnswer(Exception):
    """A BLS call given up: its model lost a stub meanwhile, or the deadline passed."""


def folder(server_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"{PREFIX}{server_pid}"


def record(server_pid: int, model: str) -> None:
    """`model` of the server `server_pid` lost a stub: now."""
    path = folder(server_pid)
    path.mkdir(mode=0o700, exist_ok=True)
    (path / model).touch()  # an existing record gets the new time


def died_since(model: str, since: float, server_pid: int | None = None) -> bool:
    """Whether a stub of `model` was recorded dead after `since` (time.time()); called in a stub, the server is
    its parent."""
    try:
        return (folder(server_pid or os.getppid()) / model).stat().st_mtime > since
    except OSError:
        return False


def forget(server_pid: int) -> None:
    """Remove the server's records (the watchdog stops, or a later start finds its server gone)."""
    shutil.rmtree(folder(server_pid), ignore_errors=True)


def forget_stale() -> None:
    """Remove the records of servers that no longer run (a watchdog that was killed left them)."""
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        pid = path.name.removeprefix(PREFIX)
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def why_given_up(model: str, since: float, deadline_s: float | None, server_pid: int | None = None) -> str | None:
    """Why a BLS call to `model` that began at `since` (time.time()) is given up, or None while it may wait on."""
    if died_since(model, since, server_pid):
        return f"{model}: a stub of {model} died while this call waited; the watchdog reloads it"
    if deadline_s is not None and time.time() - since >= deadline_s:
        return f"{model}: no answer in {deadline_s:.0f} s (a dead stub? `serve`'s watchdog reloads it)"
    return None


async def answer(model: str, call: asyncio.Future, deadline_s: float | None = None, server_pid: int | None = None):
    """The result of `call`, a BLS call to `model` (`request.async_exec()`); NoAnswer, and the call cancelled, as
    soon as a death of a stub of `model` is recorded after the call began, or after `deadline_s` at the latest."""
    started = time.time()
    while True:
        step = POLL_S if deadline_s is None else min(POLL_S, max(deadline_s - (time.time() - started), 0))
        done, _ = await asyncio.wait([call], timeout=step)
        if done:
            return call.result()
        if message := why_given_up(model, started, deadline_s, server_pid):
            call.cancel()
            raise NoAnswer(message)


class Caller:
    """An execute()'s coroutine on an event loop of its own thread, where its BLS calls block (`request.exec()`,
    no thread hop per call), while the stub's thread waits for the responses: that thread gives the execute up
    (NoAnswer) once the call in progress waits on a model that lost a stub meanwhile, or past the call's deadline.

    Measured on an H200, the pipeline's own time per one-image execute was 5.26 ms with `async def execute` and
    `await request.async_exec()` (an executor thread per call), 3.98 ms with the calls blocking on one event-loop
    thread. A Caller given up keeps its thread waiting on the dead stub for good: take a new one."""

    def __init__(self, server_pid: int | None = None):
        self.loop = asyncio.new_event_loop()
        self.server_pid = server_pid
        self.waiting: tuple[str, float, float | None] | None = None  # the call in progress: model, since, deadline
        threading.Thread(target=self.loop.run_forever, name="bls-calls", daemon=True).start()

    def on_its_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def call(self, model: str, exec_, deadline_s: float | None = None):
        """`exec_()`, a blocking BLS call to `model`, on this Caller's thread (in the coroutine `run` was given)."""
        self.waiting = (model, time.time(), deadline_s)
        try:
            return exec_()
        finally:
            self.waiting = None

    def run(self, coroutine):
        """The result of `coroutine`, run on this Caller's thread; NoAnswer as soon as its call in progress is
        given up (stub_deaths.why_given_up)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        while True:
            try:
                return future.result(timeout=POLL_S)
            except concurrent.futures.TimeoutError:
                pass
            if (waiting := self.waiting) and (message := why_given_up(*waiting, self.server_pid)):
                raise NoAnswer(message)
