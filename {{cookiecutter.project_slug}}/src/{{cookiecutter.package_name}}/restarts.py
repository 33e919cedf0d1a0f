"""What `serve` does when tritonserver dies under it, and what `health` tells of it.

Triton 2.51 can abort (an exception under a model's finalize, a crash in the server itself); nothing answers
after that. `serve` then starts it again on the same ports, once what the dead one left is gone (its stubs, which
outlive it, and their /dev/shm regions), and records each restart in a file of its own, which `health` reads:
`~/.cache/{{ cookiecutter.project_slug }}/restarts-<gRPC port>.json` ($XDG_CACHE_HOME). A server that keeps dying
(RESTART_LIMIT times within RESTART_WINDOW_S) is not started again: `serve` exits 1, and an orchestrator that
restarts the container (docker compose `restart:`, Kubernetes) takes over.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from .machine import alive

RESTART_LIMIT = 5
RESTART_WINDOW_S = 600.0


def why_it_ended(returncode: int) -> str:
    """tritonserver's end, in words: `killed by SIGKILL`, `exited with code 1`."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def record_path(grpc_port: int) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "{{ cookiecutter.project_slug }}"
    return cache / f"restarts-{grpc_port}.json"


class Restarts:
    """The restarts of one `serve` run: allowed or not, and written down for `health`."""

    def __init__(self, grpc_port: int):
        self.path = record_path(grpc_port)
        self.times: list[float] = []
        self.reasons: list[str] = []

    def allowed(self) -> bool:
        """Whether one more restart keeps within RESTART_LIMIT in RESTART_WINDOW_S."""
        recent = [t for t in self.times if time.time() - t < RESTART_WINDOW_S]
        return len(recent) < RESTART_LIMIT

    def record(self, reason: str) -> None:
        self.times.append(time.time())
        self.reasons.append(reason)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"serve_pid": os.getpid(), "restarts": len(self.times), "times": self.times, "reasons": self.reasons}
        self.path.write_text(json.dumps(record))

    def forget(self) -> None:
        self.path.unlink(missing_ok=True)


def summary(grpc_port: int) -> str | None:
    """One line for `health`: how often the `serve` still running on this port restarted tritonserver, and the
    last time why; None when it never did (or no `serve` of this host serves that port)."""
    try:
        record = json.loads(record_path(grpc_port).read_text())
    except (OSError, ValueError):
        return None
    if not alive(int(record.get("serve_pid", 0))) or not record.get("restarts"):
        return None
    last = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["times"][-1]))
    count, why = record["restarts"], record["reasons"][-1]
    return f"tritonserver restarted by serve {count} time{'s' if count > 1 else ''}; last at {last}: {why}"
