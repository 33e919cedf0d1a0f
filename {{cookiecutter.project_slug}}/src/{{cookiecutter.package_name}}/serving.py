"""`serve`: check, size, compile, start tritonserver, watch it until a stop signal, drain and stop it.

The command line (cli.py) parses the flags; this module runs the server's life, on top of server.py."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

LOG_TAIL_LINES = 15  # of tritonserver's log, shown when the models fail to load


class StopSignals:
    """SIGINT (Ctrl-C), SIGTERM (docker stop) and SIGHUP (terminal closed) ask `serve` to stop.

    While starting, a signal raises KeyboardInterrupt where the code is. While serving and stopping, it only sets
    `requested`, which the serving loop reads every 0.1 s: an exception raised at an arbitrary point can land
    inside subprocess.Popen between taking and releasing its wait lock, and every later wait() of the server then
    blocks forever (a `serve` that said "stopping" and never stopped). A second signal while stopping is ignored:
    the stop is bounded (drain, exit timeout, SIGKILL)."""

    def __init__(self):
        self.requested = False
        self.deferred = False

    def install(self) -> StopSignals:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        if not self.deferred:
            raise KeyboardInterrupt

    def defer(self) -> None:
        """From now on a signal only sets `requested`."""
        self.deferred = True


def serve(args) -> int:
    """Run tritonserver on the model repository until Ctrl-C (or SIGTERM, SIGHUP): check, start, watch, stop."""
    import time

    from . import admin_key, sized, sizing
    from .server import CONTAINER_TRITONSERVER, ServerSettings, server_flags, taken_ports
    from .shm import print_shm_need

    container = CONTAINER_TRITONSERVER.is_dir() if args.container is None else args.container
    address = args.address or ("0.0.0.0" if container else "127.0.0.1")
    settings = ServerSettings(
        args.model_repository,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        address=address,
        mps=args.mps,
        trace=args.trace or os.environ.get("TRITON_TRACE"),
        trace_rate=args.trace_rate,
    )
    starting = not (args.print_flags or args.print_shm)
    if starting and (taken := taken_ports(settings)):
        print(
            f"error: {'; '.join(taken)}: stop it, or choose other ports (--grpc-port, --http-port, --metrics-port)",
            file=sys.stderr,
        )
        return 1
    if starting and (missing := missing_weights(settings.model_repository)):
        print(
            f"error: missing weights {', '.join(map(str, missing))}: run "
            "`{{ cookiecutter.project_slug }} weights random` (offline), "
            "`weights pretrained` (downloads torchvision's) or `weights import YOUR.pt`",
            file=sys.stderr,
        )
        return 1
    try:  # the instance counts this machine carries (sizing.py), before anything starts
        plans = sizing.plan_for_serve(
            settings.model_repository, settings.gpus, gpu_memory(args), instances(args), args.mps
        )
    except (sizing.NothingFits, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    settings.instance_counts = plans[0].overrides
    if args.print_flags:  # the admin key is a secret: never on a terminal or in a log
        print("\n".join(flag.replace(settings.admin_key, "***") for flag in server_flags(settings)))
        return 0
    if args.print_shm:
        print_shm_need(settings.model_repository, settings.instance_counts)
        return 0
    # the key same-host clients find (admin_key.py): TRITON_ADMIN_KEY, else a file only this user reads
    settings.admin_key, key_place = admin_key.for_serve(rotate=args.new_admin_key)
    for device_plan in plans:
        print(f"instances: {device_plan.line()}")
    sized.record(settings.grpc_port, plans)
    stop = StopSignals().install()
    try:
        if settings.gpus:  # the compiled ResNet, once per weights and GPU model (compiled.py)
            from .compiled import compile_for_serve

            try:
                compile_for_serve(settings.model_repository, settings.gpus)
            except ValueError as exc:  # the config's compile parameter
                print(f"error: {exc}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                print("stopped while compiling: the next start compiles again")
                return 130
        started = time.monotonic()
        try:
            server, pump = start_server(args, settings, container, started, plans)
        except OSError as exc:  # the sized configs could not be written
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return run_until_stopped(args, server, pump, started, key_place, stop)
    finally:
        sized.forget(settings.grpc_port)


def missing_weights(repository: Path) -> list[Path]:
    """The resnet versions whose weights file is not there: said once, before loading, instead of by every instance
    of every version after the other models have loaded."""
    from .model_repository import ConfigError, resnet_weight_files

    if not (repository / "resnet" / "config.pbtxt").is_file():
        return []
    try:
        files = resnet_weight_files(repository)
    except (ConfigError, KeyError):  # the plan names a config that does not parse
        return []
    return sorted(path for path in files if not path.is_file())


def gpu_memory(args):
    """--gpu-memory (else $TRITON_GPU_MEMORY): bytes, a fraction of each GPU, or None."""
    from .sizing import parse_size

    text = args.gpu_memory or os.environ.get("TRITON_GPU_MEMORY")
    return parse_size(text) if text else None


def instances(args) -> dict[str, int]:
    """--instances MODEL=N ... (else $TRITON_INSTANCES): the counts pinned as given."""
    from .sizing import parse_instances

    return parse_instances(args.instances or os.environ.get("TRITON_INSTANCES"))


def start_server(args, settings, container: bool, started: float, plans=()):
    """(the started TritonServer, the LogPump showing its progress here or None). In a container the runtime keeps
    the log: all of it on stdout. Otherwise the whole log goes to a file, named first, and a short progress view
    here (--verbose: the log too)."""
    import subprocess

    from .console import LogPump, log_header
    from .paths import cache_dir
    from .server import TritonServer

    if container:
        server = TritonServer(settings, container=True)
    else:
        log_file = args.log_file or cache_dir() / f"tritonserver-{settings.grpc_port}.log"  # one per server
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log_file.write_text(log_header(settings.gpus) + "".join(f"# instances: {p.line()}\n" for p in plans))
        print(f"tritonserver log: {log_file}{'' if args.verbose else '  (--verbose shows it here)'}")
        server = TritonServer(settings, container=False, log=subprocess.PIPE)
    gpus = f"GPUs {settings.gpus}" if settings.gpus else "no GPU: CPU only"
    print(f"starting tritonserver on {settings.model_repository} ({gpus})")
    server.start()
    print(f"CUDA MPS: {server.mps_status}")  # its 48 clients a GPU: the sized counts keep within them (sizing.py)
    if container:
        return server, None
    pump = LogPump(server.process.stdout, log_file, settings.gpus, args.verbose, started)
    pump.start()
    return server, pump


def run_until_stopped(args, server, pump, started: float, key_place: str, stop: StopSignals) -> int:
    """Wait until the server is ready and watch its stubs until a stop signal, then drain and stop it. Should
    tritonserver itself die meanwhile, start it again, within limits (restarts.py)."""
    import time

    from . import sized
    from .console import LogPump
    from .health import StubWatchdog
    from .restarts import RESTART_WINDOW_S, Restarts, why_it_ended
    from .server import OUT_OF_MEMORY

    restarts, watchdog, gave_up = Restarts(server.settings.grpc_port), None, False
    stop.defer()  # from here a signal sets stop.requested, which the loops below read
    try:
        while True:
            try:
                load_errors = pump.load_errors if pump else None
                server.wait_ready(args.timeout, load_errors=load_errors, cancelled=lambda: stop.requested)
            except (RuntimeError, TimeoutError) as exc:
                where = f": {pump.path}" if pump else " above"
                print(f"error: {exc}; the models' errors are in tritonserver's log{where}", file=sys.stderr)
                log = ""
                if pump is not None:  # its last lines (a stub's own output ends up there too)
                    time.sleep(0.5)  # what the server wrote last has reached the file
                    log = pump.path.read_text(errors="replace")
                    tail = log.splitlines()[-LOG_TAIL_LINES:]
                    print("\n".join(["the log's last lines:", *(f"  {line}" for line in tail)]), file=sys.stderr)
                if getattr(exc, "out_of_memory", False) or OUT_OF_MEMORY.search(log):
                    print(
                        "error: memory ran out while the models loaded, beyond what the instance counts were sized for "
                        "(the 'instances:' line above): give the server less with --gpu-memory, or pin fewer instances "
                        "with --instances",
                        file=sys.stderr,
                    )
                return 1
            if restarts.times:
                print(f"serving again {time.time() - restarts.times[-1]:.1f} s after tritonserver ended", flush=True)
            else:
                print_ready(server, started, key_place)
            watchdog = StubWatchdog(
                server.grpc_url,
                server.settings.admin_headers,
                interval_s=args.watchdog_interval,
                server_pid=server.process.pid,
            )
            if args.watchdog_interval > 0:
                watchdog.start()
            # Not one blocking wait(): the kernel may hand SIGTERM to another thread (log pump, watchdog, gRPC), and
            # Python runs its handler only when this thread runs again, which a blocked waitpid() never lets it do.
            ticks = 0
            while server.process.poll() is None and not stop.requested:
                time.sleep(0.1)
                ticks += 1
                if ticks % 10 == 0 and server.settings.instance_counts is not None:  # an edited config.pbtxt
                    sized.sync_configs(server.settings.model_repository, server.settings.config_name)  # next load
            watchdog.stop()
            if stop.requested:
                raise KeyboardInterrupt
            why = why_it_ended(server.process.returncode)
            if not restarts.allowed():
                print(
                    f"error: tritonserver {why}, the {len(restarts.times) + 1}th time within "
                    f"{RESTART_WINDOW_S / 60:.0f} minutes: not starting it again",
                    file=sys.stderr,
                )
                gave_up = True
                break
            print(f"tritonserver {why}: starting it again (restart {len(restarts.times) + 1})", flush=True)
            restarts.record(why)
            if pump is not None:
                pump.join(timeout=5)
            server.restart()
            if pump is not None:
                pump = LogPump(server.process.stdout, pump.path, server.settings.gpus, args.verbose, time.monotonic())
                pump.start()
    except KeyboardInterrupt:
        print("stopping (in-flight requests finish first)...")
    finally:
        if watchdog is not None:
            watchdog.stop()  # no reloads while the server drains and stops
        stopping = time.monotonic()
        returncode = server.stop()  # the exit code, also when the server had already exited
        if pump is not None:
            pump.join(timeout=5)
        restarts.forget()
        print(f"stopped in {time.monotonic() - stopping:.1f} s")
    return 1 if gave_up else returncode or 0


def print_ready(server, started: float, key_place: str) -> None:
    """Where the ready server listens, and where its admin key is."""
    import time

    from . import admin_key

    settings = server.settings
    print(
        f"ready in {time.monotonic() - started:.1f} s: gRPC {server.grpc_url}   HTTP "
        f"http://localhost:{settings.http_port}   metrics http://localhost:{settings.metrics_port}/metrics"
        "   (Ctrl-C stops)"
    )
    if key_place == admin_key.ENV:
        return
    if key_place.startswith("this start only"):  # no file could be written: the key is nowhere, never printed
        print(f"admin key: {key_place}; set {admin_key.ENV} to use the admin APIs")
    elif server.container:
        print(f"admin key: in {key_place} (docker compose exec triton cat {key_place}; or set {admin_key.ENV})")
    else:
        print(f"admin key: in {key_place} (same-host clients read it there; --new-admin-key rotates it)")
