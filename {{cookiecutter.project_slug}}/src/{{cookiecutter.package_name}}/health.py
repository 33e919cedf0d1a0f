"""Real health: one small inference through the pipeline, and a watchdog that reloads dead stubs.

Triton 2.51 keeps `/v2/health/ready` and model readiness true after a Python-backend stub dies, while every
request to that model fails with "Stub process '<model>_0_0' is not healthy" until the model is reloaded (on a
GPU such a request can hang instead). So health here means an answer to a real request, and recovery means
reloading the model that lost its stub: the watchdog sees the dead stub itself, as a child process of the server
that has exited and that the server has not reaped, and also reads the model's name from a failed probe.

The same watchdog unregisters the shared-memory regions of same-host clients that were killed without closing them:
the server would otherwise keep them (and their /dev/shm pages) mapped until another shared-memory client came.
"""

from __future__ import annotations

import ctypes
import functools
import io
import json
import os
import platform
import re
import signal
import struct
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image

from . import stub_deaths
from .model_repository import BLS_CALLS, RELOADS_PARAMETER, bls_callers
from .rules import OVERLOAD_MESSAGES
from .shm import remove_stale_regions

DEAD_STUB = re.compile(r"Stub process '(?P<model>.+?)_\d+_\d+' is not healthy")
# How long the stubs of a replaced version may outlive the reload that replaced them: longer than the pipeline's
# BLS timeout (30 s), so that a request an old instance still holds gets its own answer or error first.
REPLACED_GRACE_S = 40
# A replaced stub that used at most IDLE_TICKS clock ticks of CPU (1/100 s each on Linux) in each of IDLE_SAMPLES
# spans of IDLE_S is idle: a stub at work spins on its GPU stream or computes on the CPU, one between batches waits
# on a futex.
IDLE_S, IDLE_TICKS, IDLE_SAMPLES = 0.5, 2, 2
STUB_COMMAND = "triton_python_b"  # the kernel's 15-character name of triton_python_backend_stub


def _stubs():
    """(pid, state, parent pid, command line) of every Python-backend stub of this host (a zombie's command line
    is empty)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            command, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
            if command != STUB_COMMAND:
                continue
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # gone meanwhile
        yield int(stat.parent.name), fields[0], int(fields[1]), argv


def stub_processes(server_pid: int, instances_only: bool = False) -> dict[int, str | None]:
    """The Python-backend stubs of the tritonserver process `server_pid`: {pid: model name}, None for a stub that
    has died (a zombie: it has exited and the server has not reaped it, which 2.51 does only on a reload).
    `instances_only`: without the short-lived stub the backend starts as it loads a model, to complete its config.

    A stub's command line is `triton_python_backend_stub <repository>/<model>/<version>/model.py <region> <sizes>
    <parent pid> <libpython> <ipc handle> <name> ...`, the name being the instance's (`<model>_<group>_<index>`) or,
    for that config stub, the model's."""
    stubs = {}
    for pid, state, parent, argv in _stubs():
        if parent != server_pid:
            continue
        model = Path(argv[1].decode()).parent.parent.name if state != "Z" and len(argv) > 1 else None
        if instances_only and model is not None and len(argv) > 8 and argv[8].decode() == model:
            continue
        stubs[pid] = model
    return stubs


def orphaned_stubs(shm_prefix: str) -> list[int]:
    """The stubs a tritonserver that died left running: those whose /dev/shm region has its prefix (the third
    word of a stub's command line), whatever their parent now is."""
    return [
        pid for pid, _, _, argv in _stubs() if len(argv) > 2 and argv[2].decode(errors="replace").startswith(shm_prefix)
    ]


@functools.cache
def probe_image() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (120, 140, 160)).save(buffer, format="PNG")
    return buffer.getvalue()


# The pipeline's priority level for probes (its config's priority_queue_policy): served before the requests queued
# at the default level, from a queue of their own, so that real traffic filling its queue never starves a probe.
PROBE_PRIORITY = 1


def probe(url: str, model: str = "pipeline", timeout_s: float = 30) -> str | None:
    """None if `model` answers one small image, else why not. The probe goes ahead of queued requests
    (PROBE_PRIORITY; a model without priority levels takes it at its default)."""
    image = grpcclient.InferInput("IMAGE", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[probe_image()]], dtype=object))
    try:
        with grpcclient.InferenceServerClient(url) as client:
            client.infer(model, [image], client_timeout=timeout_s, priority=PROBE_PRIORITY)
    except Exception as exc:
        return str(exc)
    return None


def busy(error: str) -> bool:
    """Whether a probe's error says the server is busy (a queue refused it, or it waited past its timeout), which a
    readiness check must not take for broken: every pod of an overloaded Service would leave it at once."""
    return any(text in error for text in OVERLOAD_MESSAGES)


def restart(client: grpcclient.InferenceServerClient, model: str, admin_headers: dict[str, str]) -> None:
    """Reload `model` with new stubs. A plain load of an unchanged model is a no-op, and an unload would take
    its dependents (the ensemble) down with it; a config override with a fresh token forces a real reload
    while the dependents stay loaded. The override also counts the reloads (`watchdog_reloads`, one more than
    the config loaded now has), which the new stubs publish in the metrics (counters.Counters)."""
    config = client.get_model_config(model, as_json=True)["config"]
    parameters = config.setdefault("parameters", {})
    parameters["restart_token"] = {"string_value": uuid.uuid4().hex}
    reloads = int(parameters.get(RELOADS_PARAMETER, {}).get("string_value", "0"))  # 0: loaded from the repository
    parameters[RELOADS_PARAMETER] = {"string_value": str(reloads + 1)}
    client.load_model(model, config=json.dumps(config), headers=admin_headers)


# get_robust_list(2): the kernel's record of the robust mutexes each thread holds (its syscall number per arch)
GET_ROBUST_LIST = {"x86_64": 274, "aarch64": 100}.get(platform.machine())


def holds_robust_lock(pid: int) -> bool | None:
    """Whether a thread of the stopped process `pid` holds (or is taking or releasing) a robust pthread mutex;
    None where that cannot be read (another architecture, no ptrace access). glibc keeps each thread's robust
    mutexes on a list whose head it registers with the kernel: an empty list points to its own head, and
    `list_op_pending` is NULL outside a lock or unlock."""
    if GET_ROBUST_LIST is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    head, size = ctypes.c_void_p(), ctypes.c_size_t()
    try:
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            if libc.syscall(GET_ROBUST_LIST, int(tid), ctypes.byref(head), ctypes.byref(size)) != 0:
                return None
            if not head.value:  # this thread never registered a list: it has never taken a robust mutex
                continue
            first, _offset, pending = struct.unpack("QqQ", os.pread(mem, 24, head.value))
            if first != head.value or pending:
                return True
    except OSError:
        return None
    finally:
        os.close(mem)
    return False


def _stopped(pid: int, timeout_s: float) -> bool:
    """Every thread of `pid` is in the stopped state (SIGSTOP has reached them all) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            states = [
                Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                for tid in os.listdir(f"/proc/{pid}/task")
            ]
        except (OSError, IndexError):
            return False
        if all(state in "tT" for state in states):
            return True
        time.sleep(0.001)
    return False


def cpu_ticks(pid: int) -> tuple[int, int] | None:
    """(when `pid` started, the CPU time it has used: user and system), in clock ticks; None once it has exited
    (or is a zombie). The start tells a process from a later one given the same PID."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else (int(fields[19]), int(fields[11]) + int(fields[12]))


def kill_outside_locks(pid: int, attempts: int = 100, pause_s: float = 0.01) -> bool:
    """SIGKILL a stub at a moment when none of its threads holds a robust mutex.

    Every lock in python_backend's shared memory is a robust mutex: a stub that dies holding one makes the
    server's next lock of it throw, and Triton 2.51 aborts (docs/benchmarks/notes/lock-exception-r24.10.md). So the stub
    is stopped (SIGSTOP), its threads' robust-mutex lists are read, and it is killed while still stopped if they
    are all empty; else it runs on a moment (SIGCONT) and the next attempt looks again. Returns whether such a
    moment was found; after `attempts`, or where the lists cannot be read, it is killed anyway (False)."""
    for _ in range(attempts):
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return True
        held = holds_robust_lock(pid) if _stopped(pid, 0.5) else True
        if held is None:
            break
        try:
            os.kill(pid, signal.SIGKILL if not held else signal.SIGCONT)
        except ProcessLookupError:  # it ended meanwhile (its version unloaded)
            return True
        if not held:
            return True
        time.sleep(pause_s)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    return False


class StubWatchdog(threading.Thread):
    """Reload each model whose stub died. With `server_pid` (a server on this host, as `serve` runs it) the
    stub processes are looked at every `scan_s`: a death is seen within that time, whatever requests do. Every
    `interval_s` the pipeline is probed too, and a model named dead in the answer is reloaded. Each death found is
    recorded for the BLS callers before the reload (stub_deaths): their calls waiting on it give up at once.

    With `server_pid`, every `clients_s` the server's system and CUDA shared-memory regions of dead clients are
    unregistered and their /dev/shm files unlinked (shm.remove_stale_regions: regions named by clients of this
    PID namespace whose process is gone). A region a dead client's request still uses is left for the next round.

    With `server_pid`, the stubs of the versions a reload replaced are ended once they outlive it by
    `replaced_grace_s`, or at once when another reload starts. Nothing sends them requests any more, but on a
    GPU 2.51 never finishes unloading a version whose dead stub holds a request, and every stub left is a CUDA
    context and an MPS client: measured on an H200 under MPS, with 6 of them left a second reload soon after a
    first could not start its stubs ("CUDA-capable device(s) is/are busy or unavailable", likely MPS's client
    limit) and left its model unavailable."""

    def __init__(
        self,
        url: str,
        admin_headers: dict[str, str],
        interval_s: float = 10,
        log=print,
        server_pid: int | None = None,
        scan_s: float = 1,
        clients_s: float = 5,
        replaced_grace_s: float = REPLACED_GRACE_S,
    ):
        super().__init__(name="stub-watchdog", daemon=True)
        self.url, self.admin_headers, self.interval_s, self.log = url, admin_headers, interval_s, log
        self.server_pid, self.scan_s, self.clients_s = server_pid, scan_s, clients_s
        self.replaced_grace_s = replaced_grace_s
        self.stopped = threading.Event()
        self.models: dict[int, str] = {}  # every stub seen alive: pid -> model
        self.reaped: set[int] = set()  # dead stubs already reloaded for
        self.zombies: set[int] = set()  # stubs seen exited and unreaped at the last scan
        self.replaced: dict[int, float] = {}  # stubs of replaced versions -> when their reload ended
        self.retry: set[str] = set()  # models whose reload failed: tried again at the next probe
        if server_pid is not None:
            stub_deaths.forget_stale()
        self.scan()

    def scan(self) -> list[str]:
        """Models with a stub that died since it was seen alive (each death counted once)."""
        if self.server_pid is None:
            return []
        dead, zombies = set(), set()
        for pid, model in stub_processes(self.server_pid).items():
            if model is not None:
                self.models[pid] = model
            elif pid in self.models and pid not in self.reaped and pid not in self.replaced:
                zombies.add(pid)
                if pid in self.zombies:  # still unreaped a scan later: not a stub the server is tearing down
                    self.reaped.add(pid)
                    dead.add(self.models[pid])
        self.zombies = zombies
        return sorted(dead)

    def reload(self, models: list[str], why: str) -> list[str]:
        """Reload `models`, then the BLS models that call them. Served again once `models` are: a caller's call
        that waited on the dead stub has given up meanwhile (stub_deaths). The callers follow because on a GPU
        2.51 never answers such a call, so each caller instance keeps a thread waiting on it for good; their
        reload comes second so that it does not slow the first (on an H200 under MPS, resnet's two stubs reloaded
        beside the pipeline's sixteen reached their own setup only once the pipeline had loaded: 32 s in all), and
        once the replaced stubs of `models` have ended, so that one reload's new stubs at a time need room beside
        what runs (the headroom `serve` sizes the counts with, rules.reload_headroom). Two models reloaded at once
        (their stubs died within the same second) start their new stubs together."""
        callers = bls_callers(models)
        also = f", then its callers {', '.join(callers)}" if callers else ""
        for model in models:
            self.log(f"watchdog: the stub of {model!r} {why}; reloading {model}{also}")
        if models:
            self.end_replaced(at_once=True)  # room for the new stubs
            self.replace(models)
            if callers:
                try:
                    self.end_replaced_once_idle(models)
                finally:  # the callers' instances wait on the dead stub for good until they are reloaded
                    if not self.stopped.is_set():
                        self.replace(callers, " (calling the reloaded)")
        return models

    def replace(self, names: list[str], what: str = "") -> None:
        """Reload `names` at once with new stubs; the old ones are ended if they outlive the grace."""
        old = self.live_stubs(names)
        started = time.monotonic()

        def reload_one(model: str) -> Exception | None:
            try:
                restart(client, model, self.admin_headers)
            except Exception as exc:
                return exc
            return None

        with grpcclient.InferenceServerClient(self.url) as client, ThreadPoolExecutor(4) as pool:
            errors = dict(zip(names, pool.map(reload_one, names)))
        done = time.monotonic()
        # the stubs of the versions replaced; a model whose load failed may still be served by its old ones
        self.replaced.update({pid: done for pid, model in old.items() if errors[model] is None})
        # the new stubs, as seen alive: a death is only counted for a stub seen alive, and the next scan is a
        # second away (measured on an H200: a pipeline stub killed within it was found 80 s later, by a probe)
        self.models.update(self.live_stubs(names))
        if failed := [model for model in names if errors[model] is not None]:
            self.retry.update(failed)  # a failed load can leave its model unavailable: not left like that
            raise errors[failed[0]]
        self.log(f"watchdog: reloaded {', '.join(names)}{what} in {done - started:.1f} s")

    def live_stubs(self, models: list[str]) -> dict[int, str]:
        """{pid: model} of the live stubs of `models`."""
        if self.server_pid is None:
            return {}
        return {pid: model for pid, model in stub_processes(self.server_pid).items() if model in models}

    def end_replaced(self, at_once: bool = False) -> list[int]:
        """SIGKILL the stubs of replaced versions that are still alive `replaced_grace_s` after their reload (all
        of them `at_once`), each while it holds no lock in shared memory (`kill_outside_locks`). Returns their
        PIDs."""
        if not self.replaced:
            return []
        alive = {pid for pid, model in stub_processes(self.server_pid).items() if model is not None}
        now, ended = time.monotonic(), []
        for pid, since in list(self.replaced.items()):
            if pid not in alive:
                self.replaced.pop(pid, None)  # its version unloaded (or it died): the server reaps it
            elif at_once or now - since >= self.replaced_grace_s:
                ended.append(self.end_stub(pid))
        if ended:
            names = sorted({self.models.get(pid, "?") for pid in ended})
            self.log(
                f"watchdog: ended {len(ended)} stubs of replaced versions of {', '.join(names)} still alive after "
                "their reload (2.51 does not finish unloading a version with a request on a dead stub)"
            )
        return ended

    def end_stub(self, pid: int) -> int:
        """SIGKILL the replaced stub `pid` while it holds no lock (`kill_outside_locks`), as one the watchdog ended,
        not a death to reload for. Returns the PID."""
        kill_outside_locks(pid)
        self.reaped.add(pid)
        self.replaced.pop(pid, None)
        return pid

    def end_replaced_once_idle(self, models: list[str]) -> list[int]:
        """SIGKILL the live stubs of replaced versions of `models`, each once it is idle (it used no CPU time for
        IDLE_S: its last batch is done, and the new version takes every new one) and at the latest
        `replaced_grace_s` after now, each while it holds no lock (`kill_outside_locks`). A model that makes BLS
        calls itself waits idle on their answers: its stubs are ended at the grace only. The watchdog neither scans
        nor probes meanwhile (a second or so on a GPU, where a batch takes milliseconds). Returns their PIDs."""
        pending = {pid for pid in self.replaced if self.models.get(pid) in models}
        deadline, ended = time.monotonic() + self.replaced_grace_s, []
        seen, idle_for = {pid: cpu_ticks(pid) for pid in pending}, dict.fromkeys(pending, 0)
        while pending and not self.stopped.wait(IDLE_S):
            for pid in sorted(pending):
                before, now = seen[pid], cpu_ticks(pid)
                if now is None or before is None or now[0] != before[0]:  # it has ended (its version unloaded;
                    pending.discard(pid)  # the server reaps it), and its PID may be another process's by now
                    self.replaced.pop(pid, None)
                    continue
                idle_for[pid] = idle_for[pid] + 1 if now[1] - before[1] <= IDLE_TICKS else 0
                seen[pid] = now
                if time.monotonic() >= deadline or (
                    idle_for[pid] >= IDLE_SAMPLES and self.models[pid] not in BLS_CALLS
                ):
                    pending.discard(pid)
                    ended.append(self.end_stub(pid))
        if ended:
            self.log(f"watchdog: ended {len(ended)} replaced stubs of {', '.join(models)} once idle")
        return ended

    def check(self, probe_too: bool = True) -> list[str]:
        """End what outlived its reload, reload the models whose stubs died; then (`probe_too`) retry the reloads
        that failed, probe, reload what the answer names dead, probe again (a dead stage can hide behind a dead
        pipeline). Returns the reloaded models."""
        self.end_replaced()
        retry, self.retry = (sorted(self.retry), set()) if probe_too else ([], self.retry)
        reloaded = self.reload(retry, "was not replaced (its reload failed)") if retry else []
        reloaded += self.reload(self.died([m for m in self.scan() if m not in reloaded]), "exited")
        for _ in range(4 if probe_too else 0):
            dead = sorted(set(DEAD_STUB.findall(probe(self.url) or "")) - set(reloaded))
            if not dead:
                break
            reloaded += self.reload(self.died(dead), "is not healthy")
        return reloaded

    def died(self, models: list[str]) -> list[str]:
        """Record that `models` lost a stub, for the BLS calls that wait on them (stub_deaths): they give up now."""
        if self.server_pid is not None:
            for model in models:
                try:
                    stub_deaths.record(self.server_pid, model)
                except OSError as exc:  # the reload goes on; the waiting calls end at their deadline instead
                    self.log(f"watchdog: could not record that {model} lost a stub ({exc})")
        return models

    def remove_dead_clients_regions(self) -> list[str]:
        """Unregister (and unlink) the shared-memory regions of this host's clients that died without closing them.
        Only with `server_pid`: a client's process is looked up on this host, so the server must be on it too."""
        if self.server_pid is None:
            return []
        with grpcclient.InferenceServerClient(self.url) as client:
            removed = remove_stale_regions(client, self.admin_headers, in_use_wait_s=0)
        if removed:
            self.log(f"watchdog: removed the shared-memory regions of dead clients: {', '.join(removed)}")
        return removed

    def run(self) -> None:
        ticks, every = 0, max(1, round(self.interval_s / self.scan_s)) if self.server_pid else 1
        clients_every = max(1, round(self.clients_s / self.scan_s))
        while not self.stopped.wait(self.scan_s if self.server_pid else self.interval_s):
            ticks += 1
            try:
                self.check(probe_too=ticks % every == 0)
            except Exception as exc:  # the server may be stopping; try again next round
                self.log(f"watchdog: {exc}")
            if self.server_pid and ticks % clients_every == 0:
                try:
                    self.remove_dead_clients_regions()
                except Exception as exc:
                    self.log(f"watchdog: shared-memory regions of dead clients: {exc}")

    def stop(self) -> None:
        self.stopped.set()
        if self.server_pid is not None:
            stub_deaths.forget(self.server_pid)
