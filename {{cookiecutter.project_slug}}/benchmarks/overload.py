"""Overload: each entry point at several times what it serves, with deadlines, cancellations and a readiness probe.

    python -m benchmarks.overload [--seconds 60] [--factor 4] [--deadline-s 2] [--cancel-every 10]
                                  [--models pipeline ensemble] [--senders N] [--concurrency N]

Starts the project's tritonserver (its own flags, as `serve`). For each entry point it first measures what it
serves: single-image requests from --concurrency closed-loop clients for --capacity-seconds. Then it sends --factor
times that rate, open loop (a request every 1/rate s, whatever the answers), for --seconds. Both from --senders
processes: one Python client sends about 2,000 requests a second, less than a GPU serves. Each request carries a
timeout of --deadline-s (Triton's request `timeout`; the client waits 2 s longer), and every --cancel-every-th one is
cancelled by its client 50 ms after it was sent. Meanwhile the readiness probe (`health.probe`, at its own priority
level) runs once a second.

Reported per entry point: requests sent, answered, rejected per status code, late (no answer within the deadline
plus 2 s: the client gave up), cancelled; p50 and p99 of the answered ones; whether every rejection was UNAVAILABLE,
the probe passed throughout (an answer, or "busy"), and p99 stayed within the deadline plus 1 s with none late; and
the pipeline's `cancelled_requests` and `expired_requests` counters (requests it stopped before a stage: cancelled by
their client, or past their deadline); and whether the senders reached 0.9 of the rate (if not, the run measured the
clients, not an overload). Writes overload.json, overload.md and overload.png. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ._common import RESULTS, bench_repository, bench_server, environment, sample_jpegs, write


def image_input(jpeg: bytes):
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput("IMAGE", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[jpeg]], dtype=object))
    return tensor


def spawned(processes: int) -> ProcessPoolExecutor:
    """A pool of client processes, spawned, not forked: this process has used gRPC, which a forked child cannot."""
    import multiprocessing

    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))


def closed_loop(url: str, model: str, jpegs: list[bytes], clients: int, seconds: float) -> tuple[int, float]:
    """One process's part of capacity(): `clients` closed-loop clients of one image each; (requests answered,
    seconds taken)."""
    import tritonclient.grpc as grpcclient

    started = time.monotonic()
    deadline, done = started + seconds, []

    def loop(i: int) -> None:
        with grpcclient.InferenceServerClient(url) as client:
            n = 0
            while time.monotonic() < deadline:
                client.infer(model, [image_input(jpegs[(i + n) % len(jpegs)])], client_timeout=60)
                n += 1
            done.append(n)

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(loop, range(clients)))
    return sum(done), time.monotonic() - started


def capacity(url: str, model: str, jpegs: list[bytes], concurrency: int, seconds: float, senders: int) -> float:
    """Requests a second that `model` answers from `concurrency` closed-loop clients of one image each, spread over
    `senders` processes."""
    shares = [concurrency // senders + (i < concurrency % senders) for i in range(senders)]
    with spawned(senders) as pool:
        parts = list(pool.map(closed_loop, *zip(*[(url, model, jpegs, n, seconds) for n in shares if n])))
    return sum(n for n, _ in parts) / max(taken for _, taken in parts)


def stopped_counter(metrics_port: int, model: str) -> float:
    """The requests `model` stopped before a stage: cancelled by their client, or past their deadline."""
    text = urllib.request.urlopen(f"http://localhost:{metrics_port}/metrics", timeout=30).read().decode()
    found = re.findall(r"^\w+_(?:cancelled|expired)_requests_total\{model=\"" + model + r"\"\} (\S+)$", text, re.M)
    return sum(map(float, found))


def send(url: str, model: str, jpegs: list[bytes], rate: float, args, first: int) -> tuple[int, list]:
    """One sender process: `rate` requests a second at `model` for args.seconds, open loop (a request every 1/rate s,
    whatever the answers). (requests sent, [(status, seconds)] per request answered or refused)."""
    import tritonclient.grpc as grpcclient

    lock, outcomes = threading.Lock(), []

    def answered(sent_at: float, cancelled: bool):
        def callback(result, error) -> None:
            status = "OK" if error is None else str(error.status()).removeprefix("StatusCode.")
            with lock:
                outcomes.append(("CANCELLED (by the client)" if cancelled and status == "CANCELLED" else status,
                                 time.monotonic() - sent_at))  # fmt: skip

        return callback

    timeout_us, sent = int(args.deadline_s * 1e6), 0
    cancels: list[tuple[float, object]] = []
    with grpcclient.InferenceServerClient(url) as client:
        started = time.monotonic()
        while (now := time.monotonic()) < started + args.seconds:
            n = first + sent * args.senders  # this sender's requests, numbered among all senders'
            cancel = args.cancel_every > 0 and n % args.cancel_every == args.cancel_every - 1
            call = client.async_infer(
                model,
                [image_input(jpegs[n % len(jpegs)])],
                answered(now, cancel),
                timeout=timeout_us,
                client_timeout=args.deadline_s + 2,
            )
            if cancel:
                cancels.append((now + 0.05, call))
            while cancels and cancels[0][0] <= now:
                cancels.pop(0)[1].cancel()
            sent += 1
            time.sleep(max(0.0, started + sent / rate - time.monotonic()))
        for _, call in cancels:
            call.cancel()
        drain = time.monotonic() + args.deadline_s + 5
        while len(outcomes) < sent and time.monotonic() < drain:
            time.sleep(0.1)
    with lock:
        return sent, list(outcomes)


def overload(server, model: str, jpegs: list[bytes], rate: float, args) -> dict:
    """`rate` requests a second at `model` for args.seconds from args.senders processes (one Python client sends
    about 2,000 a second, less than a GPU serves); the outcome of each, and the probe's."""
    from {{ cookiecutter.package_name }}.health import busy, probe

    url = server.grpc_url
    probes: list[str | None] = []
    stop = threading.Event()

    def prober() -> None:
        while not stop.wait(1.0):
            error = probe(url, timeout_s=30)
            probes.append(None if error is None or busy(error) else error)

    before = stopped_counter(server.settings.metrics_port, model)
    probing = threading.Thread(target=prober, daemon=True)
    probing.start()
    with spawned(args.senders) as pool:
        parts = [pool.submit(send, url, model, jpegs, rate / args.senders, args, i) for i in range(args.senders)]
        parts = [part.result() for part in parts]
    stop.set()
    probing.join()
    sent = sum(n for n, _ in parts)
    outcomes = [outcome for _, found in parts for outcome in found]
    counts = Counter(status for status, _ in outcomes)
    ok = sorted(seconds for status, seconds in outcomes if status == "OK")
    refused = {s: n for s, n in counts.items() if s not in ("OK", "CANCELLED (by the client)", "DEADLINE_EXCEEDED")}
    p99 = float(np.percentile(ok, 99)) if ok else None
    late = counts.get("DEADLINE_EXCEEDED", 0)  # no answer within the deadline + 2 s: the client gave up
    return {
        "model": model,
        "rate": round(rate, 1),
        "sent": sent,
        "sent_per_s": round(sent / args.seconds, 1),
        "answered": counts.get("OK", 0),
        "rejected": refused,
        "cancelled_by_client": counts.get("CANCELLED (by the client)", 0),
        "late": late,
        "no_outcome": sent - len(outcomes),
        "p50_s": round(float(np.percentile(ok, 50)), 3) if ok else None,
        "p99_s": round(p99, 3) if p99 is not None else None,
        "stopped_before_a_stage": stopped_counter(server.settings.metrics_port, model) - before,
        "probes": len(probes),
        "probes_failed": [error for error in probes if error is not None][:5],
        "all_rejections_unavailable": set(refused) <= {"UNAVAILABLE"},
        "probe_passed_throughout": bool(probes) and all(error is None for error in probes),
        "p99_within_deadline_plus_1s": p99 is not None and p99 <= args.deadline_s + 1 and not late,
        # the senders kept up: below 0.9 of the rate the run measured the clients, not an overload
        "rate_reached": sent >= 0.9 * rate * args.seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["pipeline", "ensemble"])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--factor", type=float, default=4, help="times the measured capacity")
    parser.add_argument("--deadline-s", type=float, default=2)
    parser.add_argument("--cancel-every", type=int, default=10, help="cancel every Nth request (0: none)")
    parser.add_argument(
        "--concurrency", type=int, help="closed-loop clients that measure capacity (default: 64 on a GPU, 8 on the CPU)"
    )
    parser.add_argument("--capacity-seconds", type=float, default=10)
    senders = max(1, min(8, (os.cpu_count() or 2) // 2))
    parser.add_argument("--senders", type=int, default=senders, help="client processes (default: half the cores, <= 8)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.concurrency is None:
        import torch

        args.concurrency = 64 if torch.cuda.is_available() else 8
    jpegs = sample_jpegs(8)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        server = bench_server(bench_repository(Path(work)), Path(work) / "tritonserver.log")
        try:
            for model in args.models:
                served = capacity(server.grpc_url, model, jpegs, args.concurrency, args.capacity_seconds, args.senders)
                print(f"{model}: serves {served:.1f} requests/s; sending {args.factor:g}x that for {args.seconds:g} s")
                row = {"capacity": round(served, 1), **overload(server, model, jpegs, args.factor * served, args)}
                print("  " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "model"))
                rows.append(row)
        finally:
            server.stop()
    results = {
        "title": f"Overload: {args.factor:g}x capacity for {args.seconds:g} s, deadline {args.deadline_s:g} s",
        "environment": environment(),
        "settings": vars(args) | {"out": str(args.out)},
        "notes": [
            "Single-image requests of 500x375 JPEGs, open loop; every rejection should be UNAVAILABLE, the probe",
            "should pass throughout and p99 of the answered stay within the deadline plus 1 s.",
        ],
        "rows": rows,
    }
    columns = ["model", "capacity", "rate", "sent_per_s", "sent", "answered", "rejected", "late", "cancelled_by_client",
               "stopped_before_a_stage", "p50_s", "p99_s", "all_rejections_unavailable", "probe_passed_throughout",
               "p99_within_deadline_plus_1s", "rate_reached"]  # fmt: skip

    def plot(ax) -> None:
        ax.bar([r["model"] for r in rows], [r["answered"] for r in rows], label="answered")
        ax.bar([r["model"] for r in rows], [sum(r["rejected"].values()) for r in rows],
               bottom=[r["answered"] for r in rows], label="rejected")  # fmt: skip
        ax.set_ylabel("requests")
        ax.legend()

    write("overload", results, rows, columns, plot, args.out)
    checks = ("all_rejections_unavailable", "probe_passed_throughout", "p99_within_deadline_plus_1s", "rate_reached")
    return 0 if all(row[check] for row in rows for check in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
