"""Does --disable-auto-complete-config change any model's config as the server reports it, and what does it save at
start-up and per pipeline reload? Run from a baked project: PYTHONPATH=src:. python auto-complete-stub-probe.py
(../auto-complete-stub-cpu-13ee275.md has the figures; the JSON goes to /tmp/autocomplete_probe.json)."""

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from benchmarks._common import bench_repository, sample_jpegs
from image_classifier.health import restart
from image_classifier.server import ServerSettings, TritonServer

RUNS = {"auto-complete (2.51 default)": [], "--disable-auto-complete-config": ["--disable-auto-complete-config"]}


def measure(repo: Path, log: Path, extra: list[str]) -> dict:
    class Server(TritonServer):
        def command(self):
            argv, env = super().command()
            return argv + extra, env

    with open(log, "w") as log_file:
        server = Server(ServerSettings.on_free_ports(repo, mps=False), log=log_file)
        started = time.monotonic()
        server.start()
        server.wait_ready(600)
        ready = time.monotonic() - started
        try:
            with grpcclient.InferenceServerClient(server.grpc_url) as client:
                index = client.get_model_repository_index(headers=server.settings.admin_headers, as_json=True)
                configs = {
                    m["name"]: client.get_model_config(m["name"], as_json=True)["config"] for m in index["models"]
                }
                reloads = []
                for _ in range(4):
                    t = time.monotonic()
                    restart(client, "pipeline", server.settings.admin_headers)
                    reloads.append(round(time.monotonic() - t, 2))
                image = grpcclient.InferInput("IMAGE", [1, 1], "BYTES")
                image.set_data_from_numpy(np.array([[sample_jpegs(1)[0]]], dtype=object))
                answers = {
                    m: client.infer(m, [image]).as_numpy("LABELS")[0][:2].astype(str).tolist()
                    for m in ("pipeline", "ensemble")
                }
        finally:
            server.stop()
    return {"ready_s": round(ready, 1), "pipeline_reload_s": reloads, "answers": answers, "configs": configs}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repo = bench_repository(tmp)
        results = {
            label: measure(repo, Path(tmp) / f"log{i}.txt", extra) for i, (label, extra) in enumerate(RUNS.items())
        }
    for label, result in results.items():
        print(label, "ready", result["ready_s"], "s; pipeline reloads", result["pipeline_reload_s"], result["answers"])
    on, off = (result["configs"] for result in results.values())
    for model in on:
        print("config", "identical:" if on[model] == off[model] else "differs:", model)
    with open("/tmp/autocomplete_probe.json", "w") as f:
        json.dump({k: {kk: v for kk, v in r.items() if kk != "configs"} for k, r in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
