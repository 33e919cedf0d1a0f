"""CUDA MPS (mps.py): the daemon's lifecycle, each reason MPS stays off, what the server is given; on a GPU, that
the stubs really are MPS clients.

Without a GPU: `nvidia-cuda-mps-control`, its MPS server and `nvidia-smi` are NVIDIA driver programs, and small
shell scripts on PATH stand in for them (FAKE_MPS=ok|fail|hang: a daemon that works, fails to start, or ignores
`quit` and SIGTERM). The server is always the real tritonserver.

On a GPU (marked `gpu`): the session server (the shipped counts, under MPS by default) lists every stub as an MPS
client in nvidia-smi and answers as the in-process reference does; the real `serve` leaves no MPS process after
SIGTERM, and `serve --no-mps` serves without one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import EXTERNAL_GRPC_URL, PROJECT, image_input, infer, make_image

from {{ cookiecutter.package_name }} import mps
from {{ cookiecutter.package_name }}.model_repository import set_instance_counts
from {{ cookiecutter.package_name }}.server import ServerSettings, TritonServer, free_port, server_flags

local_server_only = pytest.mark.skipif(bool(EXTERNAL_GRPC_URL), reason="starts its own local server")

FAKE_CONTROL = r"""#!/bin/sh
# Stands in for NVIDIA's nvidia-cuda-mps-control. FAKE_MPS: ok (default), fail, hang (ignores quit and SIGTERM).
pipe="${CUDA_MPS_PIPE_DIRECTORY:?}"
if [ "$1" = "-f" ]; then
    if [ "$FAKE_MPS" = fail ]; then echo "An instance of this daemon is already running"; exit 1; fi
    echo "Starting control daemon using socket $pipe/control"
    "$(dirname "$0")/nvidia-cuda-mps-server" &
    echo $! > "$pipe/server.pid"
    if [ "$FAKE_MPS" = hang ]; then trap '' TERM; fi
    : > "$pipe/control"
    while [ ! -e "$pipe/quit" ] || [ "$FAKE_MPS" = hang ]; do sleep 0.05; done
    kill "$(cat "$pipe/server.pid")"
    exit 0
fi
read -r command argument
case "$command" in
    quit) if [ "$FAKE_MPS" = hang ]; then exec sleep 600; fi; : > "$pipe/quit" ;;
    get_server_list) cat "$pipe/server.pid" ;;
esac
"""
FAKE_SERVER = """#!/bin/sh
# Stands in for nvidia-cuda-mps-server, which the control daemon starts.
while :; do sleep 0.1; done
"""
FAKE_SMI = """#!/bin/sh
# Stands in for nvidia-smi: one GPU, FAKE_COMPUTE_MODE and FAKE_MIG.
case "$*" in
    -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-fake-0)" ;;
    *--query-gpu=index,uuid,compute_mode,mig.mode.current*)
        echo "0, GPU-fake-0, ${FAKE_COMPUTE_MODE:-Default}, ${FAKE_MIG:-[N/A]}" ;;
    *) exit 1 ;;
esac
"""


def write_script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def fake_driver(tmp_path, monkeypatch):
    """The driver's programs as scripts on PATH, one GPU visible, MPS runs in a temporary directory; their bin."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_script(bin_dir / "nvidia-cuda-mps-control", FAKE_CONTROL)
    write_script(bin_dir / "nvidia-cuda-mps-server", FAKE_SERVER)
    write_script(bin_dir / "nvidia-smi", FAKE_SMI)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    short = Path(tempfile.mkdtemp(prefix="mps-test-"))  # mps.run_root() goes under it: a short path
    monkeypatch.setenv("TMPDIR", str(short))
    for name in ("CUDA_VISIBLE_DEVICES", mps.PIPE_ENV, mps.LOG_ENV, "FAKE_MPS", "FAKE_COMPUTE_MODE", "FAKE_MIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert mps.run_root().parent == short
    yield bin_dir
    shutil.rmtree(short, ignore_errors=True)


def mps_pids(pipe_dir: Path) -> set[int]:
    return {p.pid for p in mps.mps_processes(pipe_dir)}


def wait_until(condition, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- the daemon -----------------------------------------------------------------------------------------------


def test_the_daemon_runs_in_a_private_run_directory_and_stop_leaves_nothing(fake_driver):
    daemon = mps.MpsDaemon.start()
    try:
        assert daemon.run_dir.parent == mps.run_root() and daemon.run_dir.name.startswith(f"{os.getpid()}-")
        assert daemon.env == {mps.PIPE_ENV: str(daemon.run_dir / "pipe"), mps.LOG_ENV: str(daemon.run_dir / "log")}
        assert (daemon.pipe_dir / "control").exists() and daemon.process.poll() is None
        (server,) = daemon.server_pids()
        # the daemon and the MPS server it started (the stand-in shell scripts also fork now and then)
        assert mps_pids(daemon.pipe_dir) >= {daemon.pid, server}
        assert oct(daemon.run_dir.stat().st_mode & 0o777) == oct(0o700)
        started = time.monotonic()
        daemon.stop()
        assert time.monotonic() - started < 2, "a daemon that quits is not waited for"
    finally:
        daemon.stop()  # idempotent
    assert daemon.process.returncode == 0, "stopped by `quit`"
    assert mps_pids(daemon.pipe_dir) == set() and not mps.alive(server)
    assert not daemon.run_dir.exists()


def test_a_daemon_that_ignores_quit_and_sigterm_is_ended_by_its_pid_within_the_time_limit(fake_driver, monkeypatch):
    monkeypatch.setenv("FAKE_MPS", "hang")
    daemon = mps.MpsDaemon.start()
    (server,) = daemon.server_pids()
    started = time.monotonic()
    daemon.stop(timeout_s=1)
    took = time.monotonic() - started
    assert daemon.process.returncode == -signal.SIGKILL
    assert mps_pids(daemon.pipe_dir) == set() and not mps.alive(server)
    assert not daemon.run_dir.exists()
    assert took < 1 + 1 + 3, f"stop took {took:.1f} s"  # quit's limit, SIGTERM's grace, a margin


CRASHING_SERVE = """
import os, sys
from {{ cookiecutter.package_name }} import mps
daemon = mps.MpsDaemon.start()
print(daemon.pid, daemon.server_pids()[0], daemon.run_dir, flush=True)
sys.stdin.read()  # until the test kills this process
"""


@pytest.mark.parametrize("daemon_mode", ["ok", "hang"])
def test_a_crashed_owner_leaves_no_daemon_that_breaks_the_next_start(fake_driver, monkeypatch, daemon_mode):
    """serve killed outright (SIGKILL, OOM): its daemon gets SIGTERM from the kernel, and whatever survives that
    (a daemon that ignores it, or the MPS server) goes at the next start."""
    monkeypatch.setenv("FAKE_MPS", daemon_mode)
    owner = subprocess.Popen(
        [sys.executable, "-c", CRASHING_SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    daemon_pid, server_pid, run_dir = owner.stdout.readline().split()
    daemon_pid, server_pid, run_dir = int(daemon_pid), int(server_pid), Path(run_dir)
    owner.kill()
    owner.wait()
    if daemon_mode == "ok":  # PR_SET_PDEATHSIG: the daemon went with its owner
        assert wait_until(lambda: not mps.alive(daemon_pid))
    else:
        assert mps.alive(daemon_pid)
    monkeypatch.setenv("FAKE_MPS", "ok")
    daemon = mps.MpsDaemon.start()
    try:
        assert not run_dir.exists(), "the dead owner's run directory is gone"
        assert not mps.alive(daemon_pid) and not mps.alive(server_pid)
        assert [p.name for p in mps.run_root().iterdir()] == [daemon.run_dir.name]
    finally:
        daemon.stop()


def test_a_live_owners_run_is_left_alone(fake_driver):
    first = mps.MpsDaemon.start()
    try:
        second = mps.MpsDaemon.start()  # another server of this process (or of another live serve)
        assert first.process.poll() is None and (first.pipe_dir / "control").exists()
        assert first.pipe_dir != second.pipe_dir
        second.stop()
        assert first.process.poll() is None
    finally:
        first.stop()


# --- why MPS is off --------------------------------------------------------------------------------------------


def test_no_gpu_means_mps_off_without_asking_the_driver(fake_driver, monkeypatch):
    monkeypatch.setattr(mps.MpsDaemon, "start", lambda: pytest.fail("no GPU: nothing to start"))
    assert mps.start([]) == (None, "off (no GPU)")


def test_no_mps_opts_out(fake_driver):
    assert mps.start([0], enabled=False) == (None, "off (--no-mps)")
    assert not mps.run_root().exists()


def test_no_control_binary(fake_driver, monkeypatch):
    (fake_driver / "nvidia-cuda-mps-control").unlink()
    monkeypatch.setenv("PATH", str(fake_driver))  # the fake nvidia-smi alone: a GPU machine has the real control too
    assert mps.shutil.which(mps.CONTROL) is None
    daemon, status = mps.start([0])
    assert daemon is None
    assert status.startswith("off: nvidia-cuda-mps-control is not installed") and "\n" not in status


@pytest.mark.parametrize(
    ("env", "why"),
    [
        ({"FAKE_COMPUTE_MODE": "Exclusive_Process"}, "off: GPU 0 is in Exclusive_Process compute mode"),
        ({"FAKE_COMPUTE_MODE": "Prohibited"}, "off: GPU 0 is in Prohibited compute mode"),
        ({"FAKE_MIG": "Enabled"}, "off: GPU 0 has MIG enabled"),
        ({"CUDA_VISIBLE_DEVICES": "MIG-4f3a2b1c-0000-0000-0000-000000000000"}, "off: the GPU is a MIG instance"),
    ],
    ids=["exclusive-process", "prohibited", "mig", "mig-device"],
)
def test_a_gpu_that_cannot_take_a_private_daemon(fake_driver, monkeypatch, env, why):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    daemon, status = mps.start([0])
    assert daemon is None and status.startswith(why) and "\n" not in status
    assert not list(mps.run_root().glob("*/pipe")), "no run directory is left"


def test_an_mps_daemon_of_another_user(fake_driver, monkeypatch):
    other = mps.Process(pid=4242, ppid=1, uid=os.getuid() + 1, comm=mps.COMM, start="1")
    monkeypatch.setattr(mps, "processes", lambda: [other])
    daemon, status = mps.start([0])
    assert daemon is None
    assert status.startswith("off: an MPS daemon of user ") and "(pid 4242) already runs" in status


def test_a_daemon_that_fails_to_start(fake_driver, monkeypatch):
    monkeypatch.setenv("FAKE_MPS", "fail")
    daemon, status = mps.start([0])
    assert daemon is None
    assert status == "off: nvidia-cuda-mps-control exited with code 1 (An instance of this daemon is already running)"
    assert list(mps.run_root().iterdir()) == [], "its run directory is removed"


def test_a_daemon_set_up_outside_is_used_as_it_is(fake_driver, monkeypatch, tmp_path):
    """The NVIDIA device plugin's MPS sharing sets CUDA_MPS_PIPE_DIRECTORY in the pod: serve starts none."""
    monkeypatch.setenv(mps.PIPE_ENV, str(tmp_path / "cluster-mps"))
    daemon, status = mps.start([0])
    assert daemon is None
    assert status == f"the MPS daemon of {mps.PIPE_ENV}={tmp_path / 'cluster-mps'} (not started here)"


# --- what the server gets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_mps", [True, False], ids=["mps", "no-mps"])
def test_the_server_gets_the_daemons_directories_and_the_same_flags(fake_driver, tmp_path, use_mps):
    settings = ServerSettings(tmp_path / "model_repository", gpus=[0], mps=use_mps)
    triton = TritonServer(settings, container=False)
    triton.start_mps()
    try:
        argv, env = triton.command()
        assert argv[1:] == [*server_flags(settings), next(a for a in argv if a.startswith("--backend-directory="))]
        if use_mps:
            assert triton.mps_status.startswith(f"on (a private daemon, pid {triton.mps.pid};")
            assert env[mps.PIPE_ENV] == str(triton.mps.pipe_dir) and env[mps.LOG_ENV] == str(triton.mps.log_dir)
        else:
            assert triton.mps is None and triton.mps_status == "off (--no-mps)"
            assert mps.PIPE_ENV not in env and mps.LOG_ENV not in env
    finally:
        triton.stop()  # never started: stops only the daemon
    assert triton.mps is None and list(mps.run_root().glob("*")) == []


def test_serve_parses_no_mps():
    from {{ cookiecutter.package_name }} import cli

    seen = {}

    def fake_serve(args):
        seen["mps"] = args.mps
        return 0

    for argv, expected in ((["serve"], True), (["serve", "--no-mps"], False), (["serve", "--mps"], True)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cli, "serve", fake_serve)
            cli.main(argv)
        assert seen["mps"] is expected


def children(pid: int) -> list[int]:
    return [p.pid for p in mps.processes() if p.ppid == pid]


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def one_model_repository(tmp_path: Path) -> Path:
    """A repository of `postprocess` alone, one instance: the quickest real server with a Python-backend stub."""
    repo = tmp_path / "model_repository"
    repo.mkdir()
    shutil.copytree(PROJECT / "model_repository" / "postprocess", repo / "postprocess")
    set_instance_counts(repo, {"postprocess": 1})
    config = repo / "postprocess" / "config.pbtxt"  # its labels beside it: this repository has no resnet
    config.write_text(config.read_text().replace("../resnet/labels.txt", "labels.txt"))
    shutil.copy(PROJECT / "model_repository" / "resnet" / "labels.txt", repo / "postprocess" / "labels.txt")
    return repo


def infer_postprocess(grpc_url: str) -> None:
    """One request: the stub computes (on its GPU where there is one)."""
    import tritonclient.grpc as grpcclient

    logits = grpcclient.InferInput("LOGITS", [1, 1000], "FP32")
    logits.set_data_from_numpy(np.random.default_rng(0).standard_normal((1, 1000), dtype=np.float32))
    with grpcclient.InferenceServerClient(grpc_url) as client:
        assert client.infer("postprocess", [logits], client_timeout=120).as_numpy("CLASS_IDS").shape[0] == 1


@dataclass
class Serving:
    process: subprocess.Popen
    log: Path
    grpc_url: str
    banner: str  # serve's "CUDA MPS: ..." line
    tritonserver: int
    stubs: list[int]

    @property
    def daemon_pid(self) -> int | None:
        return int(self.banner.split("pid ")[1].split(";")[0]) if "a private daemon, pid " in self.banner else None


@contextlib.contextmanager
def serving(repo: Path, workdir: Path, *serve_args: str):
    """The real `serve` CLI in a subprocess, ready; killed at the end if the test has not stopped it."""
    ports = [str(free_port()) for _ in range(3)]
    argv = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", "serve", "--no-container", *serve_args]
    argv += ["--model-repository", str(repo), "--watchdog-interval", "0", "--timeout", "300"]
    argv += ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]
    log = workdir / f"serve-{len(list(workdir.glob('serve-*.log')))}.log"
    env = {**os.environ, "XDG_CONFIG_HOME": str(workdir)}  # serve's admin-key file: not the user's
    serve = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=workdir, env=env)
    try:
        assert wait_until(lambda: "\nready in " in log.read_text() or serve.poll() is not None, 300), log.read_text()
        output = log.read_text()
        assert serve.poll() is None, output[-3000:]
        (banner,) = [line for line in output.splitlines() if line.startswith("CUDA MPS: ")]
        run = Serving(serve, log, f"localhost:{ports[1]}", banner, 0, [])
        (run.tritonserver,) = [p for p in children(serve.pid) if p != run.daemon_pid]
        run.stubs = children(run.tritonserver)
        assert run.stubs, "the postprocess stub"
        yield run
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        print(textwrap.indent(log.read_text()[-3000:], "  serve: "))


def stop(run: Serving) -> None:
    """What `docker compose stop` or Ctrl-C does."""
    run.process.send_signal(signal.SIGTERM)
    assert run.process.wait(120) == 0, run.log.read_text()[-3000:]


@pytest.mark.e2e
@local_server_only
def test_serve_runs_tritonserver_and_its_stubs_as_clients_of_its_daemon_and_stops_it(fake_driver, tmp_path):
    """`serve` on a machine that reports a GPU (the real tritonserver, the models on the CPU): the banner says MPS
    is on, tritonserver and every stub have the daemon's pipe directory, and after SIGTERM the daemon, its MPS
    server and its run directory are gone."""
    with serving(one_model_repository(tmp_path), tmp_path) as run:
        assert run.banner.startswith("CUDA MPS: on (a private daemon, pid "), run.banner
        pipe_dir = Path(environ(run.daemon_pid)[mps.PIPE_ENV])
        for pid in [run.tritonserver, *run.stubs]:
            assert environ(pid)[mps.PIPE_ENV] == str(pipe_dir)
            assert environ(pid)[mps.LOG_ENV] == str(pipe_dir.parent / "log")
        assert len(mps_pids(pipe_dir)) >= 2, "the daemon and its MPS server"
        stop(run)
        assert mps_pids(pipe_dir) == set() and not mps.alive(run.daemon_pid)
        assert not pipe_dir.parent.exists()


# --- on a GPU ---------------------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def process_types() -> dict[int, str]:
    """pid -> its type in nvidia-smi's process table: C (compute), M+C (compute, an MPS client), M (MPS server)."""
    out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60).stdout
    rows = re.findall(r"^\|\s+\d+\s+\S+\s+\S+\s+(\d+)\s+([CGM+]+)\s", out, re.MULTILINE)
    return {int(pid): kind for pid, kind in rows}


def require_own_daemon(server) -> None:
    """Skip where MPS is off for one of the documented reasons; fail where the daemon itself failed."""
    if EXTERNAL_GRPC_URL:
        pytest.skip("a server started elsewhere (TRITON_GRPC_URL)")
    if server.mps is None:
        failed = "did not start" in server.mps_status or "exited with code" in server.mps_status
        assert not failed and "could not start" not in server.mps_status, server.mps_status
        pytest.skip(f"MPS is {server.mps_status}")


@pytest.mark.e2e
@pytest.mark.gpu
@needs_gpu
def test_gpu_mps_every_served_stub_is_an_mps_client(server, client):
    """The session server (the shipped instance counts) runs under its own MPS daemon by default: nvidia-smi lists
    every Python-backend stub as an MPS client (M+C)."""
    require_own_daemon(server)
    client.classify([make_image(1)])  # every stage has computed
    stubs = [p.pid for p in mps.processes() if p.ppid == server.process.pid]
    types = process_types()
    print(f"\nstubs {stubs}; nvidia-smi types {types}; MPS clients {server.mps.client_pids()}")
    assert stubs and {pid: types.get(pid) for pid in stubs} == dict.fromkeys(stubs, "M+C")


@pytest.mark.e2e
@pytest.mark.gpu
@needs_gpu
def test_gpu_mps_answers_match_the_in_process_reference(server, reference):
    """As test_gpu.py's test_gpu_answers_match_the_in_process_reference, on a server known to run under MPS."""
    require_own_daemon(server)
    tol = 1e-3 if reference.preprocess.dtype == torch.float32 else 2e-2
    batches = [[make_image(100 + i, size=(320 + 16 * i, 240)) for i in range(n)] for n in (1, 3, 8)]
    for model in [m for m in ("pipeline", "ensemble") if (PROJECT / "model_repository" / m).is_dir()]:
        for images in batches:
            result = infer(server.grpc_url, [image_input(images)], model)
            scores, class_ids = reference(images)
            np.testing.assert_allclose(result.as_numpy("SCORES"), scores.cpu().numpy(), atol=tol, rtol=1e-2)
            assert (result.as_numpy("CLASS_IDS")[:, 0] == class_ids[:, 0].cpu().numpy()).all()


@pytest.mark.e2e
@pytest.mark.gpu
@needs_gpu
@local_server_only
def test_gpu_serve_stops_its_mps_daemon_and_no_mps_serves_without_it(tmp_path):
    """The real `serve` on a one-model repository: its stub is an MPS client, and after SIGTERM no MPS process of
    the run is left; then `serve --no-mps`: no daemon, its stub a plain CUDA process (C)."""
    repo = one_model_repository(tmp_path)
    with serving(repo, tmp_path) as run:
        if run.daemon_pid is None:
            assert "did not start" not in run.banner and "exited with code" not in run.banner, run.banner
            pytest.skip(run.banner)
        infer_postprocess(run.grpc_url)
        (stub,) = run.stubs
        assert process_types().get(stub) == "M+C", process_types()
        pipe_dir = Path(environ(run.daemon_pid)[mps.PIPE_ENV])
        daemon = mps.MpsDaemon(pipe_dir.parent, None, shutil.which(mps.CONTROL))  # to ask it, not to stop it
        servers = daemon.server_pids()
        ours = {p.pid: p for p in mps.mps_processes(pipe_dir, run.daemon_pid)}
        ours |= {p.pid: p for p in mps.processes() if p.pid in servers}
        print(f"\nMPS servers {servers}, clients {daemon.client_pids()}, processes {ours}")
        assert servers and run.daemon_pid in ours, "the daemon and the MPS server it started"
        stop(run)
        assert not [p for p in ours.values() if mps.alive(p.pid, p.start)], "the daemon and its MPS server are gone"
        assert not pipe_dir.parent.exists()
    with serving(repo, tmp_path, "--no-mps") as run:
        assert run.banner == "CUDA MPS: off (--no-mps)"
        infer_postprocess(run.grpc_url)
        (stub,) = run.stubs
        assert mps.PIPE_ENV not in environ(stub)
        assert process_types().get(stub) == "C", process_types()
        stop(run)


def test_the_shipped_counts_leave_mps_room_for_a_reload_and_more_are_warned_of(tmp_path):
    """MPS takes 48 clients per GPU. The shipped counts need 29 at most: 18 stubs and tritonserver, then the
    largest reload's new stubs beside the old: the pipeline's 10 (a hot reload, or the watchdog's once a stage it
    calls is reloaded; that stage's own reload, the dead stub gone, starts fewer)."""
    repository = tmp_path / "model_repository"
    shutil.copytree(PROJECT / "model_repository", repository, ignore=shutil.ignore_patterns("*.pt"))
    need, why = mps.clients_needed(repository)
    print(f"\n{need} MPS clients: {why}")
    assert need <= mps.MAX_CLIENTS and mps.clients_warning(repository, [0]) is None
    set_instance_counts(repository, {"pipeline": 20})
    warning = mps.clients_warning(repository, [0])
    assert warning and warning.startswith("warning: GPU 0 may need") and "over the 48 MPS takes" in warning
    assert "reload of pipeline" in warning and "\n" not in warning
    assert mps.clients_warning(repository, []) is None  # no GPU: no MPS
