"""Benchmark: `serve` with no flag on a GPU of which only a budget is free, as on a smaller card or a shared one.

    python -m benchmarks.budgets [--budgets full 24 16 8] [--seconds 20] [--out DIR] [--quick]

For each budget (GiB; `full`: the whole GPU, the baseline) another process takes the rest of the GPU's memory, then
`{{ cookiecutter.project_slug }} serve` starts exactly as a user would start it (its own sizing, no flag), and:
- the end-to-end tests (tests/test_e2e.py) run against it over gRPC;
- a closed loop at saturation (16 images x 128 requests in flight) for --seconds gives the best images/s and the
  failed requests; the GPU's memory is sampled during this loop and the next (the peak, less what was in use
  before `serve` started);
- the same loop again with a hot reload of the pipeline in its middle (a new version, loaded with
  `{{ cookiecutter.project_slug }} reload`): the requests that failed are the ones the reload lost;
- one image at a time (1 x 1) gives the p50 latency;
- the log is searched for out-of-memory lines, and each process's GPU memory is read by model.
Writes gpu-budgets.json (a row per budget) and gpu-budgets.md, after each budget.

A budget written `16@10/3/2/1` serves those counts instead of serve's own (`--instances`, in the order `plan`
prints the models): a comparison of counts at one budget. `--quick` runs the closed loop alone (no e2e tests, no
reload, no one-image latency), with each stage's batch size, queue and compute time from Triton's statistics, to
compare many counts within one device call.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ._common import RESULTS, environment, sample_jpegs
from .e2e import run_point

MiB, GiB = 1 << 20, 1 << 30
HOG = """
import sys, time, torch
budget = int(sys.argv[1])
held = []
while torch.cuda.mem_get_info()[0] > budget + (64 << 20):
    held.append(torch.empty(min(1 << 30, torch.cuda.mem_get_info()[0] - budget), dtype=torch.uint8, device="cuda"))
print("holding", sum(t.numel() for t in held), flush=True)
time.sleep(1e6)
"""
COLUMNS = [
    "gpu",
    "budget_gib",
    "counts",
    "img_s_best",
    "img_s_full_gpu",
    "share",
    "p50_one_image_ms",
    "failed_requests",
    "oom_lines",
    "peak_gpu_mib",
    "reload_lost",
    "e2e",
]


def smi(query: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout
    return [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.strip()]


def used_mib() -> int:
    return int(float(smi("gpu=memory.used")[0][0]))


class Peak(threading.Thread):
    """The most GPU memory in use while it runs (nvidia-smi, every 0.5 s)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.done = 0, threading.Event()

    def run(self):
        while not self.done.wait(0.5):
            self.peak = max(self.peak, used_mib())


def per_model_mib(server_pid: int) -> dict[str, list[int]]:
    from {{ cookiecutter.package_name }}.health import stub_processes

    used = {int(p): int(m) for p, m in smi("compute-apps=pid,used_memory")}
    out: dict[str, list[int]] = {"tritonserver": [used.get(server_pid, 0)]}
    for pid, model in stub_processes(server_pid).items():
        out.setdefault(model or "?", []).append(used.get(pid, 0))
    return {m: sorted(v) for m, v in out.items()}


def reload_pipeline(project: Path, url: str) -> float:
    """A new version of the pipeline beside the running one, loaded with `<slug> reload pipeline` (the sized count
    kept), as docs/customizing.md's recipe 4 does: seconds it took. (A load of an unchanged model is no reload.)"""
    version = project / "model_repository" / "pipeline" / "2"
    shutil.copytree(version.with_name("1"), version, ignore=shutil.ignore_patterns("__pycache__"))
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", "reload", "pipeline", "--url", url],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(f"  reload: {run.stdout.strip()} {run.stderr.strip()}", flush=True)
    return time.monotonic() - started


def pinned_counts(spec: str, project: Path) -> list[str]:
    """`10/3/2/1` -> ["pipeline=10", "preprocess=3", ...], in the order of the plan's models."""
    from {{ cookiecutter.package_name }}.model_repository import load_configs
    from {{ cookiecutter.package_name }}.sizing import ceilings

    models = list(ceilings(load_configs(project / "model_repository"), 0))
    counts = spec.split("/")
    if len(counts) != len(models):
        raise SystemExit(f"{spec}: give a count for each of {', '.join(models)}")
    return [f"{m}={n}" for m, n in zip(models, counts)]


def one_budget(spec: str, args, project: Path, work: Path) -> dict:
    from {{ cookiecutter.package_name }}.server import OUT_OF_MEMORY, free_port

    budget, _, pinned = spec.partition("@")
    hog = None
    if budget != "full":
        hog = subprocess.Popen(
            [sys.executable, "-c", HOG, str(int(float(budget) * GiB))], stdout=subprocess.PIPE, text=True
        )
        print(f"  {hog.stdout.readline().strip()} bytes elsewhere", flush=True)
    before = used_mib()
    ports = [free_port() for _ in range(3)]
    log = work / f"tritonserver-{spec.replace('/', '-')}.log"
    argv = [
        sys.executable,
        "-m",
        "{{ cookiecutter.package_name }}.cli",
        "serve",
        "--http-port",
        str(ports[0]),
        "--grpc-port",
        str(ports[1]),
        "--metrics-port",
        str(ports[2]),
        "--log-file",
        str(log),
        *(["--instances", *pinned_counts(pinned, project)] if pinned else []),
    ]
    serve = subprocess.Popen(argv, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"localhost:{ports[1]}"
    row = {"gpu": smi("gpu=name")[0][0], "budget_gib": spec, "counts": {}, "plan": ""}
    lines = []
    peak = Peak()  # while the loops run (the tests' own reference would count too)
    try:
        started = time.monotonic()
        for line in serve.stdout:
            lines.append(line.rstrip())
            print("  serve:", line.rstrip(), flush=True)
            if line.startswith("instances: "):
                row["plan"] = line[len("instances: ") :].strip()
                counts = line.split("-> ", 1)[1].split(" (~", 1)[0]
                row["counts"] = {m: int(n) for m, n in (part.rsplit(" ", 1) for part in counts.split(", "))}
            if line.startswith("ready in") or line.startswith("error"):
                break
        row["ready_s"] = round(time.monotonic() - started, 1)
        row["started"] = any(line.startswith("ready in") for line in lines)
        if not row["started"]:
            row["error"] = "\n".join(lines[-15:])
            return row
        threading.Thread(target=lambda: [None for _ in serve.stdout], daemon=True).start()  # keep the pipe drained
        if args.quick:
            from {{ cookiecutter.package_name }} import admin_key

            peak.start()
            headers = {admin_key.ADMIN_KEY_HEADER: admin_key.find()[0] or ""}
            best = run_point(url, "pipeline", sample_jpegs(16), 128, args.seconds, headers=headers)
            row["img_s_best"], row["failed_requests"] = round(best["img_s"]), best["errors"]
            # each stage's view (Triton's statistics over the loop): a stage slower per batch at a smaller budget
            # than on the whole GPU runs slower kernels, not only fewer instances
            row["stages"] = {
                m: {k: round(v, 2) for k, v in st.items() if k in ("mean_batch", "queue_ms", "compute_infer_ms")}
                for m, st in best["stages"].items()
            }
            row["per_process_mib"] = per_model_mib(_server_pid(serve.pid))
            return row
        env = dict(os.environ, TRITON_GRPC_URL=url, MODEL_REPOSITORY=str(project / "model_repository"))
        junit = work / f"e2e-{budget}.xml"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/test_e2e.py",
                f"--junitxml={junit}",
            ],
            cwd=project,
            env=env,
            timeout=600,
        )
        text = junit.read_text() if junit.is_file() else ""
        totals = {k: int(v) for k, v in re.findall(r'(tests|failures|errors|skipped)="(\d+)"', text)[:4]}
        failed = totals.get("failures", 0) + totals.get("errors", 0)
        row["e2e"] = f"{totals.get('tests', 0) - failed - totals.get('skipped', 0)} passed, {failed} failed"
        images = sample_jpegs(16)
        peak.start()
        best = run_point(url, "pipeline", images, 128, args.seconds)
        row["img_s_best"] = round(best["img_s"])
        row["failed_requests"] = best["errors"]
        reload_at = threading.Timer(
            args.seconds / 3 + 4, lambda: row.__setitem__("reload_s", round(reload_pipeline(project, url), 1))
        )
        reload_at.start()
        during = run_point(url, "pipeline", images, 128, args.seconds)
        reload_at.join()
        peak.done.set()
        row["reload_lost"] = during["errors"]
        row["img_s_during_reload"] = round(during["img_s"])
        one = run_point(url, "pipeline", images[:1], 1, 5)
        row["p50_one_image_ms"] = round(one["p50_ms"], 2)
        row["per_process_mib"] = per_model_mib(_server_pid(serve.pid))
    finally:
        peak.done.set()
        row["peak_gpu_mib"] = peak.peak - before if peak.peak else None
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(120)
        except subprocess.TimeoutExpired:
            serve.kill()
        if hog is not None:
            hog.kill()
            hog.wait()
        shutil.rmtree(project / "model_repository" / "pipeline" / "2", ignore_errors=True)
        text = log.read_text(errors="replace") if log.is_file() else ""
        row["oom_lines"] = sum(1 for line in text.splitlines() if OUT_OF_MEMORY.search(line))
    return row


def _server_pid(serve_pid: int) -> int:
    """The tritonserver child of `serve`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if "(tritonserver)" in text and int(text.rsplit(")", 1)[1].split()[1]) == serve_pid:
            return int(stat.parent.name)
    return 0


def write(rows: list[dict], out: Path) -> None:
    full = next((r.get("img_s_best") for r in rows if r["budget_gib"] == "full"), None)
    for r in rows:
        r["img_s_full_gpu"] = full
        r["share"] = round(r["img_s_best"] / full, 2) if full and r.get("img_s_best") else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-budgets.json").write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = []
        for c in COLUMNS:
            v = r.get(c, "")
            cells.append("/".join(map(str, v.values())) if isinstance(v, dict) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    (out / "gpu-budgets.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="+", default=["full", "24", "16", "8"])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="the closed loop alone at each budget")
    args = parser.parse_args(argv)
    project = Path(__file__).resolve().parents[1]
    work = Path(tempfile.mkdtemp(prefix="budgets-"))
    rows = []
    previous = args.out / "gpu-budgets.json"
    if previous.is_file():  # a run in parts (one device call each): the rows already measured stay
        rows = [r for r in json.loads(previous.read_text())["rows"] if r["budget_gib"] not in args.budgets]
    for budget in args.budgets:
        print(f"=== budget {budget}", flush=True)
        rows.append(one_budget(budget, args, project, work))
        print(json.dumps(rows[-1]), flush=True)
        write(rows, args.out)
    print((args.out / "gpu-budgets.md").read_text())


if __name__ == "__main__":
    main()
