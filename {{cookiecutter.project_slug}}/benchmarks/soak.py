"""Soak: a mixed workload long enough for memory to plateau, with RSS, GPU memory and /dev/shm per process.

    python -m benchmarks.soak [--clients 16] [--requests 300] [--duration 900] [--interval 5]   (make soak)
                              [--preprocess bls|in_process]   (the pipeline's parameter of that name)

Starts the project's tritonserver (its own flags, as `serve`; random weights unless model_repository has
weights.pt) and runs --clients closed-loop gRPC clients. Each alternates pipeline and ensemble (when present) and
1 or 4 images per request (500x375 JPEGs), until it has sent --requests or --duration seconds have passed
(SIGTERM or Ctrl-C end the load early; what was measured is still written and judged).
Every --interval seconds it samples, for the server and each Python-backend stub: resident memory (RSS; RSS
without shared memory; its anonymous part, the heap), GPU memory (NVML, else nvidia-smi; skipped without a GPU)
and the server's /dev/shm regions. Writes soak.json, soak.md and soak.png.

Exit status 1 when a request failed, or when memory still grows in the last third of the run: for each process,
the median of the last third of the run may exceed the median of the middle third by at most --max-growth-mib
(RSS without shared memory, and GPU memory), and each /dev/shm region by at most --max-shm-growth-mib. A leak
moves the median steadily up; a plateau does not, however much a single large batch spikes the allocator.
Shared memory is judged once, as /dev/shm: every process that maps a region counts the pages it touched in its
own RSS.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ._common import RESULTS, bench_repository, bench_server, environment, sample_jpegs, write

MiB = 1 << 20
STUB = re.compile(r"/([^/\s]+)/\d+/model\.py")


# ---------------------------------------------------------------- the clients


def worker(url, models, images_per_request, threads, first_client, requests, deadline, done, failed, results):
    """`threads` closed-loop gRPC clients; each counts into `done`/`failed` and reports its latencies at the end."""
    import tritonclient.grpc as grpcclient

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C ends the run through the parent (`deadline`)

    jpegs = sample_jpegs(8)
    latencies, errors, lock = [], [], threading.Lock()

    def batch_input(i, n):
        batch = np.array([[jpegs[(i + k) % len(jpegs)]] for k in range(n)], dtype=object)
        tensor = grpcclient.InferInput("IMAGE", list(batch.shape), "BYTES")
        tensor.set_data_from_numpy(batch)
        return tensor

    def loop(client_id):
        client = grpcclient.InferenceServerClient(url)
        mine, bad = [], []
        for n in range(requests):
            if time.time() >= deadline.value:
                break
            # every client cycles through every (entry point, images per request) pair, offset by its id
            model = models[(client_id + n) % len(models)]
            count = images_per_request[(client_id + n // len(models)) % len(images_per_request)]
            sent = time.monotonic()
            try:
                result = client.infer(model, [batch_input(client_id + n, count)], client_timeout=120)
                if result.as_numpy("CLASS_IDS").shape[0] != count:
                    raise RuntimeError(f"{model}: {result.as_numpy('CLASS_IDS').shape[0]} answers for {count} images")
                mine.append((time.monotonic() - sent) * 1e3)
                with done.get_lock():
                    done.value += 1
            except Exception as exc:  # counted and reported, never hidden
                bad.append(f"{model}: {str(exc)[:300]}")
                with failed.get_lock():
                    failed.value += 1
        client.close()
        with lock:
            latencies.extend(mine)
            errors.extend(bad)

    pool = [threading.Thread(target=loop, args=(first_client + t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    results.put((latencies, errors))


# ---------------------------------------------------------------- what is sampled


def server_processes(shm_prefix: str) -> tuple[dict[int, str], dict[str, str]]:
    """({pid: label}, {shm region: label}): "tritonserver" and one label per stub (its model; #2, #3... for more
    instances); a stub's command line names its /dev/shm region."""
    found, regions = [], {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if shm_prefix in cmdline:
            stub, region = STUB.search(cmdline), re.search(re.escape(shm_prefix) + r"(\S+)", cmdline)
            found.append((int(entry.name), stub.group(1) if stub else "tritonserver", region and region.group(1)))
    labels, seen = {}, {}
    for pid, name, region in sorted(found):
        seen[name] = seen.get(name, 0) + 1
        labels[pid] = name if seen[name] == 1 else f"{name}#{seen[name]}"
        if region and name != "tritonserver":
            regions[region] = labels[pid]
    return labels, regions


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon (the heap, the part a leak grows) and RssShmem from /proc/<pid>/status, in MiB."""
    values = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                values[key] = int(rest.split()[0]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return values


class GpuMemory:
    """GPU memory per process in MiB: NVML (nvidia-ml-py) if importable, else nvidia-smi; None without a GPU."""

    def __init__(self):
        self.nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
        except Exception:  # not installed, or no driver: try nvidia-smi
            pass
        self.available = self.nvml is not None or bool(self._smi(["--query-gpu=index"]))
        self.source = "NVML" if self.nvml else "nvidia-smi" if self.available else "none"

    @staticmethod
    def _smi(query: list[str]) -> str:
        try:
            out = subprocess.run(
                ["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout if out.returncode == 0 else ""

    def sample(self) -> tuple[dict[int, float], float] | None:
        """({pid: MiB}, MiB used on all GPUs): the device total also covers a container whose process ids
        NVML cannot see."""
        if not self.available:
            return None
        per_pid, used = {}, 0.0
        if self.nvml:
            for i in range(self.nvml.nvmlDeviceGetCount()):
                handle = self.nvml.nvmlDeviceGetHandleByIndex(i)
                used += self.nvml.nvmlDeviceGetMemoryInfo(handle).used / MiB
                for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.usedGpuMemory is not None:
                        per_pid[proc.pid] = per_pid.get(proc.pid, 0.0) + proc.usedGpuMemory / MiB
            return per_pid, used
        for line in self._smi(["--query-compute-apps=pid,used_memory"]).splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip().isdigit() and mib.strip().replace(".", "").isdigit():
                per_pid[int(pid)] = per_pid.get(int(pid), 0.0) + float(mib)
        used = sum(float(v) for v in self._smi(["--query-gpu=memory.used"]).split() if v.replace(".", "").isdigit())
        return per_pid, used


def shm_mib(shm_prefix: str) -> tuple[dict[str, float], float]:
    """({region: size}, pages actually in use) of the server's /dev/shm regions, in MiB."""
    sizes, used = {}, 0
    for region in Path("/dev/shm").glob(shm_prefix + "*"):
        try:
            stat = region.stat()
        except OSError:
            continue
        sizes[region.name[len(shm_prefix) :]] = stat.st_size / MiB
        used += stat.st_blocks * 512
    return sizes, used / MiB


def sample(t: float, shm_prefix: str, gpu: GpuMemory, done: int, failed: int) -> dict:
    labels, regions = server_processes(shm_prefix)
    point = {
        "t_s": round(t, 2),
        "requests": done,
        "failed": failed,
        "rss_mib": {},
        "rss_no_shm_mib": {},
        "anon_mib": {},
    }
    for pid, label in labels.items():
        mem = memory_mib(pid)
        if "VmRSS" in mem:
            point["rss_mib"][label] = mem["VmRSS"]
            point["rss_no_shm_mib"][label] = mem["VmRSS"] - mem.get("RssShmem", 0.0)
            point["anon_mib"][label] = mem.get("RssAnon", 0.0)
    gpu_sample = gpu.sample()
    if gpu_sample is not None:
        per_pid, used = gpu_sample
        point["gpu_mib"] = {label: per_pid[pid] for pid, label in labels.items() if pid in per_pid}
        point["gpu_device_used_mib"] = used
    sizes, point["shm_used_mib"] = shm_mib(shm_prefix)
    point["shm_regions_mib"] = {regions.get(name, name): size for name, size in sizes.items()}
    point["shm_mib"] = sum(point["shm_regions_mib"].values())
    return point


# ---------------------------------------------------------------- the verdict


def growth_last_third(times: list[float], values: list[float]) -> float | None:
    """Median of the last third of the run over the median of the middle third (None: too few samples)."""
    third = (times[-1] - times[0]) / 3
    middle = [v for t, v in zip(times, values) if times[0] + third <= t < times[0] + 2 * third]
    last = [v for t, v in zip(times, values) if t >= times[0] + 2 * third]
    if len(middle) < 3 or len(last) < 3:
        return None
    return float(np.median(last) - np.median(middle))


def series(samples: list[dict], key: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for label, value in s.get(key, {}).items():
            out.setdefault(label, []).append((s["t_s"], value))
    return out


def judge(samples: list[dict], max_growth_mib: float, max_shm_growth_mib: float) -> list[dict]:
    """One row per (metric, process): start, thirds, end, peak, growth in the last third, verdict."""
    rows = []
    metrics = [
        ("RSS", "rss_mib", None),
        ("RSS - shm", "rss_no_shm_mib", max_growth_mib),
        ("heap (RssAnon)", "anon_mib", None),
        ("GPU", "gpu_mib", max_growth_mib),
    ]
    tracks = [
        (name, label, points, bound) for name, key, bound in metrics for label, points in series(samples, key).items()
    ]
    if any("gpu_device_used_mib" in s for s in samples):
        tracks.append(("GPU", "all GPUs (device)", [(s["t_s"], s["gpu_device_used_mib"]) for s in samples], None))
    for label, points in series(samples, "shm_regions_mib").items():
        tracks.append(("/dev/shm", f"{label} region", points, max_shm_growth_mib))
    tracks.append(("/dev/shm", "all regions", [(s["t_s"], s["shm_mib"]) for s in samples], None))
    for name, label, points, bound in tracks:
        times, values = [t for t, _ in points], [v for _, v in points]
        growth = growth_last_third(times, values)
        third = (times[-1] - times[0]) / 3

        def at(t, times=times, values=values):
            return values[min(range(len(times)), key=lambda i: abs(times[i] - t))]

        verdict = "not judged (too few samples)" if growth is None else "reported"
        if growth is not None and bound is not None:
            verdict = "flat" if growth <= bound else f"GROWS (bound {bound:g} MiB)"
        rows.append(
            {
                "metric": name,
                "process": label,
                "start_mib": values[0],
                "third_mib": at(times[0] + third),
                "two_thirds_mib": at(times[0] + 2 * third),
                "end_mib": values[-1],
                "peak_mib": max(values),
                "growth_last_third_mib": growth,
                "bound_mib": bound,
                "verdict": verdict,
            }
        )
    return rows


# ---------------------------------------------------------------- the run


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16, help="concurrent closed-loop clients")
    parser.add_argument(
        "--requests",
        type=int,
        default=300,
        help="requests per client (the run ends at the first of --requests and --duration)",
    )
    parser.add_argument("--duration", type=float, default=900, help="seconds of load at most")
    parser.add_argument("--images-per-request", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--models", nargs="+", default=["pipeline", "ensemble"], help="those present are used")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument(
        "--max-growth-mib",
        type=float,
        default=64.0,
        help="per process, RSS and GPU memory: median of the last third over the median of the middle third",
    )
    parser.add_argument(
        "--max-shm-growth-mib",
        type=float,
        default=16.0,
        help="per /dev/shm region (16 MiB = one growth step: a region grows to its largest tensors in flight)",
    )
    parser.add_argument(
        "--preprocess",
        choices=["bls", "in_process"],
        help="the pipeline's `preprocess` parameter (default: as baked); in_process: each pipeline stub decodes",
    )
    parser.add_argument("--name", default="soak", help="output file names: <name>.json, .md, .png")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from {{ cookiecutter.package_name }}.model_repository import load_config, parameters, set_parameter

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        repo = bench_repository(tmp)
        if args.preprocess:
            set_parameter(repo, "pipeline", "preprocess", args.preprocess)
        args.preprocess = parameters(repo / "pipeline")["preprocess"]
        models = [m for m in args.models if (repo / m).is_dir()]
        max_batch = load_config(repo / "pipeline").max_batch_size
        sizes = sorted({min(n, max_batch) for n in args.images_per_request})
        server = bench_server(repo, Path(tmp) / "tritonserver.log")
        prefix, gpu = server.settings.shm_prefix, GpuMemory()
        try:
            samples, latencies, errors, elapsed = run_load(args, server.grpc_url, models, sizes, prefix, gpu)
        finally:
            server.stop()

    rows = judge(samples, args.max_growth_mib, args.max_shm_growth_mib)
    summary = summarize(args, models, sizes, samples, latencies, errors, elapsed, gpu.source)
    summary["passed"] = not errors and not any(r["verdict"].startswith("GROWS") for r in rows)
    results = {
        "title": f"Soak: {args.clients} clients, {' + '.join(models)}, {'/'.join(map(str, sizes))} images per request",
        "environment": environment(),
        "notes": notes(args, summary, elapsed),
        "summary": summary,
        "rows": rows,
        "samples": samples,
    }
    write(args.name, results, rows, COLUMNS, plot_memory(samples), args.out)
    print_verdict(results, errors)
    return 0 if summary["passed"] else 1


COLUMNS = [
    "metric",
    "process",
    "start_mib",
    "third_mib",
    "two_thirds_mib",
    "end_mib",
    "peak_mib",
    "growth_last_third_mib",
    "bound_mib",
    "verdict",
]


def summarize(args, models, sizes, samples, latencies, errors, elapsed, gpu_source) -> dict:
    """The run in figures: what was sent, what failed, how fast, how long (the verdict is added by main)."""
    done = samples[-1]["requests"]
    lat = np.array(latencies or [float("nan")])
    return {
        "clients": args.clients,
        "requests_per_client": args.requests,
        "duration_limit_s": args.duration,
        "models": models,
        "pipeline_preprocess": args.preprocess,
        "images_per_request": sizes,
        "requests": done,
        "failed": len(errors),
        "first_errors": errors[:5],
        "seconds": round(elapsed, 1),
        "requests_per_s": done / elapsed,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "gpu_memory_source": gpu_source,
    }


def notes(args, summary: dict, elapsed: float) -> list[str]:
    return [
        f"{summary['requests']:,} requests in {elapsed:.0f} s ({summary['requests_per_s']:.1f}/s), "
        f"{summary['failed']} failed; p50 {summary['p50_ms']:.0f} ms, p99 {summary['p99_ms']:.0f} ms. Memory sampled "
        f"every {args.interval:g} s; GPU memory from {summary['gpu_memory_source']}. The pipeline's `preprocess` "
        f"parameter: {args.preprocess}.",
        "growth = median of the last third of the run over the median of the middle third; a process passes "
        f"when it is at most {args.max_growth_mib:g} MiB (RSS - shm, GPU), and a /dev/shm region when at most "
        f"{args.max_shm_growth_mib:g} MiB. RSS - shm: RSS without the /dev/shm pages the process touched "
        "(judged once, as /dev/shm); heap (RssAnon): without mapped files either.",
        f"Verdict: {'PASS' if summary['passed'] else 'FAIL'}.",
    ]


def print_verdict(results: dict, errors: list[str]) -> None:
    print(f"\n{results['notes'][0]}")
    for r in results["rows"]:
        growth = "-" if r["growth_last_third_mib"] is None else f"{r['growth_last_third_mib']:+.0f}"
        print(
            f"{r['metric']:>15s} {r['process']:>20s}: {r['start_mib']:8.0f} -> {r['end_mib']:8.0f} MiB, "
            f"last third {growth:>6s} MiB  {r['verdict']}"
        )
    if errors:
        print(f"{len(errors)} failed requests, first: {errors[0]}")
    print("PASS" if results["summary"]["passed"] else "FAIL")


def plot_memory(samples: list[dict]):
    """plot(ax) for _common.write: memory per process over the run, the judged last third shaded."""

    def plot(ax):
        from matplotlib import colormaps

        minutes = [s["t_s"] / 60 for s in samples]
        cut = minutes[0] + (minutes[-1] - minutes[0]) * 2 / 3
        ax.axvspan(cut, minutes[-1], color="0.92", label="last third (judged)")
        processes = sorted({label for s in samples for label in s["rss_no_shm_mib"]})
        color = dict(zip(processes, colormaps["tab20"].colors))
        for key, style, prefix in (("rss_no_shm_mib", "-", ""), ("gpu_mib", "--", "GPU ")):
            for label, points in sorted(series(samples, key).items()):
                x, y = [t / 60 for t, _ in points], [v for _, v in points]
                ax.plot(x, y, style, color=color.get(label, "black"), label=prefix + label)
        ax.plot(minutes, [s["shm_mib"] for s in samples], ":", color="black", label="/dev/shm regions")
        ax.set_xlabel("minutes of load")
        ax.set_ylabel("MiB: RSS - shm (solid), GPU (dashed)")
        ax.set_ylim(bottom=0)
        requests = ax.twinx()
        requests.plot(minutes, [s["requests"] for s in samples], "-.", color="0.55", linewidth=0.8)
        requests.set_ylabel("requests served (dash-dot)", color="0.4")
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.13))

    return plot


def run_load(args, url, models, sizes, prefix, gpu):
    """Clients in up to 8 processes of threads (Python is not the limit), memory sampled meanwhile."""
    ctx = mp.get_context("spawn")
    procs = max(1, min(args.clients, 8))
    split = [args.clients // procs + (i < args.clients % procs) for i in range(procs)]
    done, failed, results = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Queue()
    started = time.monotonic()
    deadline = ctx.Value("d", time.time() + args.duration)

    def finish_now(signum, frame):  # SIGTERM (a time limit) or Ctrl-C: stop sending, keep what was measured
        print(f"signal {signum}: the clients stop after their current request", flush=True)
        deadline.value = 0.0

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, finish_now)
    samples = [sample(0.0, prefix, gpu, 0, 0)]  # the idle server, before any request
    workers = [
        ctx.Process(
            target=worker, args=(url, models, sizes, n, sum(split[:i]), args.requests, deadline, done, failed, results)
        )
        for i, n in enumerate(split)
    ]
    for p in workers:
        p.start()
    latencies, errors, reported = [], [], 0
    next_sample = started + args.interval
    while reported < len(workers):
        try:  # drain reports as they come, so no worker blocks on a full queue
            lat, err = results.get(timeout=max(0.05, next_sample - time.monotonic()))
            latencies, errors, reported = latencies + lat, errors + err, reported + 1
        except Exception:
            pass
        if time.monotonic() >= next_sample:
            samples.append(sample(time.monotonic() - started, prefix, gpu, done.value, failed.value))
            next_sample += args.interval
            last = samples[-1]
            print(
                f"{last['t_s']:7.0f} s  {last['requests']:7d} requests  {last['failed']} failed  "
                f"RSS {sum(last['rss_mib'].values()):7.0f} MiB  /dev/shm {last['shm_mib']:.0f} MiB",
                flush=True,
            )
    for p in workers:
        p.join()
    elapsed = time.monotonic() - started
    samples.append(sample(elapsed, prefix, gpu, done.value, failed.value))
    return samples, latencies, errors, elapsed


if __name__ == "__main__":
    raise SystemExit(main())
