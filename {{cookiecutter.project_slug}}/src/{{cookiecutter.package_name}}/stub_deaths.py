"""What the watchdog tells the BLS callers: which model lost a stub, and when.

On a GPU, Triton 2.51 never answers a request that a stub held when it died: the server waits for that stub for
good, and so does a BLS call waiting on it. The watchdog (health.StubWatchdog) sees the dead stub within about
two seconds and records the death here, one file per model whose modification time is the moment it was seen;
the requests of a BLS call still waiting on that model since before then are answered at once with an error that
names the model (python_backend.Guard), instead of at the call's deadline. Both sides find the folder from the
tritonserver process's PID (the stubs' parent) in this user's own folder of the temporary directory they share
(the server inherits serve's TMPDIR), which only this user can write (`root`).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from .machine import alive
from .paths import NotPrivate, private_dir, user_tmp

POLL_S = 0.5  # how often a BLS model's guard looks for a death of the model its call waits on


def root() -> Path:
    """This user's folder of records, `<tmp>/<slug>-stub-deaths-<uid>`, checked to be theirs (paths.private_dir):
    a folder another user made there first is never trusted (it would let them fail every waiting call)."""
    return private_dir(user_tmp("stub-deaths"))


def folder(server_pid: int) -> Path:
    return user_tmp("stub-deaths") / str(server_pid)


def record(server_pid: int, model: str) -> None:
    """`model` of the server `server_pid` lost a stub: now. NotPrivate if the records' folder is not this user's."""
    path = root() / str(server_pid)
    path.mkdir(mode=0o700, exist_ok=True)
    (path / model).touch()  # an existing record gets the new time


def died_since(model: str, since: float, server_pid: int | None = None) -> bool:
    """Whether a stub of `model` was recorded dead after `since` (time.time()); called in a stub, the server is
    its parent."""
    try:
        return (root() / str(server_pid or os.getppid()) / model).stat().st_mtime > since
    except OSError:  # no record, or a folder that is not this user's (NotPrivate)
        return False


def forget(server_pid: int) -> None:
    """Remove the server's records (the watchdog stops, or a later start finds its server gone)."""
    try:
        shutil.rmtree(root() / str(server_pid), ignore_errors=True)
    except NotPrivate:
        pass


def forget_stale() -> None:
    """Remove the records of servers that no longer run (a watchdog that was killed left them)."""
    try:
        records = root()
    except NotPrivate:
        return
    for path in records.iterdir():
        if path.name.isdigit() and not alive(int(path.name)):
            shutil.rmtree(path, ignore_errors=True)


def given_up(model: str, started: float, deadline_s: float | None = None, server_pid: int | None = None) -> str | None:
    """Why a BLS call to `model` that began at `started` (time.time()) and still waits will never be answered: a
    death of a stub of `model` recorded since, or its deadline passed; None while neither is so."""
    if died_since(model, started, server_pid):
        return f"{model}: a stub of {model} died while this call waited; the watchdog reloads it"
    if deadline_s is not None and time.time() - started >= deadline_s:
        return f"{model}: no answer in {deadline_s:.0f} s (a dead stub? `serve`'s watchdog reloads it)"
    return None
