"""Shared by the benchmarks: where results go, the environment they ran in, tables, plots, a server."""

from __future__ import annotations

import datetime
import io
import json
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image

PROJECT = Path(__file__).resolve().parents[1]
RESULTS = PROJECT / "benchmarks" / "results"


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def environment() -> dict:
    """Hardware, versions, date and commit: what a published figure must carry."""
    import torch
    import torchvision

    gpu = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    commit = os.environ.get("BENCH_COMMIT") or _run(["git", "-C", str(PROJECT), "rev-parse", "--short", "HEAD"])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or "unknown",
        "gpu": gpu.splitlines()[0] if gpu else "none",
        "cpu": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "tritonserver": triton_version(),
    }


def triton_version() -> str:
    try:
        from importlib.metadata import version

        return f"{version('nvidia-pytriton')} (nvidia-pytriton wheel)"
    except Exception:
        home = os.environ.get("TRITONSERVER_HOME", "/opt/tritonserver")
        text = Path(home, "TRITON_VERSION").read_text().strip() if Path(home, "TRITON_VERSION").is_file() else ""
        return text or f"from {home}"


def write(name: str, results: dict, rows: list[dict], columns: list[str], plot, out: Path = RESULTS) -> None:
    """results -> <name>.json; rows -> <name>.md (a table under the environment); plot(ax) -> <name>.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    env = results["environment"]
    lines = [f"# {results['title']}", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", *results.get("notes", []), ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    plot(ax)
    ax.set_title(f"{results['title']}\n{env['gpu'].split(',')[0]}, {env['date'][:10]}, {env['commit']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out / name}.json, .md, .png")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def sample_jpegs(count: int, size=(500, 375), quality=90, seed=0) -> list[bytes]:
    """Photo-like JPEGs (smooth gradients, shapes and sensor noise): about 50-60 KB at 500x375."""
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    images = []
    for _ in range(count):
        channels = [
            np.sin(2 * np.pi * (rng.uniform(0.5, 3) * x + rng.uniform(0.5, 3) * y + rng.uniform())) for _ in range(3)
        ]
        rgb = (np.stack(channels, -1) + 1) * 110 + rng.normal(0, 12, (h, w, 3))
        out = io.BytesIO()
        Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).save(out, format="JPEG", quality=quality)
        images.append(out.getvalue())
    return images


def with_pool_size(argv: list[str], pool_bytes: int, gpus: int = 1) -> list[str]:
    """tritonserver argv with the CUDA memory pool resized (the pool carries every GPU tensor between processes)."""
    argv = [a for a in argv if not a.startswith("--cuda-memory-pool-byte-size")]
    return argv + [f"--cuda-memory-pool-byte-size={g}:{pool_bytes}" for g in range(gpus)]


def set_precision(repository: Path, precision: str) -> None:
    """Rewrite the PIXELS data type of preprocess and resnet (the baked precision is the default)."""
    for model in ("preprocess", "resnet"):
        path = repository / model / "config.pbtxt"
        text = re.sub(r'(name: "PIXELS", data_type: )TYPE_\w+', rf"\1TYPE_{precision.upper()}", path.read_text())
        path.write_text(text)


def bench_repository(workdir: Path) -> Path:
    """A copy of the project's model repository in `workdir`, with deterministic random weights if it has none."""
    from {{ cookiecutter.package_name }}.weights import write_random_versions

    repo = Path(workdir) / "model_repository"
    shutil.copytree(PROJECT / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__"))
    write_random_versions(repo, only_missing=True)
    return repo


def bench_server(repository: Path, log_path: Path, pool_bytes: int | None = None, mps: bool = True):
    """The project's own tritonserver (same flags as `serve`, CUDA MPS on a GPU unless `mps` is False) on free
    ports, optionally with another pool size. `server.mps_status` says whether MPS is on."""
    from {{ cookiecutter.package_name }}.compiled import compile_for_serve
    from {{ cookiecutter.package_name }}.server import ServerSettings, TritonServer, visible_gpus

    class BenchServer(TritonServer):
        def command(self):
            argv, env = super().command()
            if pool_bytes is not None:
                argv = with_pool_size(argv, pool_bytes, max(1, len(visible_gpus())))
            return argv, env

    settings = ServerSettings.on_free_ports(repository, mps=mps)
    compile_for_serve(repository, settings.gpus)  # as `serve` does: the compiled resnet, cached once
    server = BenchServer(settings, log=open(log_path, "w"))
    server.start()
    print(f"CUDA MPS: {server.mps_status}")
    try:
        server.wait_ready(600)
    except Exception:
        server.stop()
        # Why: the server's error lines (E + date), which 2.51 writes long before its last lines (its options table
        # and its shutdown), then those last lines.
        lines = Path(log_path).read_text(errors="replace").splitlines()
        errors = [line for line in lines if re.match(r"E\d{4} ", line)]
        print("\n".join(["tritonserver's errors:", *errors[-40:], "its last lines:", *lines[-15:]]))
        raise
    return server


def instance_counts(repository: Path) -> dict[str, int]:
    """{model: instances per GPU (or in all, on the CPU)} of the repository's Python-backend models."""
    from {{ cookiecutter.package_name }}.model_repository import load_config, python_models

    return {m: sum(g.count or 1 for g in load_config(repository / m).instance_group) for m in python_models(repository)}


STAT_PHASES = ("queue", "compute_input", "compute_infer", "compute_output")


def model_statistics(url: str, headers: dict) -> dict:
    """Triton's cumulative per-model statistics: {model: {"requests", "batches", phase: ns}}."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:
        stats = client.get_inference_statistics(headers=headers, as_json=True)
    out = {}
    for model in stats.get("model_stats", []):
        infer = model.get("inference_stats", {})
        row = {"requests": int(infer.get("success", {}).get("count", 0))}
        row["batches"] = sum(int(b.get("compute_infer", {}).get("count", 0)) for b in model.get("batch_stats", []))
        row["images"] = sum(
            int(b.get("batch_size", 0)) * int(b.get("compute_infer", {}).get("count", 0))
            for b in model.get("batch_stats", [])
        )
        for phase in STAT_PHASES:
            row[phase] = int(infer.get(phase, {}).get("ns", 0))
        out[model["name"]] = row
    return out


def statistics_delta(before: dict, after: dict) -> dict:
    """Per model over one point: requests, mean batch size, and each phase in ms per request (Triton's own view)."""
    delta = {}
    for model, end in after.items():
        start = before.get(model, {})
        requests = end["requests"] - start.get("requests", 0)
        if requests <= 0:
            continue
        batches = end["batches"] - start.get("batches", 0)
        row = {"requests": requests, "mean_batch": (end["images"] - start.get("images", 0)) / max(batches, 1)}
        for phase in STAT_PHASES:
            row[f"{phase}_ms"] = (end[phase] - start.get(phase, 0)) / requests / 1e6
        delta[model] = row
    return delta


class GpuSampler:
    """Samples GPU utilization and memory through NVML every `interval_s` in a thread: `with GpuSampler() as s:`."""

    def __init__(self, interval_s: float = 0.1):
        import threading

        self.interval_s, self.samples, self._stop = interval_s, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            indices = range(pynvml.nvmlDeviceGetCount())
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # NVML numbers every GPU of the host: the server's only
            if visible is not None:
                indices = [int(d) for d in visible.split(",") if d.strip().isdigit()]
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        except Exception:  # no NVML (no GPU, or nvidia-ml-py missing): no samples
            return
        if not handles:  # the server sees no GPU
            return
        while not self._stop.wait(self.interval_s):
            self.samples.append(
                [
                    (pynvml.nvmlDeviceGetUtilizationRates(h).gpu, pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20)
                    for h in handles
                ]
            )

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        util = [sum(u for u, _ in s) / len(s) for s in self.samples]
        return {
            "gpu_util_pct": float(np.mean(util)),
            "gpu_mem_mib": float(max(sum(m for _, m in s) for s in self.samples)),
        }
