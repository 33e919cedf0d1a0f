"""Facts about this machine, read without changing anything: its GPUs (without initializing CUDA), its processes,
its TCP ports (free ones, and who holds one), and the MPS limit of a GPU. The bottom layer, with paths.py: every
other module may use it, it uses none of them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

# MPS client contexts one GPU takes (NVIDIA's documented limit for Volta and later). On an H200 a reload that would
# have passed it could not create its stubs' contexts: "CUDA-capable device(s) is/are busy or unavailable".
MAX_CLIENTS = 48


def visible_gpus() -> list[int]:
    """GPU ids the server will see, without initializing CUDA in this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # the server numbers the GPUs it is given from 0
        return list(range(len([d for d in visible.split(",") if d.strip()])))
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    count = sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0
    return list(range(count))


def terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Process:
    pid: int
    ppid: int
    uid: int
    comm: str
    start: str  # start time in clock ticks since boot: a PID together with it names one process


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(comm, ppid, start time) of a live process, else None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
    if rest[0] in "ZX":  # a zombie is gone already
        return None
    return comm, int(rest[1]), rest[19]


def processes() -> list[Process]:
    """Every process this one can see."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        try:
            uid = entry.stat().st_uid
        except OSError:
            continue
        if stat is not None:
            found.append(Process(int(entry.name), stat[1], uid, stat[0], stat[2]))
    return found


def alive(pid: int, start: str | None = None) -> bool:
    """Is `pid` running (and, with `start`, still the same process)?"""
    stat = _stat(pid)
    return stat is not None and (start is None or stat[2] == start)


_HANDED_OUT: set[int] = set()  # the ports free_port gave this process


def free_port() -> int:
    """A loopback port free now, and never one this process was given before: the kernel may hand a port just
    closed out again, and three calls in a row once gave a server the same HTTP and metrics port (it refused to
    start)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def port_holder(port: int) -> str | None:
    """Which process listens on TCP `port` of this host ("pid 123: tritonserver --model-repository=..."), where
    /proc says (None where it cannot: another user's process, another network namespace)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(fields[9])
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                    argv = (fd_dir.parent / "cmdline").read_bytes().split(b"\0")
                    command = " ".join(" ".join(a.decode(errors="replace").split()) for a in argv if a)[:120]
                    return f"pid {fd_dir.parent.name}: {command}"
        except OSError:
            continue
    return None
