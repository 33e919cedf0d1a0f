"""What an operator reads, from a real tritonserver: latency percentiles and the project's own counters in the
metrics, and request traces in which a pipeline request's three BLS calls are its children."""

import io
import json
import re
import urllib.request

import pytest
from conftest import image_input, infer, local_server_only, make_image, metrics
from PIL import Image
from tritonclient.utils import InferenceServerException

from {{ cookiecutter.package_name }}.model_repository import BLS_CALLS, load_config
from {{ cookiecutter.package_name }}.server import ServerSettings, TritonServer

STAGES = ("preprocess", "resnet", "postprocess")  # the project's stages, whatever else the pipeline calls


@local_server_only
def test_the_metrics_hold_each_models_latency_percentiles(server):
    infer(server.grpc_url, [image_input([make_image(0)])])
    url = f"http://localhost:{server.settings.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    summaries = re.findall(r"^nv_inference_request_summary_us\{([^}]*)\} \d", text, re.M)
    for model in ("pipeline", *STAGES):
        for quantile in ("0.5", "0.9", "0.99"):
            labels = (f'model="{model}"', f'quantile="{quantile}"')
            assert any(all(label in found for label in labels) for found in summaries), f"no p{quantile} of {model}"


@local_server_only
def test_the_projects_counters_count_bad_requests_and_host_decodes(server):
    """A bad image is counted where it was refused (preprocess) and where its request was answered (pipeline); an
    image over the decode budget (24 M pixels) is counted as decoded on the host."""
    before = metrics(server)
    with pytest.raises(InferenceServerException):
        infer(server.grpc_url, [image_input([b"not an image"])])
    large = io.BytesIO()
    Image.new("RGB", (6000, 4500), (90, 120, 150)).save(large, format="JPEG")  # 27 M pixels
    infer(server.grpc_url, [image_input([large.getvalue()])])
    after = metrics(server)
    for key in (("invalid_requests", "preprocess"), ("invalid_requests", "pipeline")):
        assert after.get(key, 0) == before.get(key, 0) + 1, (key, before, after)
    assert after[("host_decoded_images", "preprocess")] == before.get(("host_decoded_images", "preprocess"), 0) + 1
    assert ("given_up_requests", "pipeline") in after, "every counter has its series from the start"


@local_server_only
def test_a_traced_pipeline_request_has_its_three_stage_calls_as_children(model_repository, tmp_path):
    """serve --trace FILE: Triton's own JSON traces, written as the server stops. Four pipeline instances at least,
    so that 2.51's teardown (a second per instance) outlasts TEARDOWN_GRACE_S here too, as on a GPU at the configs'
    counts: Triton writes the file only once the teardown is done."""
    trace = tmp_path / "trace.json"
    pipelines = max(4, load_config(model_repository / "pipeline").instance_group[0].count)
    settings = ServerSettings.on_free_ports(model_repository, trace=str(trace), instance_counts={"pipeline": pipelines})
    with open(tmp_path / "tritonserver.log", "w") as log, TritonServer(settings, container=False, log=log) as triton:
        triton.wait_ready(600)
        infer(triton.grpc_url, [image_input([make_image(0), make_image(1)])])
    records = json.loads(trace.read_text())
    models = {r["id"]: r for r in records if "model_name" in r}
    (pipeline,) = [r for r in models.values() if r["model_name"] == "pipeline"]
    children = sorted(r["model_name"] for r in models.values() if r.get("parent_id") == pipeline["id"])
    assert children == sorted(BLS_CALLS["pipeline"]), records
