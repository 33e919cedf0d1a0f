"""Start the real Triton server, locally (the embedded default) or in the container, with one set of flags.

Locally and in the default image the server is `tritonserver` {{ cookiecutter.__triton_server_version }} from the `nvidia-pytriton` wheel:
no Docker, no GPU needed. In the NGC-based image (docker/ngc.Dockerfile) it is that image's own /opt/tritonserver.
All get their flags from `server_flags()`, so what the tests exercise is what `docker compose up` deploys.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import mps
from .admin_key import ADMIN_KEY_HEADER
from .machine import free_port, port_holder, terminate_with_parent, visible_gpus
from .model_repository import ENTRY_MODELS
from .paths import is_own_file
from .rules import MiB, cuda_pool_bytes
from .runtime import local_environment, local_tritonserver
from .shm import remove_stale_regions

CONTAINER_TRITONSERVER = Path("/opt/tritonserver")  # the NGC image's server
# Admin APIs that need the key; health, metadata and inference stay open. Clients send it as the header
# `admin-key` over HTTP and `triton-grpc-protocol-admin-key` (ADMIN_KEY_HEADER) over gRPC.
RESTRICTED_APIS = "model-repository,shared-memory,statistics,trace,logging"


def taken_ports(settings: ServerSettings) -> list[str]:
    """The server's ports that another program already listens on, each named with its holder where known: `serve`
    fails on them before anything starts, rather than once every model has loaded."""
    taken = []
    for kind, port in (("HTTP", settings.http_port), ("gRPC", settings.grpc_port), ("metrics", settings.metrics_port)):
        with socket.socket() as s:
            try:
                s.bind((settings.address, port))
                continue
            except OSError:
                pass
        holder = port_holder(port)
        taken.append(f"port {port} ({kind}) is in use" + (f" by {holder}" if holder else ""))
    return taken


@dataclass
class ServerSettings:
    model_repository: Path = Path("model_repository")
    http_port: int = {{ cookiecutter.http_port }}
    grpc_port: int = {{ cookiecutter.grpc_port }}
    metrics_port: int = {{ cookiecutter.metrics_port }}
    # Loopback by default; the container listens on all interfaces and compose decides what is published.
    address: str = "127.0.0.1"
    gpus: list[int] = field(default_factory=visible_gpus)
    exit_timeout_s: int = 30
    log_verbose: int = 0
    # The key for the admin APIs: $TRITON_ADMIN_KEY, else a new random one per server.
    admin_key: str = field(default_factory=lambda: os.environ.get("TRITON_ADMIN_KEY") or secrets.token_urlsafe(16))
    # Each Python-backend stub's /dev/shm region starts at shm_default_bytes and grows by shm_growth_bytes.
    shm_default_bytes: int = 16 * MiB
    shm_growth_bytes: int = 16 * MiB
    # Names this server's /dev/shm regions (one per Python-backend stub), so leaks can be traced to it.
    shm_prefix: str = field(default_factory=lambda: f"{{ cookiecutter.package_name }}_{secrets.token_hex(4)}_")
    # The models clients call. Stopping unloads these first, so their in-flight requests (and the BLS calls
    # they still have to make) finish before the server stops taking requests.
    entry_models: tuple[str, ...] = ENTRY_MODELS
    # CUDA MPS for the server's GPU processes (mps.py): a private daemon per server wherever there is a GPU.
    mps: bool = True
    # {model: instances per GPU (or in all on the CPU)} to serve instead of the configs' counts: the counts `serve`
    # sized (sizing.py). start() writes each model's config with its count as <model>/configs/<config_name>.pbtxt,
    # which Triton then reads instead of config.pbtxt (--model-config-name), and stop() removes them. None: the
    # configs as they are.
    instance_counts: dict[str, int] | None = None
    # Request tracing (trace_flags): an OpenTelemetry collector's URL (http://host:4318/v1/traces), or a file for
    # Triton's own JSON traces; every `trace_rate`-th request. None: off.
    trace: str | None = None
    trace_rate: int = 1

    @property
    def config_name(self) -> str:
        """The name of this server's sized configs (sized.write_configs): one per server, by its gRPC port."""
        from .sized import config_name

        return config_name(self.grpc_port)

    @classmethod
    def on_free_ports(cls, model_repository: Path, **options) -> ServerSettings:
        """Settings for a server beside others (tests, benchmarks): free loopback ports."""
        return cls(model_repository, free_port(), free_port(), free_port(), **options)

    @property
    def admin_headers(self) -> dict[str, str]:
        """gRPC headers that open the admin APIs."""
        return {ADMIN_KEY_HEADER: self.admin_key}


GRPC_MAX_CONNECTION_AGE_MS = 300_000
GRPC_MAX_CONNECTION_AGE_GRACE_MS = 60_000


def server_flags(settings: ServerSettings) -> list[str]:
    """The tritonserver command-line flags: the one source of truth for local runs and the container."""
    flags = [
        f"--model-repository={Path(settings.model_repository).resolve()}",
        f"--http-address={settings.address}",
        f"--http-port={settings.http_port}",
        f"--grpc-address={settings.address}",
        f"--grpc-port={settings.grpc_port}",
        f"--metrics-address={settings.address}",
        f"--metrics-port={settings.metrics_port}",
        "--model-control-mode=explicit",
        "--load-model=*",
        # The sized counts (sized.write_configs): <model>/configs/<name>.pbtxt where there is one, else config.pbtxt.
        *([f"--model-config-name={settings.config_name}"] if settings.instance_counts is not None else []),
        "--strict-readiness=true",
        # Every config here is complete: without this, 2.51 starts one more stub on every load of a Python model
        # only to ask it for an auto_complete_config, then ends it (5-11 s a load on a CPU; one stub start and
        # stop fewer; docs/benchmarks/auto-complete-stub-cpu-13ee275.md).
        "--disable-auto-complete-config",
        f"--exit-timeout-secs={settings.exit_timeout_s}",
        f"--log-verbose={settings.log_verbose}",
        # Latency percentiles per model (nv_inference_request_summary_us{quantile=...}), beside the counters.
        "--metrics-config=summary_latencies=true",
        # A gRPC client keeps one HTTP/2 connection: aged out after 5 minutes (a minute's grace for the requests on
        # it), clients reconnect and spread over the pods a scale-up added. Keepalive pings find dead clients.
        f"--grpc-max-connection-age={GRPC_MAX_CONNECTION_AGE_MS}",
        f"--grpc-max-connection-age-grace={GRPC_MAX_CONNECTION_AGE_GRACE_MS}",
        "--grpc-keepalive-time=60000",
        "--grpc-keepalive-timeout=20000",
        # Each Python-backend stub talks to the server through a /dev/shm region that starts at this size
        # (shm.dev_shm_bytes() says how far the regions grow).
        f"--backend-config=python,shm-default-byte-size={settings.shm_default_bytes}",
        f"--backend-config=python,shm-growth-byte-size={settings.shm_growth_bytes}",
        f"--backend-config=python,shm-region-prefix-name={settings.shm_prefix}",
        f"--grpc-restricted-protocol={RESTRICTED_APIS}:admin-key={settings.admin_key}",
        f"--http-restricted-api={RESTRICTED_APIS}:admin-key={settings.admin_key}",
    ]
    flags += trace_flags(settings.trace, settings.trace_rate)
    # Sized from the repository's configs (cuda_pool_bytes): every GPU tensor in flight between processes.
    pools = {gpu: cuda_pool_bytes(settings.model_repository, gpu, settings.instance_counts) for gpu in settings.gpus}
    flags += [f"--cuda-memory-pool-byte-size={gpu}:{size}" for gpu, size in pools.items()]
    return flags


def to_collector(trace: str) -> bool:
    """Whether `serve --trace` names an OpenTelemetry collector (an http:// URL) rather than a file."""
    return trace.startswith(("http://", "https://"))


def trace_flags(trace: str | None, rate: int = 1) -> list[str]:
    """Tracing of every `rate`-th request, the BLS calls of a pipeline request its children (python_backend.py):
    to an OpenTelemetry collector (`trace`: its http:// URL), or as Triton's JSON to a file (written as the server
    stops); none when `trace` is None."""
    if not trace:
        return []
    if to_collector(trace):
        where = [
            "--trace-config=mode=opentelemetry",
            f"--trace-config=opentelemetry,url={trace}",
            "--trace-config=opentelemetry,resource=service.name={{ cookiecutter.project_slug }}",
        ]
    else:
        where = ["--trace-config=mode=triton", f"--trace-config=triton,file={Path(trace).resolve()}"]
    return [*where, "--trace-config=level=TIMESTAMPS", f"--trace-config=rate={rate}"]


def print_model_states(states: dict[str, str]) -> None:
    """A `progress` for TritonServer.wait_ready()."""
    print("models:", ", ".join(f"{name} {state}" for name, state in states.items()), flush=True)


# How long a drained server may take to exit on its own after SIGTERM before its teardown is ended (stop()); one
# that traces to a file gets its exit timeout, as Triton writes the file last.
TEARDOWN_GRACE_S = 3


# What a model that ran out of GPU memory while loading says, in its own words (torch, cuBLAS, cuDNN, nvJPEG, CUDA).
OUT_OF_MEMORY = re.compile(
    r"out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|ALLOC_FAILED|cudaErrorMemoryAllocation|"
    r"CUDA_ERROR_OUT_OF_MEMORY|NVJPEG_STATUS_ALLOCATOR_FAILURE|std::bad_alloc|MemoryError",
    re.IGNORECASE,
)


class ModelLoadError(RuntimeError):
    """A model failed to load while the server started: `model` names it. A failure for want of memory says so
    first: `out_of_memory`."""

    def __init__(self, model: str, reason: str):
        self.out_of_memory = bool(OUT_OF_MEMORY.search(reason))
        if self.out_of_memory:
            reason = f"out of memory while loading ({reason})"
        super().__init__(f"model {model!r}: {reason}")
        self.model = model


class TritonServer:
    """A tritonserver process: start, wait until ready, stop. Usable as a context manager.

    `container`: in a container, run the image's /opt/tritonserver where it has one (the NGC image); otherwise,
    as in the default image and locally, the nvidia-pytriton wheel's (or $TRITONSERVER_HOME's)."""

    def __init__(self, settings: ServerSettings | None = None, container: bool | None = None, log=None):
        self.settings = settings or ServerSettings()
        self.container = CONTAINER_TRITONSERVER.is_dir() if container is None else container
        self.log = log
        self.process: subprocess.Popen | None = None
        self.mps = None  # the run's MPS daemon (mps.MpsDaemon) while there is one
        self.mps_status = "off (not started)"  # one line: on, or why not

    def command(self) -> tuple[list[str], dict[str, str]]:
        if self.container and CONTAINER_TRITONSERVER.is_dir():
            binary, backends, env = CONTAINER_TRITONSERVER / "bin" / "tritonserver", None, dict(os.environ)
        else:
            (binary, backends), env = local_tritonserver(), local_environment()
        flags = server_flags(self.settings)
        if backends is not None:
            flags.append(f"--backend-directory={backends}")
        if self.mps is not None:  # the server and every stub it starts are clients of the run's MPS daemon
            env.update(self.mps.env)
        # A stub that crashes (a segfault in a library, an abort) prints its Python threads' stacks into the server
        # log: the one clue 2.51 leaves when such a death takes the server down (notes/lock-exception-r24.10.md in the
        # template's docs/benchmarks).
        env.setdefault("PYTHONFAULTHANDLER", "1")
        return [str(binary), *flags], env

    def start_mps(self) -> None:
        """The run's CUDA MPS daemon, where there is a GPU and MPS can run; `mps_status` says which (mps.py)."""
        if self.mps is None:
            self.mps, self.mps_status = mps.start(self.settings.gpus, enabled=self.settings.mps)

    def stop_mps(self) -> None:
        if self.mps is not None:
            self.mps.stop()
            self.mps = None

    def start(self) -> TritonServer:
        from . import sized

        settings = self.settings
        if settings.instance_counts is not None:
            sized.write_configs(settings.model_repository, settings.instance_counts, settings.config_name)
        self.start_mps()
        argv, env = self.command()
        # A session of its own: Ctrl-C in a terminal reaches this process, which drains first (stop()).
        # Should this process die without stopping it, the kernel sends the server SIGTERM.
        try:
            self.process = subprocess.Popen(
                argv,
                env=env,
                stdout=self.log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=terminate_with_parent,
            )
        except BaseException:
            self.stop_mps()
            raise
        return self

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.settings.grpc_port}"

    def wait_ready(
        self, timeout_s: float = 300, progress=None, load_errors: dict | None = None, cancelled=None
    ) -> None:
        """Block until every model is loaded; `progress(states)` is called whenever model states change, and
        KeyboardInterrupt is raised as soon as `cancelled()` is true.

        Fails fast, naming the model (ModelLoadError), once a model has failed to load (`load_errors`, filled by
        `console.LogPump` from the server's log) or a model instance's stub has exited before the server was ready:
        2.51 first loads every other model (a minute on a CPU) and only then exits, and it takes its stub timeout to
        notice a stub that died (48 s on a 2-core CPU; on a GPU it can wait for good)."""
        import tritonclient.grpc as grpcclient

        from .health import stub_processes

        client = grpcclient.InferenceServerClient(self.grpc_url)
        deadline, last, stubs, dead = time.monotonic() + timeout_s, None, {}, None
        while time.monotonic() < deadline:
            if cancelled is not None and cancelled():
                raise KeyboardInterrupt
            exited = self.process.poll() is not None
            if exited and load_errors is not None:
                time.sleep(0.5)  # the log pump reads the last lines the server wrote
            for model, reason in (load_errors or {}).copy().items():
                raise ModelLoadError(model, f"failed to load: {reason}")
            if exited:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready")
            if dead is not None and time.monotonic() - dead[2] >= 1:  # its model's load error, if any, came first
                raise ModelLoadError(dead[0], f"its stub (pid {dead[1]}) exited before the server was ready")
            for pid, model in stub_processes(self.process.pid, instances_only=True).items():
                if model is not None:
                    stubs[pid] = model
                elif pid in stubs and dead is None:  # a zombie: the stub exited, and the server has not reaped it
                    dead = (stubs[pid], pid, time.monotonic())
            try:
                index = client.get_model_repository_index(headers=self.settings.admin_headers, as_json=True)
                index = index.get("models", [])
                states = {m["name"]: m.get("state", "UNAVAILABLE") for m in index}
                if progress and states != last:
                    progress(states)
                last = states
                if client.is_server_ready():
                    return
            except Exception:  # not listening yet
                # A fresh channel: one that failed to connect backs off exponentially, and noticed a server that
                # had been listening for 16 s on a 2-core CPU.
                client.close()
                client = grpcclient.InferenceServerClient(self.grpc_url)
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s")

    def drain(self) -> bool:
        """Unload the entry models and wait until their in-flight requests are done: True once they are.

        A SIGTERM alone would fail them: once tritonserver shuts down it refuses every new request, the BLS
        calls of requests already inside the pipeline included. An entry model is drained when it has unloaded,
        or as soon as the first of its stubs has exited: Triton tears instances down only after the model's last
        request is done, and in 2.51 one instance at a time, a second each (16 pipeline instances: 16 s), so the
        rest of the pipeline's teardown overlaps the other models' after the SIGTERM (and _stop_server ends it).
        """
        import tritonclient.grpc as grpcclient

        from .health import stub_processes

        def live_stubs() -> dict[str, int]:
            models = [m for m in stub_processes(self.process.pid).values() if m is not None]
            return {name: models.count(name) for name in self.settings.entry_models}

        deadline = time.monotonic() + self.settings.exit_timeout_s
        try:
            with grpcclient.InferenceServerClient(self.grpc_url) as client:
                headers = self.settings.admin_headers
                # every call bounded: a server that stopped answering must not hold up the stop
                loaded = [m for m in self.settings.entry_models if client.is_model_ready(m, client_timeout=5)]
                before = live_stubs()
                for model in loaded:
                    client.unload_model(model, headers=headers, client_timeout=5)
                while time.monotonic() < deadline:
                    index = client.get_model_repository_index(headers=headers, as_json=True, client_timeout=5)
                    index = index.get("models", [])
                    unloading = {m["name"] for m in index if m.get("state") == "UNLOADING"}
                    now = live_stubs()
                    if all(m not in unloading or now[m] < before[m] for m in loaded):
                        return True
                    time.sleep(0.1)
        except Exception:  # not up, or already going down: nothing this can drain
            pass
        return False

    def stop(self) -> int | None:
        """Stop the server (_stop_server), then its MPS daemon: also when the server had exited on its own. Its sized
        configs go too."""
        from . import sized

        try:
            return self._stop_server()
        finally:
            self.stop_mps()
            if self.settings.instance_counts is not None:
                sized.remove_configs(self.settings.model_repository, self.settings.config_name)

    def _stop_server(self) -> int | None:
        """Drain, SIGTERM, and end the teardown of a drained server after TEARDOWN_GRACE_S: exit code 0.

        Once drained no request is left, and what remains is 2.51 tearing the instances down one at a time with
        a second's sleep each (the Python backend's StubLauncher::UpdateHealth): 16 pipeline instances would
        take 16 s. A server that could not be drained gets its exit timeout, then SIGKILL, and its own code.
        """
        from .health import stub_processes

        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        drained = self.drain()
        self.process.send_signal(signal.SIGTERM)
        # Triton writes a trace file once its teardown is done: a server tracing to one gets the whole of it.
        traces_to_file = bool(self.settings.trace) and not to_collector(self.settings.trace)
        grace = TEARDOWN_GRACE_S if drained and not traces_to_file else self.settings.exit_timeout_s + 15
        try:
            return self.process.wait(grace)
        except subprocess.TimeoutExpired:
            stubs = stub_processes(self.process.pid)
            self.process.kill()
            for pid in stubs:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            code = self.process.wait(30)  # SIGKILLed: reaped at once
            if drained and hasattr(self.log, "write"):
                self.log.write(f"drained; ended the teardown after {grace} s ({len(stubs)} stubs left)\n")
                self.log.flush()
            return 0 if drained else code
        finally:
            if self.process.poll() is not None:
                self.end_orphaned_stubs()  # a stub a reload was starting as the server went can outlive it
            self.remove_shm_regions()

    def restart(self) -> TritonServer:
        """Start the server again after its process died on its own (restarts.py): its stubs, which outlive it,
        and their regions go first; the MPS daemon stays."""
        self.end_orphaned_stubs()
        self.remove_shm_regions()
        return self.start()

    def end_orphaned_stubs(self) -> None:
        """SIGKILL the stubs of this server that outlived its process (found by its /dev/shm prefix)."""
        from .health import orphaned_stubs

        deadline = time.monotonic() + 5
        while (orphans := orphaned_stubs(self.settings.shm_prefix)) and time.monotonic() < deadline:
            for pid in orphans:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def remove_shm_regions(self) -> None:
        """A stub that died (killed, crashed) never unlinks its /dev/shm region, and after such a crash
        Triton 2.51 waits out its exit timeout instead of cleaning up: this server's prefix finds them.
        Shared-memory clients killed outright leave theirs too: those of processes that are gone go as well."""
        for region in Path("/dev/shm").glob(self.settings.shm_prefix + "*"):
            if is_own_file(region):  # a name of another user's is theirs, whatever it is called
                with contextlib.suppress(OSError):
                    region.unlink()
        remove_stale_regions()

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
