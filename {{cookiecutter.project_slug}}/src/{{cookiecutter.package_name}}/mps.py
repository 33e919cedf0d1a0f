"""CUDA MPS (Multi-Process Service) for the server's GPU processes: one private control daemon per run.

Every Python-backend instance is a process with its own CUDA context, and kernels of different contexts take turns
on the GPU. Under MPS they run concurrently (docs/performance.md, "CUDA MPS"). `TritonServer.start()` (and so
`serve`) starts an MPS control daemon for its run before tritonserver, and `TritonServer.stop()` stops it after:

- the daemon runs in the foreground (`nvidia-cuda-mps-control -f`) as a child of this process, so its PID is known;
  its pipe and log directories are in the run's own directory, `<tmp>/<slug>-mps-<uid>/<pid>-<token>/{pipe,log}`,
  and tritonserver (and through it every stub) gets the same CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY;
- stopping sends `quit` with a time limit (after stubs were killed, `quit` can hang for minutes), then ends the
  daemon by its PID, and any MPS server it had started;
- should this process die without stopping it, the kernel sends the daemon SIGTERM (PR_SET_PDEATHSIG), and the next
  start removes what a run whose owner is gone left behind: its daemon, its MPS server, its directory.

Where MPS cannot run, the server runs without it and `status` says why in one line: no GPU, `--no-mps`, no
`nvidia-cuda-mps-control`, an exclusive-process or prohibited or MIG GPU, or an MPS daemon of another user.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .machine import MAX_CLIENTS, Process, _stat, alive, processes, terminate_with_parent
from .paths import NotPrivate, private_dir, user_tmp

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
# /proc/<pid>/comm holds 15 characters: "nvidia-cuda-mps" for both the control daemon and the MPS server.
COMM = CONTROL[:15]
START_TIMEOUT_S = 10.0
QUIT_TIMEOUT_S = 3.0  # `quit` and the daemon's exit: at most this long before it is ended by its PID
# The longest MpsDaemon.stop() takes: quit, then SIGTERM (1 s) and SIGKILL, then the same for a leftover MPS
# server. The shutdown budgets (compose stop_grace_period, the pod's terminationGracePeriodSeconds) include it.
STOP_LIMIT_S = QUIT_TIMEOUT_S + 3
SOCKET_PATH_MAX = 100  # a Unix socket path holds at most 107 bytes; the daemon's sockets live in the pipe dir


class MpsUnavailable(Exception):
    """Why MPS is off on this machine; str() is the line `serve` prints."""


def _uses_pipe(pid: int, pipe_dir: Path) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{PIPE_ENV}={pipe_dir}".encode() in environ


def mps_processes(pipe_dir: Path, daemon_pid: int | None = None) -> list[Process]:
    """The MPS processes of one daemon: those whose environment names its pipe directory, and its children."""
    return [
        p
        for p in processes()
        if p.comm == COMM and (p.pid == daemon_pid or p.ppid == daemon_pid or _uses_pipe(p.pid, pipe_dir))
    ]


def kill(procs: list[Process], grace_s: float = 1.0) -> None:
    """SIGTERM, then SIGKILL what is still there after `grace_s`; a PID now naming another process is left alone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = [p for p in procs if alive(p.pid, p.start)]
        for p in procs:
            try:
                os.kill(p.pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while procs and time.monotonic() < deadline and any(alive(p.pid, p.start) for p in procs):
            time.sleep(0.05)


def run_root() -> Path:
    """This user's directory of MPS runs (paths.user_tmp): short, as the daemon's socket paths must be."""
    root = user_tmp("mps")
    return root if len(str(root)) < SOCKET_PATH_MAX - 40 else Path("/tmp") / root.name


def _visible(rows: list[list[str]]) -> list[list[str]]:
    """The nvidia-smi rows (index, uuid, ...) of the GPUs CUDA_VISIBLE_DEVICES names (all of them without it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return rows
    wanted = [d.strip() for d in visible.split(",") if d.strip()]
    return [r for r in rows if any(w == r[0] or (w.startswith("GPU-") and r[1].startswith(w)) for w in wanted)]


def check_gpus() -> None:
    """MpsUnavailable if a GPU the server sees cannot take a private MPS daemon."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if any(d.strip().startswith("MIG-") for d in visible.split(",")):
        raise MpsUnavailable("the GPU is a MIG instance (CUDA_VISIBLE_DEVICES names a MIG device)")
    argv = ["nvidia-smi", "--query-gpu=index,uuid,compute_mode,mig.mode.current", "--format=csv,noheader"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return  # no nvidia-smi to ask: try, the daemon itself fails where it cannot run
    rows = [[v.strip() for v in line.split(",")] for line in out.stdout.splitlines() if line.count(",") >= 3]
    for index, _, mode, mig in _visible(rows):
        if mode.replace(" ", "_").lower() in ("exclusive_process", "exclusive_thread"):
            raise MpsUnavailable(
                f"GPU {index} is in {mode} compute mode (set by its administrator, who may run MPS for it: "
                "`nvidia-smi -c DEFAULT` makes it shared)"
            )
        if mode.lower() == "prohibited":
            raise MpsUnavailable(f"GPU {index} is in Prohibited compute mode")
        if mig.lower() == "enabled":
            raise MpsUnavailable(f"GPU {index} has MIG enabled")


def check_other_users() -> None:
    """MpsUnavailable if an MPS daemon or server of another user runs here: one GPU takes one user's MPS server."""
    for p in processes():
        if p.comm == COMM and p.uid != os.getuid():
            try:
                user = pwd.getpwuid(p.uid).pw_name
            except KeyError:
                user = str(p.uid)
            raise MpsUnavailable(f"an MPS daemon of user {user} (pid {p.pid}) already runs on this machine")


def remove_stale(root: Path) -> list[Path]:
    """Remove the runs under `root` whose owner is gone: their MPS processes and directories. Returns them."""
    removed = []
    for run in sorted(root.glob("*-*")) if root.is_dir() else []:
        try:
            owner = json.loads((run / "owner.json").read_text())
        except (OSError, ValueError):
            owner = {}
        if owner and alive(owner["pid"], owner.get("start")):
            continue
        try:
            if not owner and time.time() - run.stat().st_mtime < 60:
                continue  # being set up right now
        except OSError:  # removed meanwhile
            continue
        kill(mps_processes(run / "pipe", owner.get("daemon_pid")))
        shutil.rmtree(run, ignore_errors=True)
        removed.append(run)
    return removed


class MpsDaemon:
    """A private MPS control daemon: `MpsDaemon.start()`, `env` for the server, `stop()`."""

    def __init__(self, run_dir: Path, process: subprocess.Popen, binary: str):
        self.run_dir, self.process, self.binary = run_dir, process, binary

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def pipe_dir(self) -> Path:
        return self.run_dir / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "log"

    @property
    def env(self) -> dict[str, str]:
        """What the server and its stubs need in their environment to be clients of this daemon."""
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    @classmethod
    def start(cls, root: Path | None = None) -> MpsDaemon:
        """Start a daemon in a new run directory under `root`; MpsUnavailable (after cleaning up) if it cannot."""
        binary = shutil.which(CONTROL)
        if binary is None:
            raise MpsUnavailable(
                f"{CONTROL} is not installed (it comes with the NVIDIA driver; a container gets it with the "
                "`compute` driver capability)"
            )
        check_gpus()
        check_other_users()
        root = root or run_root()
        root.parent.mkdir(parents=True, exist_ok=True)
        try:  # never a symlink or another user's folder: remove_stale deletes what is in it
            private_dir(root)
        except NotPrivate as exc:
            raise MpsUnavailable(str(exc)) from None
        remove_stale(root)
        run_dir = root / f"{os.getpid()}-{secrets.token_hex(4)}"
        for directory in (run_dir, run_dir / "pipe", run_dir / "log"):
            directory.mkdir(mode=0o700)
        owner = {"pid": os.getpid(), "start": _stat(os.getpid())[2]}
        (run_dir / "owner.json").write_text(json.dumps(owner))
        env = dict(os.environ, **{PIPE_ENV: str(run_dir / "pipe"), LOG_ENV: str(run_dir / "log")})
        with open(run_dir / "log" / "control-stdout.log", "wb") as out:
            process = subprocess.Popen(
                [binary, "-f"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches serve, which stops the server first, then the daemon
                preexec_fn=terminate_with_parent,
            )
        daemon = cls(run_dir, process, binary)
        (run_dir / "owner.json").write_text(json.dumps({**owner, "daemon_pid": process.pid}))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (daemon.pipe_dir / "control").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                output = (daemon.log_dir / "control-stdout.log").read_text(errors="replace").strip()
                daemon.stop()
                why = f"exited with code {process.returncode}" if process.returncode is not None else "did not start"
                last = output.splitlines()[-1] if output else "no output"
                raise MpsUnavailable(f"{CONTROL} {why} ({last})")
            time.sleep(0.05)
        return daemon

    def control(self, command: str, timeout_s: float = QUIT_TIMEOUT_S) -> str:
        """One command to the daemon (`get_server_list`, `quit`, ...), its answer; TimeoutExpired after timeout_s."""
        client = subprocess.Popen(
            [self.binary],
            env=dict(os.environ, **self.env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            return client.communicate(command + "\n", timeout=timeout_s)[0]
        except subprocess.TimeoutExpired:
            os.killpg(client.pid, signal.SIGKILL)
            client.communicate()
            raise

    def server_pids(self) -> list[int]:
        return [int(line) for line in self.control("get_server_list").split() if line.isdigit()]

    def client_pids(self) -> list[int]:
        """The PIDs of the CUDA processes connected to this daemon's MPS servers."""
        return [int(p) for s in self.server_pids() for p in self.control(f"get_client_list {s}").split() if p.isdigit()]

    def stop(self, timeout_s: float = QUIT_TIMEOUT_S) -> None:
        """`quit` within timeout_s, else SIGTERM, then SIGKILL; the same for an MPS server left behind. Idempotent."""
        leftovers = mps_processes(self.pipe_dir, self.pid)  # before the daemon goes: its children are its servers
        if self.process.poll() is None:
            deadline = time.monotonic() + timeout_s
            try:
                self.control("quit", timeout_s)
                self.process.wait(max(0.0, deadline - time.monotonic()))
            except (OSError, subprocess.TimeoutExpired):
                self.process.terminate()
                try:
                    self.process.wait(1)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        kill([p for p in leftovers if p.pid != self.pid] + mps_processes(self.pipe_dir))
        shutil.rmtree(self.run_dir, ignore_errors=True)


def start(gpus: list[int], enabled: bool = True) -> tuple[MpsDaemon | None, str]:
    """(the run's daemon or None, one line saying whether MPS is on and why not) for a server on `gpus`."""
    if not gpus:
        return None, "off (no GPU)"
    if not enabled:
        return None, "off (--no-mps)"
    if os.environ.get(PIPE_ENV):
        return None, f"the MPS daemon of {PIPE_ENV}={os.environ[PIPE_ENV]} (not started here)"
    try:
        daemon = MpsDaemon.start()
    except MpsUnavailable as exc:
        return None, f"off: {exc}"
    except Exception as exc:  # never worth failing the server for: it runs without MPS
        return None, f"off: could not start {CONTROL}: {exc!r}"
    return daemon, f"on (a private daemon, pid {daemon.pid}; --no-mps turns it off)"


def clients_needed(repository: Path | str, gpu: int = 0) -> tuple[int, str]:
    """The most MPS clients the repository's server takes on GPU `gpu`, and when: its stubs there, tritonserver,
    and the new stubs of the reload that starts the most (rules.mps_clients, the rule `serve` sizes the counts by)."""
    from .model_repository import instances_on_gpu, load_configs, loaded_versions
    from .rules import mps_clients

    configs = load_configs(repository)
    counts = {name: instances_on_gpu(config, gpu) for name, config in configs.items()}
    # every loaded version has its own stubs (recipe 3 keeps two resnets)
    stubs = {name: n * loaded_versions(Path(repository) / name, configs[name]) for name, n in counts.items() if n}
    clients, reload, models = mps_clients(stubs)
    running = sum(stubs.values())
    return clients, f"{running} stubs and tritonserver, then a reload of {models} ({reload} new stubs)"


def clients_warning(repository: Path | str, gpus: list[int]) -> str | None:
    """One line when some GPU's MPS clients could pass MAX_CLIENTS (None when they cannot)."""
    for gpu in gpus:
        need, why = clients_needed(repository, gpu)
        if need > MAX_CLIENTS:
            return (
                f"warning: GPU {gpu} may need {need} MPS clients ({why}), over the {MAX_CLIENTS} MPS takes: a reload "
                'after a stub dies could not start its stubs. Fewer instances (docs/performance.md, "MPS clients") '
                "or --no-mps."
            )
    return None
