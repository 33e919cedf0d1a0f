"""The project's own counters in Triton's metrics, kept from inside the stubs (pb_utils.MetricFamily)."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from .model_repository import RELOADS_PARAMETER


class Counters:
    """The project's own counters in Triton's metrics (pb_utils.MetricFamily), beside its nv_inference_* ones, one
    series per model: `{{ cookiecutter.package_name }}_invalid_requests_total` (requests answered INVALID_ARGUMENT: a
    bad image, or a request over a cap), `..._host_decoded_images_total` (images over the GPU's decode budget,
    decoded on the host), `..._given_up_requests_total` (requests the guard answered after a stage's stub died),
    `..._cancelled_requests_total` and `..._expired_requests_total` (stopped before their next stage: cancelled by
    their client, or past their deadline). Counted only on those events (each a message to the server); one per stub
    process (`COUNTERS`). Beside them a gauge, `..._watchdog_reloads`: how often `serve`'s watchdog has reloaded the
    model since it was loaded from the repository (a stub of it, or of a model it calls, died), which each new stub
    reads from its config (health.restart counts there) and sets."""

    HELP = {
        "invalid_requests": "Requests answered INVALID_ARGUMENT: a bad image, or a request over a cap",
        "host_decoded_images": "Images over the GPU's decode budget, decoded and resized on the host",
        "given_up_requests": "Requests answered UNAVAILABLE by the guard after a called stage's stub died",
        "cancelled_requests": "Requests cancelled by their client, stopped before their next stage",
        "expired_requests": "Requests past their client's timeout, answered UNAVAILABLE before their next stage",
    }

    def __init__(self):
        self.families: list = []
        self.metrics: dict = {}

    def setup(self, model: str, parameters: dict[str, str]) -> None:
        """This stub's series, labelled with its model (once; a server without metrics has none), and the watchdog's
        reloads of the model as its config's `parameters` count them."""
        if self.metrics:
            return
        try:
            for name, text in self.HELP.items():
                family = pb_utils.MetricFamily(
                    name=f"{{ cookiecutter.package_name }}_{name}_total", description=text, kind=pb_utils.MetricFamily.COUNTER
                )
                self.families.append(family)  # a family dropped would take its series with it
                self.metrics[name] = family.Metric(labels={"model": model})
            family = pb_utils.MetricFamily(
                name="{{ cookiecutter.package_name }}_watchdog_reloads",
                description="Reloads of this model by serve's watchdog (a stub of it, or of a model it calls, died) "
                "since it was loaded from the repository",
                kind=pb_utils.MetricFamily.GAUGE,
            )
            self.families.append(family)
            self.metrics["watchdog_reloads"] = family.Metric(labels={"model": model})
            self.metrics["watchdog_reloads"].set(float(parameters.get(RELOADS_PARAMETER, 0)))
        except Exception as exc:  # metrics off (--allow-metrics=false): nothing to count into
            pb_utils.Logger.log_warn(f"no {{ cookiecutter.package_name }} counters: {exc}")
            self.metrics = {}

    def count(self, name: str, n: int = 1) -> None:
        if n and name in self.metrics:
            self.metrics[name].increment(n)


COUNTERS = Counters()
