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
import os
import shutil
import tempfile
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


async def answer(model: str, call: asyncio.Future, deadline_s: float | None = None, server_pid: int | None = None):
    """The result of `call`, a BLS call to `model` (`request.async_exec()`); NoAnswer, and the call cancelled, as
    soon as a death of a stub of `model` is recorded after the call began, or after `deadline_s` at the latest."""
    started, waited = time.time(), 0.0
    while True:
        step = POLL_S if deadline_s is None else min(POLL_S, max(deadline_s - waited, 0))
        done, _ = await asyncio.wait([call], timeout=step)
        if done:
            return call.result()
        waited = time.time() - started
        if died_since(model, started, server_pid):
            message = f"{model}: a stub of {model} died while this call waited; the watchdog reloads it"
        elif deadline_s is not None and waited >= deadline_s:
            message = f"{model}: no answer in {deadline_s:.0f} s (a dead stub? `serve`'s watchdog reloads it)"
        else:
            continue
        call.cancel()
        raise NoAnswer(message)
