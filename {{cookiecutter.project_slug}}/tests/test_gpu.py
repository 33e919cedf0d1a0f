"""GPU-only checks; they skip cleanly on a machine without CUDA.

What they prove on a real tritonserver with the baked model repository:
- every model instance is KIND_GPU (KIND_AUTO resolves to the GPU when one is visible);
- every tensor input of every stage, and every tensor a BLS call hands back, is on the GPU (`is_cpu()` false);
- no stage copies device -> host, except the top-k class ids that postprocess turns into labels
  (CUPTI, through torch.profiler, inside each stub);
- answers match the same stages run in-process on the same GPU;
- GPU memory does not grow over 1,000 requests;
- with two GPUs or more: every stage has instances on every GPU and each one works; what an instance hands on
  and what its BLS calls return is on its own GPU (server issue #6783); its kernels run only there; it copies to
  the host only the top-k results and between GPUs only inputs that Triton routed to it from another GPU; a stub
  that received none holds a CUDA context only on its own GPU.

The probes live in a test-only copy of the model repository: each stage's model.py is renamed stage_model.py
and wrapped by a generated model.py that records, then delegates. The user's model.py files stay as they are.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from conftest import PROJECT, image_input, infer, make_image
from tritonclient.grpc import model_config_pb2

from {{ cookiecutter.package_name }} import compiled, mps, stages
from {{ cookiecutter.package_name }}.compiled import compile_for_serve
from {{ cookiecutter.package_name }}.model_repository import (
    load_config,
    parameters,
    pixels_dtype,
    python_models,
    resnet_weights,
    top_k,
)
from {{ cookiecutter.package_name }}.server import ServerSettings, TritonServer, free_port
from {{ cookiecutter.package_name }}.stages import RESIZE_PART_PIXELS, InvalidImage, Preprocess, Reference

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


INSTANCE = {}  # this stub's instance: one stub process per model instance


def device_of(t):
    """The tensor's GPU index (DLPack device id), or None in host memory."""
    try:
        return None if t.is_cpu() else int(t.__dlpack_device__()[1])
    except Exception as exc:  # recorded: the test fails on it rather than the stage
        return f"unknown: {exc}"


def where(hop, tensors):
    for t in tensors:
        if t.name() not in STRINGS:
            write(event="tensor", hop=hop, name=t.name(), is_cpu=t.is_cpu(), device=device_of(t), **INSTANCE)


_infer = python_backend.Instance.infer


def infer(self, model_name, inputs, outputs, timeout_us=0, on_host=False):
    where(f"{self.name}->{model_name}", inputs)
    result = _infer(self, model_name, inputs, outputs, timeout_us, on_host)
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
        gpu = int(args["model_instance_device_id"]) if args["model_instance_kind"] == "GPU" else None
        INSTANCE.update(instance=args["model_instance_name"], instance_device=gpu)
        write(event="initialize", model=self.name, kind=args["model_instance_kind"], **INSTANCE)
        self.model.initialize(args)
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self.profiler.__enter__()

    async def execute(self, requests):
        write(event="execute", model=self.name, requests=len(requests), **INSTANCE)
        for request in requests:
            where(f"server->{self.name}", request.inputs())
        responses = self.model.execute(requests)
        if inspect.isawaitable(responses):
            responses = await responses
        for response in responses or []:  # None: the pipeline's guard answered them (python_backend.Guard)
            if not response.has_error():
                where(f"{self.name}->server", response.output_tensors())
        return responses

    def finalize(self):
        torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        trace = LOG.with_name(f"trace-{INSTANCE['instance']}.json")
        self.profiler.export_chrome_trace(str(trace))
        write(event="finalize", model=self.name, trace=str(trace), **INSTANCE)
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


GPUS = torch.cuda.device_count()
# Enough requests in flight that every instance of every stage, on every GPU, gets work.
BURST = [[make_image(300 + i, size=(300 + 8 * (i % 5), 250)) for i in range(min(4, MAX_BATCH))] for _ in range(96)]


def finalized(log: Path) -> set[str]:
    return {r["instance"] for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "finalize"}


def initialized(log: Path) -> set[str]:
    return {r["instance"] for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "initialize"}


def compute_apps() -> dict[int, set[int]]:
    """pid -> the GPU indices (as this process numbers them) where nvidia-smi lists it with a CUDA context."""

    def query(what: str, fields: str) -> list[list[str]]:
        try:
            argv = ["nvidia-smi", f"--query-{what}={fields}", "--format=csv,noheader"]
            out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [[v.strip() for v in line.split(",")] for line in out.splitlines() if line.strip()]

    physical = {uuid: int(index) for index, uuid in query("gpu", "index,uuid")}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = [int(d) for d in visible.split(",") if d.strip()] if visible else sorted(physical.values())
    apps: dict[int, set[int]] = {}
    for pid, uuid in query("compute-apps", "pid,gpu_uuid"):
        if physical.get(uuid) in order:
            apps.setdefault(int(pid), set()).add(order.index(physical[uuid]))
    return apps


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
        # Both entry points, so that every stage (postprocess too, which only the ensemble calls) is busy.
        calls = [(entry_points[i % len(entry_points)], images) for i, images in enumerate(BURST)]
        with ThreadPoolExecutor(32) as pool:
            burst = list(pool.map(lambda call: infer(triton.grpc_url, [image_input(call[1])], call[0]), calls))
        assert all(r.as_numpy("CLASS_IDS").shape[0] == len(b) for r, b in zip(burst, BURST))
        stubs = {r["pid"]: r for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "initialize"}
        apps = compute_apps()
        with grpcclient.InferenceServerClient(triton.grpc_url) as c:
            groups = {m: list(c.get_model_config(m).config.instance_group) for m in models}
        headers = triton.settings.admin_headers
        with grpcclient.InferenceServerClient(triton.grpc_url) as c:
            for model in ["pipeline", "ensemble", "preprocess", "resnet", "postprocess"]:
                if model in entry_points or model in models:
                    c.unload_model(model, headers=headers)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not initialized(log) <= finalized(log):
            time.sleep(0.5)
    finally:
        triton.stop()  # unloads what is left: finalize runs in each stub before the server exits
        print((work / "tritonserver.log").read_text()[-3000:])
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    finals = [r for r in rows if r["event"] == "finalize"]
    traces = {r["instance"]: json.loads(Path(r["trace"]).read_text()) for r in finals}
    images = len(entry_points) * sum(len(b) for b in BATCHES) + sum(len(b) for b in BURST)
    return {
        "rows": rows,
        "traces": traces,
        "instances": {r["instance"]: r for r in rows if r["event"] == "initialize"},
        "results": results,
        "models": models,
        "images": images,
        "stubs": stubs,
        "compute_apps": apps,
        "instance_groups": groups,
    }


def model_traces(probed) -> dict[str, list[dict]]:
    """Model -> the CUDA trace events of all its instances."""
    events: dict[str, list[dict]] = {}
    for instance, trace in probed["traces"].items():
        model = probed["instances"][instance]["model"]
        events.setdefault(model, []).extend(trace.get("traceEvents", []))
    return events


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


def test_concurrent_gpu_decodes_match_each_image_decoded_alone_on_the_gpu(server, reference):
    """Many different images in batches, through the preprocess instances running at once, each compared with the
    same image decoded alone on the GPU in this process: guards against decoder output corruption under
    concurrency (pytorch/vision#9606), which changes images wholesale.

    Measured on an H200 (fp16 bake, these 96 sizes, 3 rounds from 8 threads): max |d| 0.00098 against an fp32
    decode alone (fp16 rounding; an image swapped with its neighbour: mean |d| 1.2). Against the CPU decode,
    nvJPEG's chroma upsampling differs from libjpeg's at such odd sizes: mean |d| up to 0.030, 6.9 % of pixels
    over 0.1; that comparison is kept with bounds just above those."""
    config = load_config(PROJECT / "model_repository" / "preprocess")
    assert config.instance_group[0].count > 1, "needs several preprocess instances to run concurrently"
    images = [make_image(300 + i, size=(240 + 8 * (i % 11), 180 + 6 * (i % 7))) for i in range(96)]
    batches = [images[i : i + min(8, MAX_BATCH)] for i in range(0, len(images), min(8, MAX_BATCH))]
    cpu, one_at_a_time = Preprocess(), threading.Lock()

    def check(batch):
        pixels = torch.from_numpy(infer(server.grpc_url, [image_input(batch)], "preprocess").as_numpy("PIXELS"))
        with one_at_a_time:  # the reference: each image decoded alone, nothing else decoding in this process
            alone = torch.cat([reference.preprocess([image]).cpu() for image in batch])
        to_gpu = (pixels.float() - alone.float()).abs().flatten(1).amax(1)
        to_cpu = (pixels.float() - cpu(batch)).abs()
        return [(float(g), float(c.mean()), float((c > 0.1).float().mean())) for g, c in zip(to_gpu, to_cpu)]

    with ThreadPoolExecutor(8) as pool:
        stats = [s for batch_stats in pool.map(check, batches * 3) for s in batch_stats]
    print(
        f"\nconcurrent vs alone on the GPU, worst max |d|: {max(s[0] for s in stats)}; vs the CPU, worst mean |d|"
        f" {max(s[1] for s in stats):.4f}, worst share over 0.1 {max(s[2] for s in stats):.4f}"
    )
    assert all(max_gpu <= 0.002 for max_gpu, _, _ in stats), "each image as it decodes alone (fp16 rounding at most)"
    assert all(mean < 0.04 and far < 0.09 for _, mean, far in stats), "within nvJPEG's measured distance from libjpeg"


def test_the_baked_default_serves_every_model_with_kind_gpu(server, probed):
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        for model in probed["models"]:
            config = c.get_model_config(model).config
            kinds = [model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind) for g in config.instance_group]
            assert kinds == ["KIND_GPU"], (model, kinds)
    seen = {r["model"]: r["kind"] for r in probed["rows"] if r["event"] == "initialize"}
    assert seen == {m: "GPU" for m in probed["models"]}


def pipeline_runs_postprocess_via_bls(repository: Path) -> bool:
    return parameters(repository / "pipeline")["postprocess"] == "bls"


def pipeline_runs_preprocess_via_bls(repository: Path) -> bool:
    return parameters(repository / "pipeline")["preprocess"] == "bls"


def preprocess_is_called(repository: Path) -> bool:
    """Whether serving calls the preprocess model: the ensemble's first step, or the pipeline with "bls"."""
    return (repository / "ensemble").is_dir() or pipeline_runs_preprocess_via_bls(repository)


def test_every_stage_sees_its_tensors_on_the_gpu(probed, model_repository):
    tensors = [r for r in probed["rows"] if r["event"] == "tensor"]
    hops = {(r["hop"], r["name"]) for r in tensors}
    print(sorted(hops))
    expected = [
        ("server->resnet", "PIXELS"),
        ("resnet->server", "LOGITS"),
        ("pipeline->resnet", "PIXELS"),
        ("resnet->pipeline", "LOGITS"),
    ]
    if pipeline_runs_preprocess_via_bls(model_repository):  # else the pipeline decodes: its pixels are its own
        expected.append(("preprocess->pipeline", "PIXELS"))
    if preprocess_is_called(model_repository):
        expected.append(("preprocess->server", "PIXELS"))
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


def copies(events: list[dict], kind: str) -> list[dict]:
    """The memcpy events of one kind (DtoH, HtoD, DtoD, PtoP) in a CUDA trace."""
    return [
        {"name": e["name"], "bytes": e.get("args", {}).get("bytes"), "device": e.get("args", {}).get("device")}
        for e in events
        if e.get("cat") == "gpu_memcpy" and kind in e.get("name", "")
    ]


def test_the_gpu_path_makes_no_device_to_host_copy(probed, model_repository):
    traces = model_traces(probed)
    assert set(traces) == set(probed["models"])
    to_host = {model: copies(events, "DtoH") for model, events in traces.items()}
    print(json.dumps(to_host))
    kernels = sum(e.get("cat") == "kernel" for e in traces["resnet"])
    assert kernels > 0, "the profiler saw no kernel in resnet: CUPTI saw nothing, so this test would prove nothing"
    # The only device->host copies: the top-k results, FP32 scores and int64 class ids (labels are looked up on
    # the host), made by whichever model runs the top-k: postprocess, or the pipeline itself. Each answered image
    # costs k * 12 bytes there, and nothing else crosses to the host.
    k = top_k(model_repository)
    top_k_bytes = sum(c["bytes"] for model in ("postprocess", "pipeline") for c in to_host.pop(model, []))
    assert 0 < top_k_bytes <= probed["images"] * k * 12
    assert to_host == {model: [] for model in to_host}


@pytest.fixture(scope="module")
def gpu_reference(model_repository) -> Reference:
    """The same stages, weights and precision in-process on the same GPU."""
    variant, weights = resnet_weights(model_repository)
    dtype = pixels_dtype(model_repository)
    return Reference(variant, weights, top_k(model_repository), device="cuda:0", dtype=dtype)


def test_gpu_answers_match_the_in_process_reference(server, gpu_reference):
    tol = 1e-3 if gpu_reference.preprocess.dtype == torch.float32 else 2e-2
    for model in ("pipeline", "ensemble"):
        for images in BATCHES:
            result = infer(server.grpc_url, [image_input(images)], model)
            scores, class_ids = gpu_reference(images)
            np.testing.assert_allclose(result.as_numpy("SCORES"), scores.cpu().numpy(), atol=tol, rtol=1e-2)
            assert (result.as_numpy("CLASS_IDS")[:, 0] == class_ids[:, 0].cpu().numpy()).all()


def test_the_resnet_stage_serves_the_model_compiled_once(server, model_repository, capfd):
    """Every resnet instance runs the model compiled from the cache the session filled (conftest, as `serve` does),
    and the next start finds it ready: the server's answers above are the compiled model's, within 0.02 of eager's
    with its top-1."""
    (target,) = compiled.targets(model_repository)
    path = target.path(torch.device("cuda", 0))
    assert compiled.ready(path).is_file(), compiled.failure(path)
    log = Path(server.log.name).read_text(errors="replace")
    loads = re.findall(r"(resnet_\S+): (compiled \(|eager)", log)
    assert loads and all(how == "compiled (" for _, how in loads), loads
    stamp = compiled.ready(path).stat().st_mtime_ns
    capfd.readouterr()
    compile_for_serve(model_repository, [0])
    out = capfd.readouterr().out
    assert f"compiled resnet: cached, {target.describe(torch.device('cuda', 0))} ({path})" in out
    assert compiled.ready(path).stat().st_mtime_ns == stamp


def gpu_memory_used_mib(server) -> int:
    """GPU memory of this server's own processes (tritonserver and its stubs), as nvidia-smi lists them: other
    servers on the same GPU (tests run side by side) do not count."""
    own = {server.process.pid} | {p.pid for p in mps.processes() if p.ppid == server.process.pid}
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [[int(v) for v in line.split(",")] for line in out.splitlines() if line.strip()]
    used = [mib for pid, mib in rows if pid in own]
    assert used, "nvidia-smi lists none of the server's processes"
    return sum(used)


def test_gpu_memory_does_not_grow_over_1000_requests(server):
    images = [make_image(200 + i, size=(300 + 20 * i, 260)) for i in range(min(4, MAX_BATCH))]

    def send(i):
        batch = images[: 1 + i % len(images)]
        return infer(server.grpc_url, [image_input(batch)]).as_numpy("CLASS_IDS").shape[0] == len(batch)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(send, range(300)))  # warm up: allocator caches, cuDNN plans, batch shapes
        before = gpu_memory_used_mib(server)
        assert all(pool.map(send, range(1000)))
        after = gpu_memory_used_mib(server)
    print(f"GPU memory used by the server's processes: {before} MiB before, {after} MiB after 1,000 requests")
    assert after - before <= 64


CAPPED = """
import io, json
import numpy as np, torch
from PIL import Image
from {{ cookiecutter.package_name }}.stages import Preprocess

def jpeg(rng, w, h):
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, format="JPEG")
    return out.getvalue()

max_batch, budget = 32, 2_000_000
rng = np.random.default_rng(0)
stage = Preprocess("cuda:0", torch.float16, max_pixels=4 * budget, decode_budget_pixels=budget)
cap = stage.peak_gpu_bytes(max_batch)
stage.own_gpu_memory(max_batch)  # as the preprocess stub does at load
loaded = torch.cuda.memory_reserved(0)
sizes = [(int(rng.integers(64, 1400)), int(rng.integers(64, 1400))) for _ in range(40)]
sizes = [(w, h) for w, h in sizes if w * h <= budget]
pool = [jpeg(rng, w, h) for w, h in sizes] + [jpeg(rng, 2400, 1500), jpeg(rng, 3000, 2000)]  # over the budget
reserved = []
for _ in range(150):
    n = int(rng.integers(1, max_batch + 1))
    pixels = stage([pool[int(i)] for i in rng.integers(0, len(pool), n)])
    assert pixels.shape == (n, 3, 224, 224)
    torch.cuda.synchronize()
    reserved.append(torch.cuda.memory_reserved(0))
print(json.dumps({"cap": cap, "loaded": loaded, "reserved": reserved, "peak": torch.cuda.max_memory_reserved(0)}))
"""


def test_preprocess_on_the_gpu_resizes_a_batch_in_parts_as_each_image_alone():
    """A batch of 500x375 JPEGs spanning three resize parts (stages.RESIZE_PART_PIXELS), with an odd-sized image in
    the first, so that the first part's slots are not contiguous: on the GPU every image gets what it gets alone."""
    stage = Preprocess("cuda:0", torch.float16)
    side = stage.center_square(torch.empty(3, 375, 500)).shape[-1]  # of a 500x375 image
    per_part = RESIZE_PART_PIXELS // side**2
    images = [make_image(400 + k, size=(500, 375)) for k in range(2 * per_part + 3)]
    images.insert(per_part - 1, make_image(99, size=(320, 240)))
    batch = stage(images)
    assert batch.shape == (len(images), 3, 224, 224)
    for k, image in enumerate(images):
        torch.testing.assert_close(batch[k], stage([image])[0], msg=f"slot {k}")


def test_preprocess_on_the_gpu_resizes_a_large_square_in_strips(monkeypatch):
    """A 6000x4000 JPEG (at the decode budget, so still decoded on the GPU) has a center square of 12 M pixels,
    147 MB as float: it goes to float a strip at a time (stages.resize_in_strips), so the stage holds the decoded
    image, one strip (not two: each is freed before the next is made) and the square resized across, well under
    that whole float copy (before the strips it held the image, the float copy and a uint8 copy of the square),
    and it gives what one resize of the whole square gives."""
    stage = Preprocess("cuda:0", torch.float16)
    width, height = 6000, 4000
    assert width * height <= stage.decode_budget_pixels
    image = make_image(7, size=(width, height))
    stage([image])  # nvJPEG's and the kernels' setup
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(0)
    before = torch.cuda.memory_allocated(0)
    in_strips = stage([image])
    torch.cuda.synchronize()
    held = torch.cuda.max_memory_allocated(0) - before
    side = stage.center_square(torch.empty(3, height, width)).shape[-1]
    whole = width * height * 3 + side * side * 3 * 4
    one_strip = width * height * 3 + RESIZE_PART_PIXELS * 3 * 4 * 3 // 2 + side * stage.crop * 3 * 4
    print(
        f"held {held / 2**20:.0f} MiB at most; the decoded image, 1.5 strips and the square resized across: "
        f"{one_strip / 2**20:.0f} MiB; the decoded image and its square as float: {whole / 2**20:.0f} MiB"
    )
    assert held < one_strip < whole
    monkeypatch.setattr(stages, "RESIZE_PART_PIXELS", 10**9)  # the whole square at once
    torch.testing.assert_close(in_strips, stage([image]))


SMALLEST_CAP = """
import io, json, math
import numpy as np, torch
from PIL import Image
from {{ cookiecutter.package_name }}.stages import Preprocess

stage = Preprocess("cuda:0", torch.float16)
stage.own_gpu_memory(1)  # as a stub of max_batch_size 1 at load: the cap's smallest, a budget-size warm-up image
side = math.isqrt(stage.decode_budget_pixels)  # the largest center square a budget's image holds
y, x = np.mgrid[0:side, 0:side] / side
out = io.BytesIO()
Image.fromarray((np.stack([x, y, x * y], axis=-1) * 255).astype(np.uint8)).save(out, format="JPEG")
for _ in range(3):
    assert stage([out.getvalue()]).shape == (1, 3, 224, 224)
torch.cuda.synchronize()
print(json.dumps({"cap": stage.peak_gpu_bytes(1), "peak": torch.cuda.max_memory_reserved(0), "side": side}))
"""


def test_preprocess_at_max_batch_1_serves_the_largest_square_under_its_cap(tmp_path):
    """At max_batch_size 1 the preprocess stub's cap is at its smallest (stages.preprocess_peak_bytes: 173 MiB at
    the defaults), and its square images are the largest: the warm-up's own image fills the decode budget, and a
    square JPEG of the budget's pixels gives the largest center square, resized in strips. In a process of its own
    as in a stub: the warm-up and that image succeed, and reserved memory stays within the cap."""
    run = subprocess.run([sys.executable, "-c", SMALLEST_CAP], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    print(f"cap {result['cap'] / 2**20:.0f} MiB; peak reserved {result['peak'] / 2**20:.0f} MiB; {result['side']}^2")
    assert result["peak"] <= result["cap"]


def test_preprocess_gpu_memory_plateaus_under_its_cap(tmp_path):
    """The preprocess stub's bound (Preprocess.own_gpu_memory: capped at its peak, the peak reached at load), in a
    process of its own as in a stub: batches of 1-32 random JPEGs of random sizes, some of them up to 3x the decode
    budget (decoded and resized on the host, so the cap does not depend on max_pixels), all succeed, reserved memory
    never passes the cap, and the last third of the run reserves at most an eighth of the cap more than the first
    two thirds did (the allocator reclaims cached blocks past 60 % of the cap instead of reserving new ones)."""
    run = subprocess.run([sys.executable, "-c", CAPPED], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    reserved, cap = result["reserved"], result["cap"]
    third = len(reserved) // 3
    print(
        f"cap {cap / 2**20:.0f} MiB; reserved after load {result['loaded'] / 2**20:.0f} MiB; "
        f"peak reserved {result['peak'] / 2**20:.0f} MiB; max reserved by thirds "
        + ", ".join(f"{max(reserved[i : i + third]) / 2**20:.0f}" for i in range(0, 3 * third, third))
        + " MiB"
    )
    assert result["peak"] <= cap
    assert max(reserved[2 * third :]) <= max(reserved[: 2 * third]) + cap // 8


# --- every GPU of the host ------------------------------------------------------------------------------------
#
# Triton sends a BLS call (or an ensemble step) to any instance of the called model, whatever GPU the caller is
# on, and hands the callee its input where the caller left it (the Python backend keeps a GPU input on its
# source device). What an instance controls stays on its own GPU: what it hands on, what its BLS calls return
# (preferred_memory with its device id; server issue #6783), where its kernels run. An input that comes from
# another GPU is moved by Instance.to_torch with one peer copy. These tests hold each part to that, and print
# how often a call crossed GPUs.

multi_gpu = pytest.mark.skipif(GPUS < 2, reason="needs two GPUs or more")


def arrivals_from_other_gpus(probed) -> dict[str, int]:
    """Instance -> how many GPU tensors the server handed it on another GPU than its own."""
    counts = {instance: 0 for instance in probed["instances"]}
    for r in probed["rows"]:
        if r["event"] == "tensor" and r["hop"].startswith("server->") and not r["is_cpu"]:
            counts[r["instance"]] += r["device"] != r["instance_device"]
    return counts


HOLD = """
import sys, time, torch
free = int(sys.argv[1])
held = []
while torch.cuda.mem_get_info()[0] > free + (64 << 20):
    held.append(torch.empty(min(1 << 30, torch.cuda.mem_get_info()[0] - free), dtype=torch.uint8, device="cuda"))
print("holding", flush=True)
time.sleep(1e6)
"""


def gpu_used_mib() -> int:
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
    out = subprocess.run(query, capture_output=True, text=True, check=True).stdout
    return int(float(out.split()[0]))


@pytest.mark.parametrize("budget_gib", [16, 10])
def test_serve_starts_on_a_gpu_of_which_another_process_holds_all_but_a_budget(model_repository, tmp_path, budget_gib):
    """As on a 16 GB card or a shared GPU: another process holds the rest of the GPU's memory, and `serve` with no
    flag sizes its counts to the budget it finds (at 10 GiB fewer than the configs'), comes up ready, answers the
    pipeline and the ensemble like the in-process reference, and stays within the budget while it serves."""
    if torch.cuda.mem_get_info()[0] < (budget_gib + 4) << 30:
        pytest.skip(f"needs {budget_gib + 4} GiB free on the GPU")
    repo = tmp_path / "model_repository"
    shutil.copytree(PROJECT / "model_repository", repo, ignore=shutil.ignore_patterns("*.pt", "__pycache__", "configs"))
    shutil.copy(resnet_weights(model_repository)[1], resnet_weights(repo)[1])
    shutil.copy(model_repository / "resnet" / "labels.txt", repo / "resnet" / "labels.txt")
    hold = subprocess.Popen([sys.executable, "-c", HOLD, str(budget_gib << 30)], stdout=subprocess.PIPE, text=True)
    serve = None
    try:
        assert hold.stdout.readline().strip() == "holding"
        before = gpu_used_mib()
        ports = [str(free_port()) for _ in range(3)]
        argv = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", "serve", "--model-repository", str(repo)]
        argv += ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]
        argv += ["--log-file", str(tmp_path / "triton.log")]
        serve = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        while (line := serve.stdout.readline()) and not line.startswith(("ready in", "error")):
            lines.append(line.rstrip())
        assert line.startswith("ready in"), "\n".join([*lines, line])
        assert lines[0].startswith(f"instances: GPU 0: {budget_gib}."), lines
        assert ("the configs' counts" if budget_gib > 12 else "limited by GPU memory") in lines[0], lines
        threading.Thread(target=serve.stdout.read, daemon=True).start()
        images = [make_image(300 + i, size=(500, 375)) for i in range(16)]
        url = f"localhost:{ports[1]}"
        entries = [m for m in ("pipeline", "ensemble") if (repo / m).is_dir()]
        answers = [infer(url, [image_input(images)], m).as_numpy("CLASS_IDS")[:, 0] for m in entries]
        for other in answers[1:]:
            np.testing.assert_array_equal(answers[0], other)

        def served(_) -> bool:
            return infer(url, [image_input(images)]).as_numpy("SCORES").shape[0] == 16

        with ThreadPoolExecutor(32) as pool:
            assert all(pool.map(served, range(400)))
        used = gpu_used_mib() - before
        print(f"{lines[0]}; in use while serving: {used} MiB")
        assert used <= budget_gib * 1024, f"{used} MiB used, over the {budget_gib} GiB left to serve"
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(120)
        hold.kill()
        hold.wait()


@multi_gpu
def test_multi_gpu_every_stage_has_an_instance_on_every_gpu_and_each_one_worked(probed):
    for model, groups in probed["instance_groups"].items():
        kinds = {model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind) for g in groups}
        assert kinds == {"KIND_GPU"} and {gpu for g in groups for gpu in g.gpus} == set(range(GPUS)), (model, groups)
    placed = {(r["model"], r["instance_device"]) for r in probed["instances"].values()}
    assert placed == {(m, gpu) for m in probed["models"] for gpu in range(GPUS)}
    # The burst of concurrent requests reached every instance: otherwise this proves nothing about GPU 1.
    worked = {(r["model"], r["instance_device"]) for r in probed["rows"] if r["event"] == "execute"}
    assert worked == placed, f"idle instances: {sorted(placed - worked)}"


@multi_gpu
def test_multi_gpu_what_each_instance_hands_on_and_gets_back_is_on_its_own_gpu(probed, model_repository):
    tensors = [r for r in probed["rows"] if r["event"] == "tensor"]
    # In host memory on purpose: the top-k results, which only go back to the client.
    host = {
        (f"{m}->{to}", n)
        for m in ("postprocess", "pipeline")
        for to in ("server", "pipeline")
        for n in ("SCORES", "CLASS_IDS")
    }
    # Every hop but the server's deliveries: the instance's own outputs, its BLS inputs and its BLS results.
    owned = [r for r in tensors if not r["hop"].startswith("server->") and (r["hop"], r["name"]) not in host]
    elsewhere = sorted(
        {(r["instance"], r["hop"], r["name"], r["device"]) for r in owned if r["device"] != r["instance_device"]}
    )
    print(f"{len(owned)} tensors an instance produced or got back from a BLS call; elsewhere: {elsewhere}")
    assert elsewhere == [], "(instance, hop, tensor, device) not on the instance's own GPU"
    hops = {(r["hop"], r["instance_device"]) for r in owned}
    expected = ["resnet->pipeline", "pipeline->resnet", "resnet->server"]
    expected += ["preprocess->pipeline"] if pipeline_runs_preprocess_via_bls(model_repository) else []
    expected += ["preprocess->server"] if preprocess_is_called(model_repository) else []
    for hop in expected:
        assert {(hop, gpu) for gpu in range(GPUS)} <= hops, f"{hop} not seen on every GPU"
    crossed = arrivals_from_other_gpus(probed)
    delivered = sum(r["hop"].startswith("server->") and not r["is_cpu"] for r in tensors)
    print(f"GPU inputs the server delivered from another GPU: {sum(crossed.values())} of {delivered}: {crossed}")


@multi_gpu
def test_multi_gpu_instances_compute_on_their_gpu_with_peer_copies_only_for_inputs_from_elsewhere(probed):
    assert set(probed["traces"]) == set(probed["instances"])
    crossed = arrivals_from_other_gpus(probed)
    for instance, trace in probed["traces"].items():
        gpu, model = probed["instances"][instance]["instance_device"], probed["instances"][instance]["model"]
        events = trace.get("traceEvents", [])
        kernels = {e.get("args", {}).get("device") for e in events if e.get("cat") == "kernel"}
        assert kernels <= {gpu}, f"{instance} (cuda:{gpu}) ran kernels on devices {kernels}"
        peer = copies(events, "PtoP")
        assert len(peer) <= crossed[instance], (
            f"{instance}: {len(peer)} peer copies, {crossed[instance]} inputs from elsewhere"
        )
        to_host = copies(events, "DtoH")
        # the top-k results only, by whichever model runs the top-k (test_the_gpu_path_makes_no_device_to_host_copy)
        assert model in ("postprocess", "pipeline") or to_host == [], f"{instance} copied to the host: {to_host}"
    busy = {probed["instances"][i]["instance_device"] for i, t in probed["traces"].items() if t.get("traceEvents")}
    assert busy == set(range(GPUS)), "CUPTI saw no work on some GPU: this test would prove nothing there"


@multi_gpu
def test_multi_gpu_a_stub_touches_no_other_gpu_unless_it_was_handed_a_tensor_from_there(probed):
    seen = {pid: gpus for pid, gpus in probed["compute_apps"].items() if pid in probed["stubs"]}
    if not seen:
        pytest.skip("nvidia-smi lists no process of this machine's stubs (a container without the host's PIDs?)")
    crossed = arrivals_from_other_gpus(probed)
    print({probed["stubs"][pid]["instance"]: sorted(gpus) for pid, gpus in seen.items()})
    assert len(seen) == len(probed["stubs"]), "nvidia-smi lists some stubs and not others"
    for pid, gpus in seen.items():
        stub = probed["stubs"][pid]
        assert stub["instance_device"] in gpus
        # The pipeline's execute() runs on the stub's event-loop thread: Instance.bind() keeps it off cuda:0.
        if not crossed[stub["instance"]]:
            assert gpus == {stub["instance_device"]}, f"{stub['instance']} holds CUDA contexts on GPUs {sorted(gpus)}"
