"""GPU-only checks; they skip cleanly on a machine without CUDA.

What they prove on a real tritonserver with the baked model repository:
- every model instance is KIND_GPU (KIND_AUTO resolves to the GPU when one is visible);
- every tensor input of every stage, and every tensor a BLS call hands back, is on the GPU (`is_cpu()` false);
- no stage copies device -> host, except the top-k class ids that postprocess turns into labels
  (CUPTI, through torch.profiler, inside each stub);
- answers match the same stages run in-process on the same GPU;
- GPU memory does not grow over 1,000 requests.

The probes live in a test-only copy of the model repository: each stage's model.py is renamed stage_model.py
and wrapped by a generated model.py that records, then delegates. The user's model.py files stay as they are.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from conftest import PROJECT, TRITON_DTYPES, image_input, infer, make_image
from tritonclient.grpc import model_config_pb2

from {{ cookiecutter.package_name }}.model_repository import load_config, python_models, resnet_weights, top_k
from {{ cookiecutter.package_name }}.server import ServerSettings, TritonServer
from {{ cookiecutter.package_name }}.stages import InvalidImage, Preprocess, Reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROBE = '''"""Test probe: records where tensors live and what the stub copies, then runs the real stage model."""
import importlib.util
import inspect
import json
import os
import threading
from pathlib import Path

import torch

from {{ cookiecutter.package_name }} import python_backend

LOG = Path(__LOG__)
STRINGS = set(__STRINGS__)
_lock = threading.Lock()


def write(**row):
    row["pid"] = os.getpid()
    with _lock, open(LOG, "a") as f:
        f.write(json.dumps(row) + "\\n")


def where(hop, tensors):
    for t in tensors:
        if t.name() not in STRINGS:
            write(event="tensor", hop=hop, name=t.name(), is_cpu=t.is_cpu())


_infer = python_backend.Instance.infer


async def infer(self, model_name, inputs, outputs, timeout_us=0, on_host=False):
    where(f"{self.name}->{model_name}", inputs)
    result = await _infer(self, model_name, inputs, outputs, timeout_us, on_host)
    where(f"{model_name}->{self.name}", result.values())
    return result


python_backend.Instance.infer = infer


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        path = Path(args["model_repository"]) / args["model_version"] / "stage_model.py"
        spec = importlib.util.spec_from_file_location(f"stage_{self.name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.model = module.TritonPythonModel()
        write(event="initialize", model=self.name, kind=args["model_instance_kind"])
        self.model.initialize(args)
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self.profiler.__enter__()

    async def execute(self, requests):
        for request in requests:
            where(f"server->{self.name}", request.inputs())
        responses = self.model.execute(requests)
        if inspect.isawaitable(responses):
            responses = await responses
        for response in responses:
            if not response.has_error():
                where(f"{self.name}->server", response.output_tensors())
        return responses

    def finalize(self):
        torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        trace = LOG.with_name(f"trace-{self.name}.json")
        self.profiler.export_chrome_trace(str(trace))
        write(event="finalize", model=self.name, trace=str(trace))
        if hasattr(self.model, "finalize"):
            self.model.finalize()
'''


def string_tensor_names(repository: Path) -> set[str]:
    names = set()
    for config in repository.glob("*/config.pbtxt"):
        parsed = load_config(config.parent)
        for tensor in [*parsed.input, *parsed.output]:
            if tensor.data_type == model_config_pb2.TYPE_STRING:
                names.add(tensor.name)
    return names


def start(repository: Path, log_path: Path) -> TritonServer:
    settings = ServerSettings.on_free_ports(repository)
    triton = TritonServer(settings, container=False, log=open(log_path, "w")).start()
    try:
        triton.wait_ready(600)
    except Exception:
        triton.stop()
        print(log_path.read_text()[-5000:])
        raise
    return triton


MAX_BATCH = load_config(PROJECT / "model_repository" / "pipeline").max_batch_size
BATCHES = [[make_image(100 + i, size=(320 + 16 * i, 240)) for i in range(min(n, MAX_BATCH))] for n in (1, 3, 8, 2)]


def finalized(log: Path) -> set[str]:
    return {r["model"] for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "finalize"}


@pytest.fixture(scope="module")
def probed(model_repository, tmp_path_factory):
    """Serve a probed copy of the repository, send a few batches to both entry points, unload every model
    (finalize writes each stub's CUDA trace) and return what the probes recorded."""
    work = tmp_path_factory.mktemp("probe")
    repo = work / "model_repository"
    shutil.copytree(model_repository, repo)
    log = work / "probe.jsonl"
    log.touch()
    source = PROBE.replace("__LOG__", repr(str(log))).replace("__STRINGS__", repr(sorted(string_tensor_names(repo))))
    models = python_models(repo)
    for name in models:
        (repo / name / "1" / "model.py").rename(repo / name / "1" / "stage_model.py")
        (repo / name / "1" / "model.py").write_text(source)

    triton = start(repo, work / "tritonserver.log")
    try:
        entry_points = [m for m in ("pipeline", "ensemble") if (repo / m).is_dir()]
        results = {
            (m, i): infer(triton.grpc_url, [image_input(images)], m)
            for m in entry_points
            for i, images in enumerate(BATCHES)
        }
        headers = triton.settings.admin_headers
        with grpcclient.InferenceServerClient(triton.grpc_url) as c:
            for model in ["pipeline", "ensemble", "preprocess", "resnet", "postprocess"]:
                if model in entry_points or model in models:
                    c.unload_model(model, headers=headers)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(finalized(log)) < len(models):
            time.sleep(0.5)
    finally:
        triton.stop()  # unloads what is left: finalize runs in each stub before the server exits
        print((work / "tritonserver.log").read_text()[-3000:])
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    traces = {r["model"]: json.loads(Path(r["trace"]).read_text()) for r in rows if r["event"] == "finalize"}
    return {"rows": rows, "traces": traces, "results": results, "models": models}


def test_gpu_preprocess_decodes_on_the_device_and_matches_the_cpu():
    images = [make_image(i) for i in range(4)] + [make_image(9, fmt="PNG")]
    gpu = Preprocess("cuda:0")(images)
    assert gpu.device.type == "cuda"
    # nvJPEG and libjpeg differ by a few levels per pixel, more at sharp color edges (chroma upsampling):
    # on an H200, 2% of the values differed by more than 0.1 (normalized), a few by up to 1.2.
    diff = (gpu.cpu().float() - Preprocess()(images)).abs()
    assert diff.mean() < 0.02 and (diff > 0.1).float().mean() < 0.05, (diff.mean(), (diff > 0.1).float().mean())


def test_a_truncated_jpeg_is_rejected_on_the_gpu_too():
    data = make_image(7)
    with pytest.raises(InvalidImage, match="truncated JPEG"):
        Preprocess("cuda:0")([data[: len(data) // 3]])


def test_concurrent_gpu_decodes_match_the_cpu_decode_image_by_image(server):
    """Many different images in batches, through the preprocess instances running at once, each compared with the
    CPU decode: guards against decoder output corruption under concurrency (pytorch/vision#9606)."""
    config = load_config(PROJECT / "model_repository" / "preprocess")
    assert config.instance_group[0].count > 1, "needs several preprocess instances to run concurrently"
    images = [make_image(300 + i, size=(240 + 8 * (i % 11), 180 + 6 * (i % 7))) for i in range(96)]
    batches = [images[i : i + min(8, MAX_BATCH)] for i in range(0, len(images), min(8, MAX_BATCH))]
    cpu = Preprocess()

    def check(batch):
        pixels = infer(server.grpc_url, [image_input(batch)], "preprocess").as_numpy("PIXELS")
        diff = (torch.from_numpy(pixels.astype(np.float32)) - cpu(batch)).abs()
        # per image: nvJPEG vs libjpeg differ by a few levels (see the test above); corruption differs wholesale
        return [(float(d.mean()), float((d > 0.1).float().mean())) for d in diff]

    with ThreadPoolExecutor(8) as pool:
        stats = [s for batch_stats in pool.map(check, batches * 3) for s in batch_stats]
    worst = max(stats)
    assert all(mean < 0.02 and far < 0.05 for mean, far in stats), worst


def test_the_baked_default_serves_every_model_with_kind_gpu(server, probed):
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        for model in probed["models"]:
            config = c.get_model_config(model).config
            kinds = [model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind) for g in config.instance_group]
            assert kinds == ["KIND_GPU"], (model, kinds)
    seen = {r["model"]: r["kind"] for r in probed["rows"] if r["event"] == "initialize"}
    assert seen == {m: "GPU" for m in probed["models"]}


def pipeline_runs_postprocess_via_bls(repository: Path) -> bool:
    return load_config(repository / "pipeline").parameters["postprocess"].string_value == "bls"


def test_every_stage_sees_its_tensors_on_the_gpu(probed, model_repository):
    tensors = [r for r in probed["rows"] if r["event"] == "tensor"]
    hops = {(r["hop"], r["name"]) for r in tensors}
    print(sorted(hops))
    expected = [
        ("preprocess->server", "PIXELS"),
        ("server->resnet", "PIXELS"),
        ("resnet->server", "LOGITS"),
        ("preprocess->pipeline", "PIXELS"),
        ("pipeline->resnet", "PIXELS"),
        ("resnet->pipeline", "LOGITS"),
    ]
    if (model_repository / "ensemble").is_dir():
        expected += [("server->postprocess", "LOGITS"), ("postprocess->server", "SCORES")]
    # The top-k results travel to the client over gRPC: they are brought to the host on purpose, by postprocess
    # (ensemble, or the pipeline's BLS call with host preferred memory) or by the pipeline itself (in process).
    final = {
        (f"{m}->{to}", n)
        for m in ("postprocess", "pipeline")
        for to in ("server", "pipeline")
        for n in ("SCORES", "CLASS_IDS")
    }
    if pipeline_runs_postprocess_via_bls(model_repository):
        expected.append(("pipeline->postprocess", "LOGITS"))
    # every hop of the pipeline was observed
    for hop in expected:
        assert hop in hops, hop
    on_cpu = sorted({(r["hop"], r["name"]) for r in tensors if r["is_cpu"]} - final)
    assert on_cpu == [], f"tensors on the CPU: {on_cpu}"


def device_to_host(trace: dict) -> list[dict]:
    return [
        {"name": e["name"], "bytes": e.get("args", {}).get("bytes")}
        for e in trace.get("traceEvents", [])
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")
    ]


def test_the_gpu_path_makes_no_device_to_host_copy(probed, model_repository):
    assert set(probed["traces"]) == set(probed["models"])
    copies = {model: device_to_host(trace) for model, trace in probed["traces"].items()}
    print(json.dumps(copies))
    kernels = sum(e.get("cat") == "kernel" for e in probed["traces"]["resnet"].get("traceEvents", []))
    assert kernels > 0, "the profiler saw no kernel in resnet: CUPTI saw nothing, so this test would prove nothing"
    # The only device->host copies: the top-k results, FP32 scores and int64 class ids (labels are looked up on
    # the host), made by whichever model runs the top-k: postprocess, or the pipeline itself. Each answered image
    # costs k * 12 bytes there, and nothing else crosses to the host.
    k = top_k(model_repository)
    entry_points = [m for m in ("pipeline", "ensemble") if (model_repository / m).is_dir()]
    images = len(entry_points) * sum(len(b) for b in BATCHES)
    top_k_bytes = sum(c["bytes"] for model in ("postprocess", "pipeline") for c in copies.pop(model, []))
    assert 0 < top_k_bytes <= images * k * 12
    assert copies == {model: [] for model in copies}


@pytest.fixture(scope="module")
def gpu_reference(model_repository) -> Reference:
    """The same stages, weights and precision in-process on the same GPU."""
    variant, weights = resnet_weights(model_repository)
    pixels = next(o for o in load_config(model_repository / "preprocess").output if o.name == "PIXELS")
    dtype = TRITON_DTYPES[model_config_pb2.DataType.Name(pixels.data_type)]
    return Reference(variant, weights, top_k(model_repository), device="cuda:0", dtype=dtype)


def test_gpu_answers_match_the_in_process_reference(server, gpu_reference):
    tol = 1e-3 if gpu_reference.preprocess.dtype == torch.float32 else 2e-2
    for model in ("pipeline", "ensemble"):
        for images in BATCHES:
            result = infer(server.grpc_url, [image_input(images)], model)
            scores, class_ids = gpu_reference(images)
            np.testing.assert_allclose(result.as_numpy("SCORES"), scores.cpu().numpy(), atol=tol, rtol=1e-2)
            assert (result.as_numpy("CLASS_IDS")[:, 0] == class_ids[:, 0].cpu().numpy()).all()


def gpu_memory_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.split()[0])


def test_gpu_memory_does_not_grow_over_1000_requests(server):
    images = [make_image(200 + i, size=(300 + 20 * i, 260)) for i in range(min(4, MAX_BATCH))]

    def send(i):
        batch = images[: 1 + i % len(images)]
        return infer(server.grpc_url, [image_input(batch)]).as_numpy("CLASS_IDS").shape[0] == len(batch)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(send, range(300)))  # warm up: allocator caches, cuDNN plans, batch shapes
        before = gpu_memory_used_mib()
        assert all(pool.map(send, range(1000)))
        after = gpu_memory_used_mib()
    print(f"GPU memory used: {before} MiB before, {after} MiB after 1,000 requests")
    assert after - before <= 64
