"""`docker compose stop` with requests in flight: every one of them must finish, and the stop must take less than
the service's stop_grace_period (else Docker would have killed the server).

    python .ci/stop_in_flight.py GRPC_URL docker compose -f docker-compose.yml -f docker-compose.cpu.yml

Run in the baked project with its src/ on PYTHONPATH: the requests go through the project's own client.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

REQUESTS, IMAGES_PER_REQUEST = 8, 4


def jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


def seconds(duration: str) -> float:
    """A duration as `docker compose config` writes it ("1m30s")."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration))


def main(url: str, compose: list[str]) -> int:
    from importlib import import_module

    package = json.loads(Path(".cookiecutter.json").read_text())["cookiecutter"]["package_name"]
    ImageClassifier = import_module(f"{package}.client").ImageClassifier

    config = json.loads(
        subprocess.run([*compose, "config", "--format", "json"], check=True, capture_output=True).stdout
    )
    grace = seconds(config["services"]["triton"]["stop_grace_period"])
    images = [jpeg(i) for i in range(IMAGES_PER_REQUEST)]
    done: list[float] = []

    def send(_) -> int:
        with ImageClassifier(url, timeout_s=grace) as classifier:
            result = classifier.infer(images)
        done.append(time.monotonic())
        return result.as_numpy("CLASS_IDS").shape[0]

    with ThreadPoolExecutor(REQUESTS) as pool:
        futures = [pool.submit(send, i) for i in range(REQUESTS)]
        time.sleep(1)  # all sent: queued or executing
        stopping = time.monotonic()
        subprocess.run([*compose, "stop", "triton"], check=True)
        took = time.monotonic() - stopping
        answered = [f.result() for f in futures]  # raises if any request failed
    in_flight = sum(t > stopping for t in done)
    print(f"stop took {took:.1f} s (stop_grace_period {grace:.0f} s); {in_flight} of {REQUESTS} requests were in")
    print(f"flight when it began, and all {REQUESTS} were answered ({IMAGES_PER_REQUEST} images each)")
    state = subprocess.run(
        ["docker", "inspect", "--format", "{{.State.ExitCode}}", *container_ids(compose)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    print(f"triton container exit code: {' '.join(state)}")
    assert answered == [IMAGES_PER_REQUEST] * REQUESTS
    assert in_flight > 0, "no request was still in flight when the stop began: nothing was tested"
    assert took < grace, "the stop outlasted stop_grace_period: Docker killed the server"
    assert state == ["0"], "the server did not exit cleanly"
    return 0


def container_ids(compose: list[str]) -> list[str]:
    result = subprocess.run([*compose, "ps", "--all", "--quiet", "triton"], check=True, capture_output=True, text=True)
    return result.stdout.split()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
