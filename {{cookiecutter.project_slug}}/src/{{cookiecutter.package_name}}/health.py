"""Real health: one small inference through the pipeline, and a watchdog that reloads dead stubs.

Triton 2.51 keeps `/v2/health/ready` and model readiness true after a Python-backend stub dies, while every
request to that model fails with "Stub process '<model>_0_0' is not healthy" until the model is reloaded.
So health here means an answer to a real request, and recovery means reloading the model that lost its stub.
"""

from __future__ import annotations

import functools
import io
import json
import re
import threading
import uuid

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image

DEAD_STUB = re.compile(r"Stub process '(?P<model>.+?)_\d+_\d+' is not healthy")


@functools.cache
def probe_image() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (120, 140, 160)).save(buffer, format="PNG")
    return buffer.getvalue()


def probe(url: str, model: str = "pipeline", timeout_s: float = 30) -> str | None:
    """None if `model` answers one small image, else why not."""
    image = grpcclient.InferInput("IMAGE", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[probe_image()]], dtype=object))
    try:
        with grpcclient.InferenceServerClient(url) as client:
            client.infer(model, [image], client_timeout=timeout_s)
    except Exception as exc:
        return str(exc)
    return None


def restart(client: grpcclient.InferenceServerClient, model: str, admin_headers: dict[str, str]) -> None:
    """Reload `model` with new stubs. A plain load of an unchanged model is a no-op, and an unload would take
    its dependents (the ensemble) down with it; a config override with a fresh token forces a real reload
    while the dependents stay loaded."""
    config = client.get_model_config(model, as_json=True)["config"]
    config.setdefault("parameters", {})["restart_token"] = {"string_value": uuid.uuid4().hex}
    client.load_model(model, config=json.dumps(config), headers=admin_headers)


class StubWatchdog(threading.Thread):
    """Probe the pipeline every `interval_s`; reload each model whose stub is reported dead."""

    def __init__(self, url: str, admin_headers: dict[str, str], interval_s: float = 10, log=print):
        super().__init__(name="stub-watchdog", daemon=True)
        self.url, self.admin_headers, self.interval_s, self.log = url, admin_headers, interval_s, log
        self.stopped = threading.Event()

    def check(self) -> list[str]:
        """Probe, reload what is dead, probe again (a dead stage can hide behind a dead pipeline)."""
        reloaded = []
        for _ in range(4):
            error = probe(self.url)
            dead = sorted(set(DEAD_STUB.findall(error or "")))
            if not dead:
                break
            with grpcclient.InferenceServerClient(self.url) as client:
                for model in dead:
                    self.log(f"watchdog: the stub of {model!r} is dead; reloading {model}")
                    restart(client, model, self.admin_headers)
                    reloaded.append(model)
        return reloaded

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.check()
            except Exception as exc:  # the server may be stopping; try again next round
                self.log(f"watchdog: {exc}")

    def stop(self) -> None:
        self.stopped.set()
