"""Reload stress: many pipeline reloads under steady load, stubs killed in execute and in finalize, a stop during
a reload. Counts what must stay at zero: server aborts and lost requests.

    python -m benchmarks.reload_stress [--reloads 300] [--clients 4] [--kill-every 5] [--minutes M]
                                       [--instances pipeline=2 preprocess=1 resnet=1 postprocess=1] [--out DIR]

Starts the project's tritonserver (its own flags, as `serve`, but no `serve`: an abort is counted, not healed)
with these instance counts, and keeps `--clients` closed-loop gRPC clients sending one image to the pipeline.
Reloads take turns:
- a new version: `pipeline/<N+1>` beside `<N>`, loaded with the admin key (recipe 4): the server loads N+1 and
  unloads N, whose stubs run `finalize` while requests drain;
- the same version again: a config override with a fresh token, as `serve`'s watchdog reloads a model;
- a config change: the pipeline's `max_queue_delay_microseconds` 100 <-> 200.
Every `--kill-every`th reload SIGKILLs a pipeline stub, alternately one of the serving version (in execute, under
load) and one of the version being replaced (in its finalize); the next reload brings the model back.
Every request must end: answered, or failed with an error (a killed stub fails what it held, naming the
pipeline); one that gets no answer within `--request-timeout` is lost. An abort is the server process gone: it is
counted, its log's last lines kept, and the server started again. Last, a stop while a reload is in flight must
end, with no stub and no /dev/shm region left. Writes reload_stress.json, .md and .png; exit status 1 if a count is
not zero.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from ._common import RESULTS, bench_repository, bench_server, environment, sample_jpegs, write

KINDS = ("new version", "same version", "config change")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reloads", type=int, default=300)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--kill-every", type=int, default=5, help="SIGKILL a pipeline stub every Nth reload (0: never)")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds after which a request is lost")
    parser.add_argument(
        "--instances",
        nargs="+",
        default=["pipeline=2", "preprocess=1", "resnet=1", "postprocess=1"],
        metavar="MODEL=COUNT",
        help="instance counts (small: a reload then takes seconds on a CPU)",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=0,
        help="stop reloading this long after the start, server start included (0: never), then stop the server "
        "during a reload and write the results as usual: a time-limited run (one GPU call) keeps what it did",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


class Load:
    """Closed-loop clients; every request's outcome: 'ok', an error message, or 'lost'."""

    def __init__(self, url: str, clients: int, image: bytes, timeout_s: float):
        self.url, self.image, self.timeout_s = url, image, timeout_s
        self.stop, self.lock, self.outcomes = threading.Event(), threading.Lock(), []
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(clients)]

    def client(self) -> None:
        import numpy as np
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        batch = np.array([[self.image]], dtype=object)
        while not self.stop.is_set():
            try:
                with grpcclient.InferenceServerClient(self.url) as c:
                    image = grpcclient.InferInput("IMAGE", [1, 1], "BYTES")
                    image.set_data_from_numpy(batch)
                    while not self.stop.is_set():
                        try:
                            c.infer("pipeline", [image], client_timeout=self.timeout_s)
                            outcome = "ok"
                        except InferenceServerException as exc:
                            deadline = exc.status() == "StatusCode.DEADLINE_EXCEEDED"
                            outcome = "lost" if deadline else f"error: {exc.message()}"
                        with self.lock:
                            self.outcomes.append(outcome)
                        if outcome.startswith("error: failed to connect"):
                            time.sleep(0.5)  # the server is being started again
            except Exception as exc:  # the channel itself broke (the server died): reconnect
                with self.lock:
                    self.outcomes.append(f"error: {exc}")
                time.sleep(0.5)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.timeout_s + 10)


def stubs_of(server, version: int | None = None) -> list[int]:
    """The pipeline stubs of the server (of one version, where given)."""
    from {{ cookiecutter.package_name }}.health import stub_processes

    pids = []
    for pid, model in stub_processes(server.process.pid, instances_only=True).items():
        if model != "pipeline":
            continue
        try:
            path = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[1].decode()
        except (OSError, IndexError):
            continue
        if version is None or Path(path).parent.name == str(version):
            pids.append(pid)
    return pids


def reload(server, kind: str, version: int, delay: int) -> tuple[int, int]:
    """One reload of the pipeline of this kind: (the version now serving, the queue delay now configured)."""
    import tritonclient.grpc as grpcclient

    from {{ cookiecutter.package_name }}.health import restart

    repo, headers = Path(server.settings.model_repository), server.settings.admin_headers
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        if kind == "new version":
            new = repo / "pipeline" / str(version + 1)
            new.mkdir()
            shutil.copy(repo / "pipeline" / str(version) / "model.py", new / "model.py")
            client.load_model("pipeline", headers=headers)
            old = repo / "pipeline" / str(version - 1)
            if version > 1 and old.is_dir():  # two versions back: unloaded by now
                shutil.rmtree(old)
            return version + 1, delay
        if kind == "same version":
            restart(client, "pipeline", headers)
            return version, delay
        config = client.get_model_config("pipeline", as_json=True)["config"]
        delay = 200 if delay == 100 else 100
        config["dynamic_batching"]["max_queue_delay_microseconds"] = str(delay)
        client.load_model("pipeline", config=json.dumps(config), headers=headers)
        return version, delay


def reload_quietly(server, version: int, delay: int) -> None:
    try:
        reload(server, "same version", version, delay)
    except Exception:
        pass


def plot_summary(summary: dict):
    def plot(ax):
        names = ["answered", "failed", "lost", "aborts"]
        ax.bar(names, [summary[n] for n in names])
        ax.set_yscale("symlog")
        ax.set_ylabel("requests (aborts: server ends)")

    return plot


def main(argv=None) -> int:
    from {{ cookiecutter.package_name }}.health import orphaned_stubs, stub_processes
    from {{ cookiecutter.package_name }}.model_repository import set_instance_counts

    args = parse_args(argv)
    rng = random.Random(args.seed)
    aborts, kills, failed_reloads, stop_s, left = [], {"execute": 0, "finalize": 0}, [], None, None
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        repo = bench_repository(tmp)
        set_instance_counts(repo, {m: int(c) for m, c in (item.split("=") for item in args.instances)})
        log = Path(tmp) / "tritonserver.log"
        server = bench_server(repo, log, mps=True)
        version, delay = 1, 100
        load = Load(server.grpc_url, args.clients, sample_jpegs(1)[0], args.request_timeout)
        with load:
            done = 0
            for i in range(1, args.reloads + 1):
                if args.minutes and time.monotonic() - started > args.minutes * 60:
                    print(f"--minutes {args.minutes:g} reached after {done} reloads")
                    break
                done = i
                kind = KINDS[(i - 1) % len(KINDS)]
                replaced = stubs_of(server, version if kind == "new version" else None)
                try:
                    version, delay = reload(server, kind, version, delay)
                except Exception as exc:  # a reload refused (its model failed to load): counted, the next one retries
                    failed_reloads.append(f"{i} {kind}: {exc}")
                if args.kill_every and i % args.kill_every == 0:
                    in_finalize = (i // args.kill_every) % 2 == 0
                    targets = [p for p in replaced if p in stub_processes(server.process.pid)] if in_finalize else []
                    where = "finalize" if targets else "execute"
                    targets = targets or stubs_of(server, version)
                    if targets:
                        os.kill(rng.choice(targets), signal.SIGKILL)
                        kills[where] += 1
                time.sleep(rng.uniform(0.1, 1.0))
                if server.process.poll() is not None:
                    tail = log.read_text(errors="replace").splitlines()[-40:]
                    aborts.append({"reload": i, "kind": kind, "returncode": server.process.returncode, "log": tail})
                    print(f"reload {i}: tritonserver ended ({server.process.returncode}); starting it again")
                    server.restart()
                    server.wait_ready(600)
                if i % 10 == 0:
                    counts = {o: load.outcomes.count(o) for o in ("ok", "lost")}
                    print(f"reload {i}/{args.reloads} ({kind}), version {version}: {counts}, aborts {len(aborts)}")
        # a stop while a reload is in flight (the reload then fails: the server is going away)
        loading = threading.Thread(target=reload_quietly, args=(server, version, delay), daemon=True)
        loading.start()
        time.sleep(0.3)
        stopping = time.monotonic()
        server.stop()
        stop_s = time.monotonic() - stopping
        left = {
            "stubs": len(orphaned_stubs(server.settings.shm_prefix)),
            "shm_regions": len(list(Path("/dev/shm").glob(server.settings.shm_prefix + "*"))),
        }
    outcomes = load.outcomes
    errors = sorted({o[:160] for o in outcomes if o.startswith("error")})
    results = {
        "title": "Reload stress: pipeline reloads under load, stubs killed in execute and finalize",
        "environment": environment(),
        "summary": {
            "reloads": done,
            "failed_reloads": len(failed_reloads),
            "kills": kills,
            "requests": len(outcomes),
            "answered": outcomes.count("ok"),
            "failed": sum(o.startswith("error") for o in outcomes),
            "lost": outcomes.count("lost"),
            "aborts": len(aborts),
            "stop_during_reload_s": round(stop_s, 1),
            "left_after_stop": left,
            "minutes": round((time.monotonic() - started) / 60, 1),
        },
        "errors": errors,
        "failed_reloads": failed_reloads,
        "aborts": aborts,
        "notes": [
            f"{done} reloads taking turns ({', '.join(KINDS)}), {args.clients} clients, a pipeline stub "
            f"SIGKILLed every {args.kill_every}th reload (alternately in execute and in finalize), instances "
            f"{' '.join(args.instances)}; lost = no answer within {args.request_timeout:g} s; aborts = the server "
            "process ended."
        ],
    }
    summary = results["summary"]
    rows = [{"count": key, "value": json.dumps(value)} for key, value in summary.items()]
    write("reload_stress", results, rows, ["count", "value"], plot_summary(summary), args.out)
    print(json.dumps(summary, indent=2))
    for error in errors:
        print(f"  failed with: {error}")
    bad = summary["lost"] or summary["aborts"] or any(left.values())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
