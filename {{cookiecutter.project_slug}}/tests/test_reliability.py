"""The bad day, against a real tritonserver over gRPC: bad input, load, leaks, overload, hot reload,
admin keys, dead stubs and graceful shutdown. Every loop is bounded in count and time; loopback only."""

import collections
import contextlib
import io
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import image_input, infer, local_server_only, make_image, metrics, png_header
from PIL import Image
from tritonclient.utils import InferenceServerException

from {{ cookiecutter.package_name }} import stub_deaths
from {{ cookiecutter.package_name }}.health import (
    GET_ROBUST_LIST,
    IDLE_S,
    REPLACED_GRACE_S,
    StubWatchdog,
    holds_robust_lock,
    kill_outside_locks,
    probe,
    restart,
    stub_processes,
)
from {{ cookiecutter.package_name }}.model_repository import (
    bls_callers,
    load_config,
    loaded_versions,
    python_models,
    set_instance_counts,
    set_parameter,
)
from {{ cookiecutter.package_name }}.server import ServerSettings, TritonServer

pytestmark = pytest.mark.e2e
CLIENTS, REQUESTS_PER_CLIENT = (32, 5000) if os.environ.get("RELIABILITY_FULL") else (8, 25)


PROJECT = Path(__file__).resolve().parents[1]  # the project's root: benchmarks/ is there


def raw_input(name, array, dtype):
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def processes(server: TritonServer) -> dict[int, str]:
    """{pid: command line} of the server and its Python-backend stubs."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if server.settings.shm_prefix in cmdline:
            found[int(entry.name)] = cmdline
    return found


def rss_mib(pids) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def shm_regions(server: TritonServer) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in Path("/dev/shm").glob(server.settings.shm_prefix + "*")}


def stub_pids(server: TritonServer, model: str) -> list[int]:
    return [pid for pid, name in stub_processes(server.process.pid).items() if name == model]


def stub_counts(server: TritonServer) -> dict[str, int]:
    """Live stubs per model."""
    counts: dict[str, int] = {}
    for name in stub_processes(server.process.pid).values():
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
    return counts


def configured_counts(server: TritonServer) -> dict[str, int]:
    """The stubs each Python model of the server's repository should have: count x GPUs on a GPU x the versions
    it loads (recipe 3 keeps two resnets)."""
    per_device = max(1, len(server.settings.gpus))
    counts = {}
    for config_file in sorted(Path(server.settings.model_repository).glob("*/config.pbtxt")):
        config = load_config(config_file.parent)
        if config.backend == "python":
            versions = loaded_versions(config_file.parent, config)
            counts[config.name] = sum(g.count for g in config.instance_group) * per_device * versions
    return counts


def wait_for_configured_stubs(server: TritonServer, timeout_s: float, poll_s: float = 0.2) -> None:
    """Until every Python model has the stubs its config asks for (the versions a reload replaced have unloaded),
    or `timeout_s`; the caller asserts what it needs."""
    deadline = time.monotonic() + timeout_s
    while stub_counts(server) != configured_counts(server) and time.monotonic() < deadline:
        time.sleep(poll_s)


def reload_model(server: TritonServer, model: str, config: dict | None = None) -> None:
    """Load `model` again (with this config where given, with the admin key), once the versions earlier
    reloads replaced have unloaded, and return once this reload's replaced version has too. 2.51 ends a replaced
    version's stubs one a second (16 pipeline stubs: 16 s), and under MPS a reload within that time makes three
    generations of pipeline stubs, past the 48 clients a GPU takes (on the H200 the new version then failed to
    load: "CUDA-capable device(s) is/are busy or unavailable")."""
    wait_for_configured_stubs(server, 120)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.load_model(model, config=None if config is None else json.dumps(config),
                          headers=server.settings.admin_headers)  # fmt: skip
    wait_for_configured_stubs(server, 120)


@contextlib.contextmanager
def config_changed(server: TritonServer, model: str, change):
    """`model` reloaded with its served config as `change(config)` edits it (the JSON the server gives) for the
    while, its own config loaded again after."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        original = client.get_model_config(model, as_json=True)["config"]
    config = json.loads(json.dumps(original))
    change(config)
    reload_model(server, model, config)
    try:
        yield
    finally:
        reload_model(server, model, original)


def pipeline_queue_policy(server: TritonServer, **policy: str):
    """The pipeline reloaded with these `dynamic_batching.default_queue_policy` fields for the while."""
    return config_changed(server, "pipeline", lambda c: c["dynamic_batching"]["default_queue_policy"].update(policy))


# ---------------------------------------------------------------- bad input, on the shared server

BAD_REQUESTS = {
    # one bad image beside a good one fails the whole request it is in
    "not-an-image": lambda: [image_input([make_image(71), b"this is plain text, not an image"])],
    "empty-element": lambda: [image_input([make_image(71), b""])],
    "truncated-header": lambda: [image_input([make_image(70)[:40]])],
    "image-bomb-header": lambda: [image_input([png_header(30000, 30000)])],
    "thin-image-header": lambda: [image_input([png_header(40000, 1)])],
    "truncated-jpeg": lambda: [image_input([make_image(1, size=(640, 480))[:2000]])],
    "over-max-batch": lambda: [image_input([b"x"] * 4096)],
    "wrong-dtype": lambda: [raw_input("IMAGE", np.zeros((1, 1), np.float32), "FP32")],
    "wrong-shape": lambda: [raw_input("IMAGE", np.array([[b"a", b"b"]], dtype=object), "BYTES")],
    "missing-input": lambda: [raw_input("PIXELS", np.array([[b"a"]], dtype=object), "BYTES")],
}


@pytest.mark.parametrize("model", ["pipeline", "ensemble"])
@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_gets_invalid_argument_and_nothing_else_breaks(server, model_repository, name, model):
    if not (model_repository / model).is_dir():
        pytest.skip(f"no {model} in this project")
    with pytest.raises(InferenceServerException) as error:
        infer(server.grpc_url, BAD_REQUESTS[name](), model)
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT", error.value.message()
    assert probe(server.grpc_url) is None, "the server still answers real requests"


@pytest.mark.parametrize("model", ["pipeline", "ensemble"])
def test_ordinary_concurrency_is_served_not_rejected(server, model_repository, model):
    """A busy server is not an overloaded one: 16 clients sending one image each at the same instant are all
    served, whatever the max batch (the queues hold at least 64 requests; 1 is the hardest case)."""
    if not (model_repository / model).is_dir():
        pytest.skip(f"no {model} in this project")
    clients, rounds = 16, 3
    image, gate = make_image(9, size=(160, 120)), threading.Barrier(clients)

    def client(_):
        outcomes = []
        with grpcclient.InferenceServerClient(server.grpc_url) as c:
            for _ in range(rounds):
                gate.wait()  # every round is a burst of 16 requests at once
                try:
                    result = c.infer(model, [image_input([image])], client_timeout=120)
                    outcomes.append(result.as_numpy("CLASS_IDS").shape[0] == 1)
                except InferenceServerException as exc:
                    outcomes.append(exc.message())
        return outcomes

    with ThreadPoolExecutor(clients) as pool:
        outcomes = [o for client_outcomes in pool.map(client, range(clients)) for o in client_outcomes]
    failures = [o for o in outcomes if o is not True]
    assert len(outcomes) == clients * rounds and failures == [], failures


@local_server_only
def test_load_holds_with_no_errors_and_no_leak(server, reference):
    images = [make_image(100 + i, size=(160, 120)) for i in range(4)]
    expected = reference(images)[1][:, 0].tolist()

    def run_clients(rounds):
        def client(i):
            with grpcclient.InferenceServerClient(server.grpc_url) as c:
                answers = []
                for n in range(rounds):
                    result = c.infer("pipeline", [image_input([images[(i + n) % 4]])], client_timeout=120)
                    answers.append(int(result.as_numpy("CLASS_IDS")[0, 0]) == expected[(i + n) % 4])
                return answers

        with ThreadPoolExecutor(CLIENTS) as pool:
            return [ok for answers in pool.map(client, range(CLIENTS)) for ok in answers]

    assert all(run_clients(3))  # warm up: shared-memory regions and allocator pools reach their working size
    pids = processes(server)
    rss_before, shm_before = rss_mib(pids), shm_regions(server)
    started = time.monotonic()
    answers = run_clients(REQUESTS_PER_CLIENT)
    elapsed = time.monotonic() - started
    rss_after, shm_after = rss_mib(pids), shm_regions(server)
    print(
        f"\nload: {CLIENTS} clients x {REQUESTS_PER_CLIENT} requests = {len(answers)} in {elapsed:.1f} s "
        f"({len(answers) / elapsed:.1f}/s), errors 0; RSS of server + {len(pids) - 1} stubs "
        f"{rss_before:.0f} -> {rss_after:.0f} MiB; /dev/shm {sum(shm_before.values()) >> 20} -> "
        f"{sum(shm_after.values()) >> 20} MiB in {len(shm_after)} regions"
    )
    assert len(answers) == CLIENTS * REQUESTS_PER_CLIENT and all(answers)
    assert shm_after.keys() == shm_before.keys(), "no region appears or disappears under steady load"
    assert sum(shm_after.values()) <= sum(shm_before.values()) + 64 * (1 << 20)
    assert rss_after - rss_before < 256, "RSS stays within 256 MiB of its warmed-up size"


# ---------------------------------------------------------------- a server of its own for destructive tests


def start_server(model_repository: Path, workdir: Path, counts: dict[str, int] | None = None):
    """A server of its own on its own copy of the repository (hot reload writes into it), with these instance
    counts where given."""
    repo = workdir / "model_repository"
    shutil.copytree(model_repository, repo, copy_function=os.link)  # hard links: the 100 MB weights are shared
    rewritten = [*repo.glob("*/1/model.py"), *(repo / model / "config.pbtxt" for model in counts or {})]
    for path in rewritten:  # files written to must be real copies
        path.unlink()
        shutil.copy(model_repository / path.relative_to(repo), path)
    set_instance_counts(repo, counts or {})
    settings = ServerSettings.on_free_ports(repo)
    triton = TritonServer(settings, container=False, log=open(workdir / "tritonserver.log", "w")).start()
    triton.wait_ready(600)
    return triton


@pytest.fixture(scope="module")
def own_server(model_repository, tmp_path_factory):
    triton = start_server(model_repository, tmp_path_factory.mktemp("own"))
    yield triton
    triton.stop()


@local_server_only
def test_admin_apis_need_the_key(own_server):
    with grpcclient.InferenceServerClient(own_server.grpc_url) as client:
        for call in (lambda **h: client.load_model("postprocess", **h), client.get_inference_statistics):
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
        client.load_model("postprocess", headers=own_server.settings.admin_headers)
        assert client.get_inference_statistics(headers=own_server.settings.admin_headers)
        assert client.is_server_ready() and client.is_model_ready("pipeline")  # health and inference stay open


@local_server_only
def test_overload_is_rejected_fast_instead_of_queued_forever(own_server, max_batch):
    """A burst larger than the pipeline's instances and its queue of 2: the rest is rejected at once. The burst is
    three times what the pipeline can hold, and on a GPU each request carries 16 images: an H200 at the shipped
    counts (16 pipeline instances) served 23 of a burst of 24 requests of 4 images as they came (dc19052), and then
    all 24 (5d413e1). Meanwhile a readiness probe, at the pipeline's higher priority, is answered."""
    holds = configured_counts(own_server)["pipeline"] + 2
    burst, images = max(24, 3 * holds), min(16 if own_server.settings.gpus else 4, max_batch)
    image, gate = make_image(5, size=(640, 480)), threading.Barrier(burst + 1)  # and the probe

    def send(_):
        gate.wait()
        started = time.monotonic()
        try:
            infer(own_server.grpc_url, [image_input([image] * images)])
            return "ok", time.monotonic() - started
        except InferenceServerException as exc:
            return exc.message(), time.monotonic() - started

    def probe_during_the_burst():
        gate.wait()
        time.sleep(0.05)  # the queue has filled
        return probe(own_server.grpc_url)

    with pipeline_queue_policy(own_server, max_queue_size="2"), ThreadPoolExecutor(burst + 1) as pool:
        probed = pool.submit(probe_during_the_burst)
        outcomes = list(pool.map(send, range(burst)))
        probe_error = probed.result()
    assert probe_error is None, f"the readiness probe goes ahead of the full queue (its priority): {probe_error}"
    rejected = [t for outcome, t in outcomes if "Exceeds maximum queue size" in outcome]
    served = [t for outcome, t in outcomes if outcome == "ok"]
    assert len(served) + len(rejected) == burst, outcomes
    assert served and rejected
    print(
        f"\noverload: burst of {burst} x {images} images, {len(served)} served (max {max(served):.2f} s), "
        f"{len(rejected)} rejected "
        f"(median {sorted(rejected)[len(rejected) // 2] * 1000:.0f} ms)"
    )
    assert max(rejected) < max(served), "a rejection comes back before the queue would have served it"


@local_server_only
def test_a_stage_rejecting_for_overload_reaches_the_pipelines_client_as_unavailable(model_repository, tmp_path):
    """Triton 2.51 gives every BLS response's error the code INTERNAL. A stage that rejects the pipeline's call for
    overload (its queue full) must still reach the client as UNAVAILABLE, as the ensemble's answer does, so that
    gRPC retry policies and load balancers retry it: four pipeline instances call one preprocess instance whose
    queue holds one request."""
    triton = start_server(model_repository, tmp_path, counts={"pipeline": 4, "preprocess": 1})
    image, burst = make_image(6, size=(640, 480)), 24
    gate = threading.Barrier(burst)

    def send(_):
        gate.wait()
        try:
            infer(triton.grpc_url, [image_input([image] * 4)])
            return "ok", "ok"
        except InferenceServerException as exc:
            return exc.status(), exc.message()

    try:
        with grpcclient.InferenceServerClient(triton.grpc_url) as client:
            config = client.get_model_config("preprocess", as_json=True)["config"]
            config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] = "1"
            client.load_model("preprocess", config=json.dumps(config), headers=triton.settings.admin_headers)
        wait_for_configured_stubs(triton, 120)
        with ThreadPoolExecutor(burst) as pool:
            outcomes = list(pool.map(send, range(burst)))
    finally:
        triton.stop()
    rejected = [(status, message) for status, message in outcomes if status != "ok"]
    print(f"\nstage overload: {burst - len(rejected)} served, {len(rejected)} rejected: {rejected[:2]}")
    assert rejected and burst - len(rejected) > 0, outcomes
    assert all(
        status == "StatusCode.UNAVAILABLE" and message.startswith("preprocess: ") and "Exceeds maximum queue" in message
        for status, message in rejected
    ), rejected


def resnet_waits_for_a_full_batch(server: TritonServer, delay_s: float):
    """resnet reloaded to hold every request up to `delay_s` in its queue for a full batch, for the while: a wait
    at that stage as long as that, whatever the machine."""

    def hold(config: dict) -> None:
        config["dynamic_batching"]["max_queue_delay_microseconds"] = str(int(delay_s * 1e6))
        config["dynamic_batching"]["preferred_batch_size"] = [config["max_batch_size"]]

    return config_changed(server, "resnet", hold)


@local_server_only
def test_a_requests_deadline_reaches_the_stage_it_waits_at(own_server, max_batch):
    """A request's timeout (the client's `timeout`, microseconds) goes with each BLS call the pipeline makes for it:
    held at resnet (which waits up to 5 s for a full batch here), a request with 1 s is answered UNAVAILABLE naming
    the stage, instead of being served once the wait is over to a client that has gone."""
    if max_batch == 1:
        pytest.skip("a batch of one is full at once: resnet holds nothing back")
    with resnet_waits_for_a_full_batch(own_server, 5), grpcclient.InferenceServerClient(own_server.grpc_url) as c:
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as info:
            c.infer("pipeline", [image_input([make_image(0)])], timeout=1_000_000, client_timeout=120)
        waited = time.monotonic() - started
    message = info.value.message()
    print(f"\na request with 1 s, held at resnet for a batch: answered after {waited:.1f} s: {message}")
    assert info.value.status() == "StatusCode.UNAVAILABLE", message
    assert message.startswith("resnet: ") and "timeout" in message.lower(), message


@local_server_only
def test_a_request_its_client_cancels_goes_to_no_further_stage(own_server, max_batch):
    """A request whose client cancels it while resnet holds it (5 s for a full batch) is not served on: the pipeline
    answers it CANCELLED before postprocess and counts it, and postprocess never sees it. (2.51 cannot stop the
    resnet call in flight: the check comes before the next stage.)"""
    if max_batch == 1:
        pytest.skip("a batch of one is full at once: resnet holds nothing back")
    cancelled, served = ("cancelled_requests", "pipeline"), ("nv_inference_request_success", "postprocess")
    with resnet_waits_for_a_full_batch(own_server, 5), grpcclient.InferenceServerClient(own_server.grpc_url) as c:
        before = metrics(own_server)
        answers = []
        call = c.async_infer("pipeline", [image_input([make_image(0)])], lambda **answer: answers.append(answer))
        time.sleep(1)  # in the pipeline's BLS call to resnet by now
        call.cancel()
        deadline = time.monotonic() + 30
        while metrics(own_server).get(cancelled, 0) == before.get(cancelled, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)  # had postprocess been called, it would have answered by now
        after = metrics(own_server)
    print(f"\nthe client saw {answers[0]['error'] if answers else 'nothing'}")
    assert answers and answers[0]["error"] is not None and "CANCELLED" in str(answers[0]["error"].status()), answers
    assert after.get(cancelled, 0) == before.get(cancelled, 0) + 1, (before, after)
    assert after.get(served, 0) == before.get(served, 0), "postprocess served a cancelled request"


@local_server_only
def test_a_request_past_its_deadline_while_a_stage_works_goes_to_no_further_stage(server, max_batch):
    """A request whose deadline (its client's timeout) passes while a stage works on it is answered UNAVAILABLE
    before the next stage, counted, and never reaches it: 2.51 checks a timeout only while a request waits in a
    queue, so without the pipeline's own check it would be served on, late, to a client that has gone. Here the
    stage is preprocess decoding large PNGs on the host, and the timeout half of what that takes."""
    png = io.BytesIO()
    Image.new("RGB", (6000, 4000), (90, 120, 150)).save(png, format="PNG")  # small on the wire, 24 M pixels to decode
    images = image_input([png.getvalue()] * min(4, max_batch))
    expired, reached = ("expired_requests", "pipeline"), ("nv_inference_request_success", "resnet")
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        started = time.monotonic()
        client.infer("preprocess", [images], client_timeout=120)
        took = time.monotonic() - started
        if took < 0.2:
            pytest.skip(f"preprocess decoded the PNGs in {took:.2f} s: too fast to time out within")
        before = metrics(server)
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as info:
            client.infer("pipeline", [images], timeout=int(took / 2 * 1e6), client_timeout=120)
        answered = time.monotonic() - started
        after = metrics(server)
    message = info.value.message()
    print(f"\npreprocess alone: {took:.2f} s; with a timeout of {took / 2:.2f} s, answered after {answered:.2f} s:")
    print(message)
    assert info.value.status() == "StatusCode.UNAVAILABLE", message
    assert "Request timeout expired" in message and "before resnet" in message, message
    assert after.get(expired, 0) == before.get(expired, 0) + 1, (before, after)
    assert after.get(reached, 0) == before.get(reached, 0), "resnet served a request past its deadline"


@local_server_only
def test_hot_reload_of_the_pipeline_under_load_loses_no_request(own_server):
    """docs/customizing.md, recipe 4: a new pipeline version beside the running one, loaded with the admin key."""
    repo = own_server.settings.model_repository
    new_version = repo / "pipeline" / "2"
    new_version.mkdir()
    source = (repo / "pipeline" / "1" / "model.py").read_text()
    (new_version / "model.py").write_text(source.replace('"""The BLS entry point', '"""Version 2. The BLS entry point'))
    image, stop, outcomes = make_image(7), threading.Event(), []

    def client():
        with grpcclient.InferenceServerClient(own_server.grpc_url) as c:
            deadline = time.monotonic() + 300
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    result = c.infer("pipeline", [image_input([image])], client_timeout=120)
                    outcomes.append(result.get_response().model_version)
                except InferenceServerException as exc:
                    outcomes.append(f"error: {exc.message()}")

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        wait_for_configured_stubs(own_server, 120)  # no replaced version still unloading (reload_model)
        with grpcclient.InferenceServerClient(own_server.grpc_url) as c:
            c.load_model("pipeline", headers=own_server.settings.admin_headers)  # picks up version 2
        deadline = time.monotonic() + 120
        while outcomes.count("2") < 20 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join()
    errors = [o for o in outcomes if o.startswith("error")]
    print(
        f"\nhot reload: {outcomes.count('1')} answered by version 1, {outcomes.count('2')} by version 2, "
        f"{len(errors)} failed"
    )
    assert errors == [] and outcomes.count("1") > 0 and outcomes.count("2") >= 20


@local_server_only
def test_stop_finishes_in_flight_requests_and_leaves_nothing_behind(model_repository, max_batch, tmp_path):
    """What SIGTERM or Ctrl-C to `serve` (and `docker compose stop`) does: TritonServer.stop(). Four pipeline
    instances at least, so that 2.51's teardown (a second per instance) outlasts TEARDOWN_GRACE_S here too."""
    pipelines = max(4, load_config(model_repository / "pipeline").instance_group[0].count)
    triton = start_server(model_repository, tmp_path, {"pipeline": pipelines})
    images = [make_image(200 + i, size=(640, 480)) for i in range(min(4, max_batch))]
    assert processes(triton) and shm_regions(triton)
    done = []

    def send(_):
        result = infer(triton.grpc_url, [image_input(images)])
        done.append(time.monotonic())
        return result

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(send, i) for i in range(6)]
        time.sleep(1)  # all six sent: queued or executing
        stopping = time.monotonic()
        returncode = triton.stop()
        stopped = time.monotonic() - stopping
        results = [f.result() for f in futures]
    print(f"\nstop: {sum(t > stopping for t in done)} of 6 requests were still in flight and finished; {stopped:.1f} s")
    print((tmp_path / "tritonserver.log").read_text().splitlines()[-1])  # "drained; ended the teardown ..."
    assert all(r.as_numpy("CLASS_IDS").shape[0] == len(images) for r in results)
    assert returncode == 0
    # Well inside the exit timeout: no stub hangs (2.51 tears instances down a second each, one after another).
    assert stopped < triton.settings.exit_timeout_s / 2
    assert processes(triton) == {}, "no stub outlives the server"
    assert shm_regions(triton) == {}, "no /dev/shm region outlives the server"


def test_a_bls_call_waiting_on_a_model_is_given_up_once_a_death_of_its_stub_is_recorded(tmp_path, monkeypatch):
    """stub_deaths.given_up, as a BLS model's guard asks it of a call that still waits (what a GPU server does with
    a request a dead stub held): a death of the called model recorded since the call began gives it up, naming
    the model; a death recorded before it began, or of another model, does not; without a record the deadline
    does."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    server = os.getpid()
    stub_deaths.record(server, "preprocess")  # an earlier death
    time.sleep(0.05)
    started = time.time()
    assert stub_deaths.given_up("preprocess", started, 5, server_pid=server) is None
    assert stub_deaths.given_up("resnet", started, None, server_pid=server) is None
    time.sleep(0.05)
    stub_deaths.record(server, "resnet")
    assert stub_deaths.given_up("resnet", started, None, server_pid=server).startswith("resnet: a stub of resnet died")
    assert stub_deaths.given_up("preprocess", started, 5, server_pid=server) is None
    message = stub_deaths.given_up("postprocess", started - 2, 1, server_pid=server)  # began 2 s ago
    assert message.startswith("postprocess: no answer in 1 s"), message
    stub_deaths.forget(server)
    assert not stub_deaths.folder(server).exists()


HANG = b"HANG"  # an image the hanging preprocess below never answers


@local_server_only
def test_a_call_that_never_returns_is_answered_by_the_guard_and_the_server_lives_on(model_repository, tmp_path):
    """python_backend.Guard, against a real server: a preprocess that never answers one image (as a GPU server
    never answers a call a dead stub held). The request is answered UNAVAILABLE, naming preprocess, within a poll
    of the recorded death, and by the call's deadline without one; other requests are served meanwhile. Then
    the stuck pipeline stubs, whose requests were answered already, are killed and the pipeline reloaded, as the
    watchdog does: the server lives on and serves."""
    repo = tmp_path / "model_repository"
    shutil.copytree(model_repository, repo, copy_function=os.link, ignore=shutil.ignore_patterns("__pycache__"))
    for path in (repo / "preprocess/1/model.py", *(repo / m / "config.pbtxt" for m in ("preprocess", "pipeline"))):
        # written to: real copies, not links to the shared repository's files
        path.unlink()
        shutil.copy(model_repository / path.relative_to(repo), path)
    model = repo / "preprocess/1/model.py"
    model.write_text(
        model.read_text().replace(
            "    def execute(self, requests):\n",
            "    def execute(self, requests):\n"
            "        import time\n\n"
            "        if any(pb_utils.get_input_tensor_by_name(r, 'IMAGE').as_numpy().reshape(-1)[0].startswith(b'HANG')"
            " for r in requests):\n"
            "            time.sleep(3600)\n",
        )
    )
    set_parameter(repo, "pipeline", "bls_timeout_us", "1000000")  # a call's deadline: 1 s + 5 s
    set_instance_counts(repo, {"pipeline": 3, "preprocess": 3})
    triton = TritonServer(ServerSettings.on_free_ports(repo), container=False, log=open(tmp_path / "log", "w")).start()
    try:
        triton.wait_ready(600)
        url = triton.grpc_url

        def hung(record_after_s=None):
            started = time.monotonic()
            if record_after_s is not None:
                threading.Timer(record_after_s, stub_deaths.record, (triton.process.pid, "preprocess")).start()
            with pytest.raises(InferenceServerException) as caught:
                infer(url, [image_input([HANG])])
            return caught.value, time.monotonic() - started

        error, took = hung(record_after_s=1)
        assert error.status() == "StatusCode.UNAVAILABLE" and "a stub of preprocess died" in error.message(), error
        assert 1 <= took < 1 + stub_deaths.POLL_S + 1, took
        assert outputs_of(infer(url, [image_input([make_image(5)])])), "served beside the stuck call"
        error, took = hung()
        assert error.status() == "StatusCode.UNAVAILABLE" and "preprocess: no answer in 6 s" in error.message()
        assert 6 <= took < 6 + stub_deaths.POLL_S + 1.5, took
        # Two pipeline instances are stuck in a call for good now, as after a stub death on a GPU: the watchdog's
        # reload of the pipeline, then its end of what outlives it. Their requests were answered: nothing is lost.
        old = {model: stub_pids(triton, model) for model in ("preprocess", "pipeline")}
        with grpcclient.InferenceServerClient(url) as client:
            for model in ("preprocess", "pipeline"):  # the hanging stage, then its caller
                restart(client, model, triton.settings.admin_headers)
        for pid in old["preprocess"] + old["pipeline"]:  # what outlives the reload
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for image in range(3):
            assert outputs_of(infer(url, [image_input([make_image(image)])]))
        assert triton.process.poll() is None, "the server lives on"
    finally:
        triton.stop()


def outputs_of(result) -> bool:
    return result.as_numpy("CLASS_IDS").shape[0] == 1


@local_server_only
def test_dead_stubs_fail_their_requests_and_the_watchdog_heals_each_model(model_repository, tmp_path):
    """Triton 2.51 keeps reporting ready with a dead stub. `serve`'s watchdog (run here as serve runs it) sees the
    dead process within a second and reloads its model, then the BLS models calling it: served again within 30 s
    of the kill, once the model itself is reloaded. On a CPU a request caught by the dead stub fails within 2 s
    naming its model; on a GPU the server waits for that stub for good, and the pipeline gives such a call up once
    the watchdog has recorded the death, naming the stage."""
    own_server = start_server(model_repository, tmp_path)
    url, logs, server_log = own_server.grpc_url, [], tmp_path / "tritonserver.log"
    watchdog = StubWatchdog(url, own_server.settings.admin_headers, server_pid=own_server.process.pid, log=logs.append)
    health = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", "health", "--url", url]
    on_gpu = bool(own_server.settings.gpus)
    image = make_image(9)

    def request(_):
        started = time.monotonic()
        try:
            infer(url, [image_input([image])])
            return "ok", time.monotonic() - started
        except InferenceServerException as exc:
            return exc.message(), time.monotonic() - started

    reloads = collections.Counter()  # each model's reloads, as the watchdog logged them
    watchdog.start()
    try:
        for model in ("resnet", "preprocess", "pipeline"):
            logs.clear()
            log_start = server_log.stat().st_size
            # a stub of the version serving now: the last reload's old stubs may still be on their way out
            os.kill(min(set(stub_pids(own_server, model)) - set(watchdog.replaced.copy())), signal.SIGKILL)
            killed, killed_at = time.monotonic(), time.time()
            with ThreadPoolExecutor(4) as pool:
                caught = [pool.submit(request, i) for i in range(4)]  # sent at once, answered while we probe
                # healed: the watchdog's reload is done (until then the old stubs beside the dead one still serve
                # some requests) and the pipeline answers
                reloaded = re.compile(rf"watchdog: reloaded (\w+, )*{model}\b")
                while time.monotonic() - killed < 90 and not (
                    any(reloaded.match(line) for line in logs) and probe(url, timeout_s=10) is None
                ):
                    time.sleep(0.5)
                healed = time.monotonic() - killed
                outcomes = [f.result() for f in caught]
            # the callers' reload follows the model's: done before the next kill (the watchdog does one at a time)
            callers = re.compile(rf"watchdog: reloaded {', '.join(bls_callers([model]))} \(calling")
            while bls_callers([model]) and not any(map(callers.match, logs)) and time.monotonic() - killed < 150:
                time.sleep(0.5)
            for line in logs:
                if done := re.match(r"watchdog: reloaded ((?:\w+, )*\w+)", line):
                    reloads.update(done[1].split(", "))
            print(f"\n{model} stub killed: {[(o[:90], round(t, 1)) for o, t in outcomes]}")
            print(f"{model}: served again {healed:.1f} s after the kill; {logs}")
            with server_log.open() as log:  # where the reload's time went: the loads, as the server logged them
                log.seek(log_start)
                print("".join(line for line in log if re.search(r"(?i)load|autotuned", line))[-4000:])
            # the watchdog recorded the death, for the BLS calls that wait on the dead stub
            assert stub_deaths.died_since(model, killed_at, own_server.process.pid), logs
            for outcome, took in outcomes:
                assert outcome == "ok" or model in outcome, outcome
                # a CPU server fails what the dead stub held itself; on a GPU the pipeline's call gives up once the
                # watchdog has recorded the death (about 2 s after it, then up to stub_deaths.POLL_S)
                assert outcome == "ok" or took < (6 if on_gpu else 3), (outcome, took)
            assert any(f"the stub of {model!r}" in line for line in logs), logs
            # served again once the model itself is reloaded, not waiting for its callers' reload (on an H200 under
            # MPS resnet's reload beside the pipeline's took 32 s)
            assert healed <= 30
            assert subprocess.run(health, capture_output=True, timeout=120).returncode == 0
        # No stub of a replaced version is left: each is a CUDA context and an MPS client on a GPU. The server
        # unloads those versions on a CPU; on a GPU the watchdog ends what outlives its reload by the grace.
        wait_for_configured_stubs(own_server, REPLACED_GRACE_S + 30, poll_s=1)
        print(f"stubs per model at the end: {stub_counts(own_server)}; {[line for line in logs if 'ended' in line]}")
        assert stub_counts(own_server) == configured_counts(own_server)
        # each Python model publishes how often the watchdog reloaded it, its series outliving the replaced stubs
        published = {model: n for (name, model), n in metrics(own_server).items() if name == "watchdog_reloads"}
        print(f"watchdog reloads: logged {dict(reloads)}, published {published}")
        assert published == {model: float(reloads[model]) for model in python_models(model_repository)}
    finally:
        watchdog.stop()
        started = time.monotonic()
        own_server.stop()
        print(f"stop after three stub crashes took {time.monotonic() - started:.1f} s")
    assert processes(own_server) == {} and shm_regions(own_server) == {}


BUSY_THEN_IDLE = """
import sys, time
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:  # a batch at work
    pass
print("idle", flush=True)
time.sleep(60)  # between batches: waiting, as a stub waits on its queue
"""


def test_replaced_stubs_are_ended_once_idle_before_the_callers_reload():
    """Before the watchdog reloads the BLS callers of a model, it ends that model's replaced stubs, each once it is
    idle (health.StubWatchdog.end_replaced_once_idle): so a reload needs room for one model's new stubs at a time
    (rules.reload_headroom). Two processes stand in for the replaced stubs: one idle from the start is ended
    within a second; one at work for 2 s is ended only after it stops, and not long after."""
    watchdog = StubWatchdog("localhost:1", {}, server_pid=None, log=lambda line: None)
    children = {
        seconds: subprocess.Popen(
            [sys.executable, "-c", BUSY_THEN_IDLE, str(seconds)], stdout=subprocess.PIPE, text=True
        )
        for seconds in (0, 2)
    }
    try:
        for child in children.values():
            assert child.stdout.readline() == "ready\n"
            watchdog.models[child.pid] = "preprocess"
            watchdog.replaced[child.pid] = time.monotonic()
        started = time.monotonic()
        ended = watchdog.end_replaced_once_idle(["preprocess"])
        took = time.monotonic() - started
        assert sorted(ended) == sorted(c.pid for c in children.values())
        assert all(child.wait(timeout=10) == -signal.SIGKILL for child in children.values())
        assert children[2].stdout.readline() == "idle\n", "ended while at work"
        assert 2 - IDLE_S <= took < 2 + 4 * IDLE_S, took
        assert watchdog.replaced == {}
        # a model that makes BLS calls waits idle on their answers: its replaced stubs get the whole grace
        waiting = subprocess.Popen([sys.executable, "-c", BUSY_THEN_IDLE, "0"], stdout=subprocess.PIPE, text=True)
        children["caller"] = waiting
        assert waiting.stdout.readline() == "ready\n"
        watchdog.models[waiting.pid], watchdog.replaced[waiting.pid] = "pipeline", time.monotonic()
        watchdog.replaced_grace_s = 2
        started = time.monotonic()
        assert watchdog.end_replaced_once_idle(["pipeline"]) == [waiting.pid]
        assert time.monotonic() - started >= 2
    finally:
        for child in children.values():
            child.kill()
            child.wait()


@local_server_only
def test_the_watchdog_ends_the_stubs_of_a_replaced_version_that_outlive_it(own_server):
    """On a GPU 2.51 does not finish unloading every version a watchdog reload replaces (measured on an H200: 5 of
    16 old pipeline stubs and the old resnet stub beside the dead one lived on for minutes), and each stub left is
    a CUDA context and an MPS client that crowds out the next reload's stubs. Here an old pipeline still busy
    after a short grace stands in for those: the watchdog ends its stubs and does not take that for a crash, every
    request ends (an answer, an error naming the pipeline once its stub is gone, or a queue's timeout), and the
    server serves on with the stubs its configuration asks for.

    On a CPU the old pipeline is sure to outlive the grace: one request of 4 images of 23.5 MP (under the decode
    budget, so decoded in full) takes it seconds to decode, and 24 of them wait in a queue whose timeout this test
    raises to 120 s for the while. (With the 10 s default, in CI the queue timed out while a 2-core reload took 9.4
    s, and the old stubs unloaded in the second before the watchdog's first scan; a request's own timeout cannot
    raise its model's. Stopping the old stubs with SIGSTOP instead crashed 2.51's server: a stub frozen holding a
    shared-memory lock, a boost::interprocess::lock_exception.) On a GPU the old pipeline decodes in milliseconds:
    no stub of it may be left, and whether the watchdog ended it or it unloaded by itself is a race there, so either
    passes."""
    url, logs = own_server.grpc_url, []
    watchdog = StubWatchdog(
        url, own_server.settings.admin_headers, server_pid=own_server.process.pid, log=logs.append,
        replaced_grace_s=1,
    )  # fmt: skip
    buffer = io.BytesIO()
    Image.new("RGB", (5600, 4200), (90, 140, 200)).save(buffer, format="JPEG", quality=50)
    large = buffer.getvalue()

    def request(_):
        try:
            infer(url, [image_input([large] * 4)])
            return "ok"
        except InferenceServerException as exc:
            return exc.message()

    with pipeline_queue_policy(own_server, default_timeout_microseconds="120000000"):
        old = set(stub_pids(own_server, "pipeline"))
        with ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(request, i) for i in range(24)]
            time.sleep(1)  # all in the old pipeline: executing or queued
            try:
                watchdog.reload(["pipeline"], "is replaced (this test reloads it)")  # as the watchdog's thread does
                outlived = bool(old & set(stub_pids(own_server, "pipeline")))  # still busy: it stays past the grace
                watchdog.start()
                deadline = time.monotonic() + watchdog.replaced_grace_s + 20
                while old & set(stub_pids(own_server, "pipeline")) and time.monotonic() < deadline:
                    time.sleep(0.5)
                outcomes = [f.result(timeout=120) for f in futures]
                time.sleep(3)  # the watchdog's scans after those deaths: none may count as a crash
            finally:
                watchdog.stop()
        seen = sorted(set(o[:100] for o in outcomes))
        print(f"\nold pipeline outlived the reload: {outlived}; outcomes {seen}; {logs}")
        assert not old & set(stub_pids(own_server, "pipeline")), "a stub of the replaced version is left"
        if not own_server.settings.gpus:
            assert outlived, "on a CPU the old pipeline is still decoding after the reload"
            assert any("stubs of replaced versions of pipeline" in line for line in logs), logs
        # each ended: answered, failed naming the pipeline (its stub was ended), or rejected by a queue's timeout
        assert all(o == "ok" or "pipeline" in o or o == "Request timeout expired" for o in outcomes), outcomes
        assert not any("exited" in line or "not healthy" in line for line in logs), logs
        assert stub_counts(own_server) == configured_counts(own_server)
        for model in ("pipeline", "ensemble"):
            if (Path(own_server.settings.model_repository) / model).is_dir():  # a bake may leave the ensemble out
                assert served_once_drained(url, model) is None, model


def served_once_drained(url: str, model: str, limit_s: float = 300) -> str | None:
    """`probe(url, model)`, again while it fails only because a queue still holds this test's own large images (the
    ended pipeline's BLS calls stay queued at preprocess; a 2-core runner decodes them for minutes): the condition
    this waits for is that queue drained, not a time. Any other error is returned at once."""
    deadline = time.monotonic() + limit_s
    while (error := probe(url, model)) is not None and "timeout expired" in error and time.monotonic() < deadline:
        time.sleep(1)
    return error


ROBUST_MUTEX_HOLDER = """
import ctypes, mmap, sys, time
libc = ctypes.CDLL(None)
with open(sys.argv[1], "r+b") as file:
    shared = mmap.mmap(file.fileno(), 64)
mutex = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(shared)))
attr = ctypes.create_string_buffer(64)
libc.pthread_mutexattr_init(attr)
libc.pthread_mutexattr_setrobust(attr, 1)  # PTHREAD_MUTEX_ROBUST, as boost.interprocess makes every mutex
libc.pthread_mutexattr_setpshared(attr, 1)  # PTHREAD_PROCESS_SHARED: the test reads its state after the kill
libc.pthread_mutex_init(mutex, attr)
print("ready", flush=True)
seconds = float(sys.stdin.readline())
libc.pthread_mutex_lock(mutex)
print("locked", flush=True)
time.sleep(seconds)
libc.pthread_mutex_unlock(mutex)
time.sleep(60)
"""
EOWNERDEAD = 130  # Linux: pthread_mutex_trylock on a robust mutex whose owner died holding it


@pytest.mark.skipif(GET_ROBUST_LIST is None, reason="get_robust_list's syscall number is known for x86_64 and aarch64")
def test_a_stub_is_killed_only_while_it_holds_no_robust_mutex(tmp_path):
    """What the watchdog's kill of a replaced stub waits for (health.kill_outside_locks): a process that dies
    holding a robust mutex in python_backend's shared memory makes 2.51's server abort at its next lock. A process
    that takes a robust mutex in a shared file, holds it for 1.5 s and lets go stands in for a stub: stopped, it
    reads as holding nothing, then as holding the lock. After the kill the mutex itself says whether its owner died
    holding it (trylock's EOWNERDEAD) or had let go (trylock takes it)."""
    import ctypes
    import mmap

    shared_file = tmp_path / "mutex"
    shared_file.write_bytes(bytes(64))
    child = subprocess.Popen(
        [sys.executable, "-c", ROBUST_MUTEX_HOLDER, str(shared_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "ready\n"

        def held_while_stopped():
            os.kill(child.pid, signal.SIGSTOP)
            try:
                time.sleep(0.2)
                return holds_robust_lock(child.pid)
            finally:
                os.kill(child.pid, signal.SIGCONT)

        assert held_while_stopped() is False
        child.stdin.write("1.5\n")
        child.stdin.flush()
        assert child.stdout.readline() == "locked\n"
        assert held_while_stopped() is True
        started = time.monotonic()
        assert kill_outside_locks(child.pid, attempts=500) is True
        waited = time.monotonic() - started
        assert child.wait(timeout=10) == -signal.SIGKILL
        with shared_file.open("r+b") as file:
            shared = mmap.mmap(file.fileno(), 64)
        mutex = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(shared)))
        libc = ctypes.CDLL(None)
        taken = libc.pthread_mutex_trylock(mutex)
        assert taken != EOWNERDEAD, "killed while it held the mutex"
        assert taken == 0, f"pthread_mutex_trylock returned {taken}"
        libc.pthread_mutex_unlock(mutex)
        print(f"killed {waited:.2f} s after the first attempt, once the mutex was released")
    finally:
        child.kill()
        child.wait()


@local_server_only
def test_reload_stress_short_form_aborts_nothing_and_loses_no_request(tmp_path):
    """benchmarks/reload_stress.py in short: 12 pipeline reloads (new version, same version, config change) under
    load, a pipeline stub SIGKILLed every third (twice in execute, twice in finalize), then a stop during a
    reload: the server never ends, every request is answered or fails with an error, and the stop leaves nothing.
    The long form (300 reloads) is `python -m benchmarks.reload_stress` (docs/deployment.md)."""
    argv = [sys.executable, "-m", "benchmarks.reload_stress", "--reloads", "12", "--kill-every", "3"]
    done = subprocess.run([*argv, "--out", str(tmp_path)], cwd=PROJECT, capture_output=True, text=True, timeout=900)
    print(done.stdout[-4000:], done.stderr[-2000:])
    summary = json.loads((tmp_path / "reload_stress.json").read_text())["summary"]
    assert summary["aborts"] == 0 and summary["lost"] == 0, summary
    assert summary["kills"] == {"execute": 2, "finalize": 2}, summary
    assert summary["answered"] > 0 and summary["left_after_stop"] == {"stubs": 0, "shm_regions": 0}, summary
    assert done.returncode == 0
