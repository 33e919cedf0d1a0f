"""Same-host clients over shared memory, against a real tritonserver: answers, region lifecycle, a full /dev/shm.

The region checks read both sides: the server's shared-memory status (an admin API) and /dev/shm itself.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from conftest import EXTERNAL_GRPC_URL, assert_same_answers, image_input, infer, local_server_only, make_image
from tritonclient.utils import InferenceServerException

from {{ cookiecutter.package_name }}.client import ADMIN_KEY_HEADER, AdminKeyError, ImageClassifier, SharedMemoryFull
from {{ cookiecutter.package_name }}.health import probe
from {{ cookiecutter.package_name }}.server import ServerSettings, TritonServer
from {{ cookiecutter.package_name }}.shm import REGION_PREFIX, MiB, dev_shm_bytes

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def admin_key(server) -> str:
    key = server.settings.admin_key if hasattr(server, "settings") else os.environ.get("TRITON_ADMIN_KEY")
    if not key:
        pytest.skip("set TRITON_ADMIN_KEY to the key of the server at TRITON_GRPC_URL")
    return key


def registered(url: str, admin_key: str) -> set[str]:
    """The names of every shared-memory region the server has registered, system and CUDA."""
    headers = {ADMIN_KEY_HEADER: admin_key}
    with grpcclient.InferenceServerClient(url) as client:
        system = client.get_system_shared_memory_status(headers=headers, as_json=True).get("regions", {})
        cuda = client.get_cuda_shared_memory_status(headers=headers, as_json=True).get("regions", {})
    return {*system, *cuda}  # {name: status}


def files(names) -> set[str]:
    return {name for name in names if (Path("/dev/shm") / name).exists()}


def client_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(REGION_PREFIX + "*")}


def same(a, b, repository: Path) -> None:
    """Two answers of the same server to the same images (conftest.assert_same_answers)."""

    def arrays(rows) -> dict:
        fields = {"SCORES": "score", "CLASS_IDS": "class_id", "LABELS": "label"}
        return {name: np.array([[getattr(p, field) for p in row] for row in rows]) for name, field in fields.items()}

    assert_same_answers(arrays(a), arrays(b), repository, atol=1e-4)


@pytest.mark.parametrize("n", [1, 16])
def test_system_shared_memory_answers_as_grpc_and_leaves_nothing(server, admin_key, max_batch, model_repository, n):
    images = [make_image(300 + i, size=(320 + 8 * i, 240)) for i in range(min(n, max_batch))]
    with ImageClassifier(server.grpc_url) as plain:
        expected = plain.classify(images)
    with ImageClassifier(server.grpc_url, shared_memory="system", admin_key=admin_key) as client:
        same(client.classify(images), expected, model_repository)
        same(client.classify(images[::-1])[::-1], expected, model_repository)  # the region is reused
        names = set(client.region_names)
        assert names and names <= registered(server.grpc_url, admin_key)
        if not EXTERNAL_GRPC_URL:
            assert files(names) == names
    assert not names & registered(server.grpc_url, admin_key), "close() unregisters"
    assert not files(names), "close() unlinks"


def test_the_region_grows_with_the_batch_and_is_reused(server, admin_key, max_batch):
    def sizes() -> dict[str, int]:
        with grpcclient.InferenceServerClient(server.grpc_url) as c:
            status = c.get_system_shared_memory_status(headers={ADMIN_KEY_HEADER: admin_key}, as_json=True)
        return {name: int(region["byte_size"]) for name, region in status.get("regions", {}).items()}

    with ImageClassifier(server.grpc_url, shared_memory="system", admin_key=admin_key) as client:
        client.classify([make_image(1, size=(64, 64))])
        (name,) = client.region_names
        small = sizes()[name]
        client.classify([make_image(2, size=(64, 64))])
        assert client.region_names == [name] and sizes()[name] == small, "reused"
        big = [make_image(3 + i, size=(2400, 1800), fmt="PNG") for i in range(min(4, max_batch))]
        assert sum(map(len, big)) > small
        client.classify(big)
        assert client.region_names == [name] and sizes()[name] >= sum(map(len, big)) > small, "grown"


def test_a_bad_request_fails_alone_and_the_client_releases_its_regions(server, admin_key):
    with ImageClassifier(server.grpc_url, shared_memory="system", admin_key=admin_key) as client:
        client.classify([make_image(4)])
        names = set(client.region_names)
        with pytest.raises(InferenceServerException, match="invalid input"):
            client.classify([b"not an image"])
        assert client.region_names == [] and not names & registered(server.grpc_url, admin_key)
        assert client.classify([make_image(4)])  # and it makes new ones
    assert not files(names)


def test_shared_memory_needs_the_admin_key(server, admin_key, monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_ADMIN_KEY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # and no key file `serve` keeps
    with pytest.raises(AdminKeyError, match="no admin key was found: pass admin_key=, set TRITON_ADMIN_KEY"):
        ImageClassifier(server.grpc_url, shared_memory="system")
    with pytest.raises(AdminKeyError, match="^admin key rejected: .* the key from admin_key="):
        ImageClassifier(server.grpc_url, shared_memory="system", admin_key="wrong")


@pytest.mark.parametrize("shared_memory", [None, "system"])
def test_classify_pixels_answers_as_the_pipeline(server, admin_key, reference, max_batch, shared_memory):
    """The pixel entry (resnet -> postprocess) on pixels preprocessed in-process as the server would."""
    images = [make_image(400 + i) for i in range(min(3, max_batch))]
    pixels = reference.preprocess(images)
    with ImageClassifier(server.grpc_url) as plain:
        expected = plain.classify(images)
    if shared_memory is None and pixels.dtype == torch.bfloat16:
        pytest.skip("BF16 pixels need shared memory (numpy has no bfloat16)")
    with ImageClassifier(server.grpc_url, shared_memory=shared_memory, admin_key=admin_key) as client:
        answer = client.classify_pixels(pixels)
    tol = 2e-2 if pixels.dtype != torch.float32 else 1e-3 if pixels.is_cuda else 1e-4  # cuDNN picks kernels per batch
    assert [row[0].class_id for row in answer] == [row[0].class_id for row in expected]
    scores = [[p.score for p in row] for row in answer]
    np.testing.assert_allclose(scores, [[p.score for p in row] for row in expected], atol=tol)


@local_server_only
def test_cli_classify_over_system_shared_memory(server, admin_key, tmp_path):
    image = tmp_path / "a.jpg"
    image.write_bytes(make_image(7))
    with ImageClassifier(server.grpc_url) as plain:
        best = plain.classify([image.read_bytes()])[0][0]
    argv = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", "classify", str(image), "--url", server.grpc_url]
    argv += ["--shared-memory", "system"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_ADMIN_KEY"} | {"XDG_CONFIG_HOME": str(tmp_path)}
    refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "TRITON_ADMIN_KEY" in refused.stderr
    done = subprocess.run(argv, env={**env, "TRITON_ADMIN_KEY": admin_key}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{best.class_id:4d}  {best.label}" in done.stdout


CLIENT = """
import os, signal, sys, time
from conftest import make_image
# Ctrl-C raises KeyboardInterrupt as in a terminal, even where this was started with SIGINT ignored (a script's
# background job: `cmd &` in a script, a CI runner)
signal.signal(signal.SIGINT, signal.default_int_handler)
from {{ cookiecutter.package_name }}.health import probe
from {{ cookiecutter.package_name }}.client import ImageClassifier

client = ImageClassifier(sys.argv[1], shared_memory="system", admin_key=os.environ["KEY"])
images = [make_image(i, size=(640, 480)) for i in range(int(sys.argv[2]))]
client.classify(images)  # the region has its size for these images now: the loop below reuses it
print(" ".join(client.region_names), flush=True)
if sys.argv[3] == "loop":
    while True:
        print("sending", flush=True)
        client.classify(images)
"""


def run_client(server, admin_key, n, mode, new_session=False) -> subprocess.Popen:
    """The client above in a child process; `new_session`: in a process group of its own, with its resource tracker
    (the process that would unlink its /dev/shm file once it dies)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CLIENT), server.grpc_url, str(n), mode],
        cwd=Path(__file__).parent,
        env={**os.environ, "KEY": admin_key, "PYTHONPATH": str(Path(__file__).parent)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )


@local_server_only
def test_a_client_that_exits_without_close_leaves_nothing(server, admin_key):
    process = run_client(server, admin_key, 1, "exit")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    names = set(out.split())
    assert names and not names & registered(server.grpc_url, admin_key) and not files(names)


@local_server_only
def test_a_client_interrupted_by_ctrl_c_mid_request_leaves_nothing(server, admin_key, max_batch):
    process = run_client(server, admin_key, min(16, max_batch), "loop")
    names = set(process.stdout.readline().split())
    assert names, process.stderr.read()
    assert process.stdout.readline().strip() == "sending"
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert "KeyboardInterrupt" in err
    assert not names & registered(server.grpc_url, admin_key) and not files(names)


@local_server_only
def test_a_client_killed_mid_request_is_cleaned_up_by_the_next_one(server, admin_key, max_batch):
    """SIGKILL runs no exit handler: the server keeps the dead client's registration (and, were it not for
    Python's resource tracker, /dev/shm its file) until the next shared-memory client, or `serve` stopping,
    removes the regions of processes that are gone."""
    process = run_client(server, admin_key, min(16, max_batch), "loop")
    names = set(process.stdout.readline().split())
    assert names, process.stderr.read()
    assert process.stdout.readline().strip() == "sending"
    time.sleep(0.3)  # the batch is being sent, or in the server
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    left = names & registered(server.grpc_url, admin_key)
    print(f"\nafter SIGKILL: registered {sorted(left)}, /dev/shm {sorted(files(names))}")
    assert left == names, "the server still maps the dead client's region"
    with ImageClassifier(server.grpc_url, shared_memory="system", admin_key=admin_key) as client:
        assert not names & registered(server.grpc_url, admin_key) and not files(names)
        assert client.classify([make_image(5)])
    assert not {n for n in client_files() if str(process.pid) in n}


@local_server_only
def test_a_killed_client_is_cleaned_up_by_the_watchdog_with_nobody_else_calling(server, admin_key, max_batch):
    """The client and its resource tracker are SIGKILLed mid-request (its process group): its registration and its
    /dev/shm file stay, and no other client comes. `serve`'s watchdog (StubWatchdog with the server's pid, as
    `serve` runs it; only its own loop here) unregisters the region and unlinks the file within 30 s."""
    from {{ cookiecutter.package_name }}.health import StubWatchdog

    process = run_client(server, admin_key, min(16, max_batch), "loop", new_session=True)
    names = set(process.stdout.readline().split())
    assert names, process.stderr.read()
    assert process.stdout.readline().strip() == "sending"
    time.sleep(0.3)  # the batch is being sent, or in the server
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)
    assert names <= registered(server.grpc_url, admin_key) and files(names) == names, "nothing else removed them"
    logs = []
    watchdog = StubWatchdog(
        server.grpc_url, server.settings.admin_headers, interval_s=3600, server_pid=server.process.pid, log=logs.append
    )
    started = time.monotonic()
    watchdog.start()
    try:
        while names & registered(server.grpc_url, admin_key) or files(names):
            assert time.monotonic() - started < 30, f"still there after 30 s; watchdog: {logs}"
            time.sleep(0.2)
    finally:
        watchdog.stop()
        watchdog.join(30)
    print(f"\nthe watchdog removed {sorted(names)} in {time.monotonic() - started:.1f} s: {logs}")
    assert any(name in line for line in logs for name in names), logs
    assert probe(server.grpc_url) is None, "the server serves as before"


def test_stopping_the_server_removes_the_files_of_dead_clients_only(tmp_path):
    """What TritonServer.stop() (and so `serve`) does after the server is gone: also when the dead client's
    resource tracker died with it and its /dev/shm file stayed."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    namespace = os.stat("/proc/self/ns/pid").st_ino
    dead = Path("/dev/shm") / f"{REGION_PREFIX}{namespace}_{gone.pid}_0badc0de_io"
    alive = Path("/dev/shm") / f"{REGION_PREFIX}{namespace}_{os.getpid()}_0badc0de_io"
    for path in (dead, alive):
        path.write_bytes(b"x")
    try:
        TritonServer(ServerSettings(tmp_path)).remove_shm_regions()
        assert not dead.exists() and alive.exists()
    finally:
        dead.unlink(missing_ok=True)
        alive.unlink(missing_ok=True)


# ---------------------------------------------------------------- a full /dev/shm, in a private tmpfs


def private_tmpfs_prefix(size: str) -> list[str] | None:
    """argv prefix that runs a command with its own /dev/shm of `size` (a tmpfs in a new mount namespace):
    root, or an unprivileged user namespace. None where the machine allows neither."""
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    for userns in ([], ["--map-root-user"]):
        prefix = ["unshare", "--mount", "--propagation", "private", *userns, "sh", "-c", script, "sh"]
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            return None
    return None


class SmallShmServer(TritonServer):
    def command(self):
        argv, env = super().command()
        return [*self.prefix, *argv], env


@pytest.fixture(scope="module")
def small_shm_server(model_repository, tmp_path_factory):
    """A server whose stubs' regions start at 1 MiB and grow by 1 MiB, in a /dev/shm of 16 MiB beyond those first
    MiBs (one per stub: 4 at the CPU tests' counts, 14 at the shipped GPU counts)."""
    stubs = sum(count for count, _ in dev_shm_bytes(model_repository).values())
    prefix = private_tmpfs_prefix(f"{16 + stubs}m")
    if prefix is None:
        pytest.skip("no private tmpfs here (needs root or unprivileged user namespaces)")
    settings = ServerSettings.on_free_ports(model_repository, shm_default_bytes=MiB, shm_growth_bytes=MiB)
    log = tmp_path_factory.mktemp("small_shm") / "tritonserver.log"
    triton = SmallShmServer(settings, container=False, log=open(log, "w"))
    triton.prefix = prefix
    triton.start()
    try:
        triton.wait_ready(600)
    except Exception:
        triton.stop()
        print(log.read_text()[-5000:])
        raise
    yield triton
    triton.stop()


@local_server_only
def test_a_full_dev_shm_fails_the_request_clearly_and_the_server_recovers(small_shm_server, max_batch):
    url = small_shm_server.grpc_url
    dev_shm = Path(f"/proc/{small_shm_server.process.pid}/root/dev/shm")  # the server's own /dev/shm
    # Encoded images live in the stubs' regions on either device (strings never go through the CUDA pool): PNGs
    # of more than a region's first MiB together, so that a region must grow, and cannot.
    count = min(3, max_batch)
    images = [make_image(500 + i, size=(1280, 960) if count == 3 else (2400, 1800), fmt="PNG") for i in range(count)]
    assert sum(map(len, images)) > MiB
    filler = dev_shm / "filler"
    with open(filler, "wb") as f:  # leave 256 KiB: the stubs' regions cannot grow
        os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(dev_shm).free - 256 * 1024)
    try:
        with ImageClassifier(url) as client, pytest.raises(SharedMemoryFull) as error:
            client.classify(images)
        print(f"\nfull /dev/shm: {error.value.message()[:600]}")
        assert "/dev/shm" in error.value.message() and "TRITON_SHM_SIZE" in error.value.message()
        with pytest.raises(InferenceServerException, match="shared memory"):  # any client: a per-request error
            infer(url, [image_input(images)])
        with grpcclient.InferenceServerClient(url) as client:
            assert small_shm_server.process.poll() is None and client.is_server_ready(), "the server stays up"
    finally:
        filler.unlink()
    with ImageClassifier(url) as client:
        answer = client.classify(images)
    assert len(answer) == len(images) and probe(url) is None, "served again once there is room"
    sizes = {p.name: p.stat().st_size // 1024 for p in dev_shm.iterdir()}
    print(f"regions after recovery (KiB): {sizes}")


@local_server_only
def test_the_sizing_rule_covers_what_the_stubs_grew_to(server, model_repository):
    """After the batches above, no Python-backend stub's /dev/shm region is larger than dev_shm_bytes() allows
    for the largest image this module sends."""
    largest = max(256 * 1024, len(make_image(3, size=(2400, 1800), fmt="PNG")))
    need = dev_shm_bytes(model_repository, gpus=len(server.settings.gpus), image_bytes=largest)
    regions = [p.stat().st_size for p in Path("/dev/shm").glob(server.settings.shm_prefix + "*")]
    rule = {model: (stubs, per_stub // MiB) for model, (stubs, per_stub) in need.items()}
    print(f"\nstub regions (MiB): {sorted(r // MiB for r in regions)}; rule (stubs, MiB each): {rule}")
    assert len(regions) == sum(stubs for stubs, _ in need.values())
    assert max(regions) <= max(per_stub for _, per_stub in need.values())
    assert sum(regions) <= sum(stubs * per_stub for stubs, per_stub in need.values())


# ---------------------------------------------------------------- CUDA shared memory (GPU machines)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@local_server_only
def test_cuda_shared_memory_pixels_answer_as_grpc_and_gpu_memory_stays_flat(server, admin_key, reference, max_batch):
    images = [make_image(600 + i, size=(300 + 20 * i, 260)) for i in range(min(8, max_batch))]
    pixels = reference.preprocess(images)  # nvJPEG on the GPU, as the server's preprocess does
    assert pixels.is_cuda
    with ImageClassifier(server.grpc_url) as plain:
        expected = plain.classify(images)
    tol = 1e-3 if pixels.dtype == torch.float32 else 2e-2
    with ImageClassifier(server.grpc_url, shared_memory="cuda", admin_key=admin_key) as client:
        answer = client.classify_pixels(pixels)
        assert [row[0].class_id for row in answer] == [row[0].class_id for row in expected]
        scores = [[p.score for p in row] for row in answer]
        np.testing.assert_allclose(scores, [[p.score for p in row] for row in expected], atol=tol, rtol=1e-2)
        names = set(client.region_names)
        assert names and names <= registered(server.grpc_url, admin_key)

        def free_mib() -> int:
            torch.cuda.synchronize()
            return torch.cuda.mem_get_info(pixels.device)[0] // MiB  # the whole device: server and stubs too

        for i in range(100):  # warm up: allocator caches, cuDNN plans, every batch size
            client.classify_pixels(pixels[: 1 + i % len(images)])
        before, started = free_mib(), time.monotonic()
        for i in range(1000):
            assert len(client.classify_pixels(pixels[: 1 + i % len(images)])) == 1 + i % len(images)
        elapsed, after = time.monotonic() - started, free_mib()
        print(f"\nCUDA shm: 1,000 calls in {elapsed:.1f} s; free GPU memory {before} -> {after} MiB")
        assert before - after <= 64, "GPU memory stays flat"
    assert not names & registered(server.grpc_url, admin_key), "close() unregisters the CUDA region"


# ---------------------------------------------------------------- the CUDA memory pool, sized from the configs (CPU)

SHIPPED = Path(__file__).resolve().parents[1] / "model_repository"  # the project's, with its instance counts


def pool_flags(repository: Path, gpus: list[int]) -> dict[int, int]:
    """{gpu: bytes} of the `--cuda-memory-pool-byte-size` flags server_flags() gives a server on `gpus`."""
    from {{ cookiecutter.package_name }}.server import server_flags

    flags = server_flags(ServerSettings(repository, gpus=gpus))
    pools = [f.split("=", 1)[1].split(":") for f in flags if f.startswith("--cuda-memory-pool-byte-size=")]
    return {int(gpu): int(size) for gpu, size in pools}


def pool_worst_case(repository: Path) -> dict[str, int]:
    """What the CUDA memory pool of one GPU holds at once, hop by hop, when every instance executes a full batch:
    {who: bytes}. The Python backend (2.51) puts in the pool each GPU output a stub returns (into the requester's
    buffer: a BLS caller's response, an ensemble's step output), a copy of each GPU input of a BLS call, and a copy
    of a GPU input from outside the pool (a CUDA shared-memory client's pixels)."""
    import math

    from {{ cookiecutter.package_name }}.model_repository import bytes_per_element, load_config, tensor_datatype

    configs = {m: load_config(repository / m) for m in ("pipeline", "preprocess", "resnet", "postprocess")}

    def nbytes(model: str, *names: str, batch_of: str | None = None) -> int:
        tensors = {t.name: t for t in [*configs[model].input, *configs[model].output]}
        element = sum(math.prod(tensors[n].dims) * bytes_per_element(tensor_datatype(tensors[n])) for n in names)
        return configs[batch_of or model].max_batch_size * element

    def instances(model: str) -> int:
        return sum(group.count for group in configs[model].instance_group)

    bls_postprocess = configs["pipeline"].parameters["postprocess"].string_value == "bls"
    pipeline = (
        2 * nbytes("preprocess", "PIXELS", batch_of="pipeline")  # preprocess's response, and its copy for resnet
        + nbytes("resnet", "LOGITS", batch_of="pipeline")  # resnet's response
        + (nbytes("postprocess", "LOGITS", "SCORES", "CLASS_IDS", batch_of="pipeline") if bls_postprocess else 0)
    )
    pixels = nbytes("preprocess", "PIXELS")
    return {
        "pipeline instances, each waiting with its pixels": instances("pipeline") * pipeline,
        "preprocess instances, each writing pixels for an ensemble": instances("preprocess") * pixels,
        "resnet instances: pixels copied in, logits out": instances("resnet") * nbytes("resnet", "PIXELS", "LOGITS"),
        "postprocess instances: an ensemble's logits": instances("postprocess") * nbytes("postprocess", "LOGITS"),
    }


def test_the_cuda_memory_pool_holds_every_batch_in_flight_at_the_shipped_counts():
    """The shipped repository (its instance counts, not the CPU tests' single instances): on every GPU the pool
    holds what every instance can have in flight at once, so that no GPU tensor falls back to host copies."""
    worst = pool_worst_case(SHIPPED)
    pools = pool_flags(SHIPPED, gpus=[0, 1])
    print(f"\nCUDA pool {pools[0] // MiB} MiB per GPU; worst case in flight {sum(worst.values()) / MiB:.0f} MiB:")
    print("\n".join(f"  {who}: {size / MiB:.0f} MiB" for who, size in worst.items()))
    assert set(pools) == {0, 1} and pools[0] == pools[1], "instances on every GPU: the same pool on each"
    assert pools[0] >= sum(worst.values()) * 5 // 4, "the pool holds the worst case, with room for fragmentation"


def test_the_cuda_memory_pool_follows_max_batch_size_and_instance_counts(tmp_path):
    """Edits after baking: a larger max_batch_size, more instances, or instances on one GPU only resize the pool
    at the next start; the pool still holds the new worst case."""
    from {{ cookiecutter.package_name }}.model_repository import load_config, save_config, set_instance_counts

    repository = tmp_path / "model_repository"
    shutil.copytree(SHIPPED, repository, ignore=shutil.ignore_patterns("weights.pt", "__pycache__"))
    (before,) = pool_flags(repository, gpus=[0]).values()

    batch = load_config(repository / "pipeline").max_batch_size
    for config_path in repository.glob("*/config.pbtxt"):  # twice the batch, and enough to pass the 512 MiB floor
        config = load_config(config_path.parent)
        config.max_batch_size = max(2 * batch, 256)
        save_config(config_path.parent, config)
    (doubled,) = pool_flags(repository, gpus=[0]).values()
    assert doubled > before and doubled >= sum(pool_worst_case(repository).values()) * 5 // 4
    if before > 512 * MiB:  # above the floor the pool grows in proportion to the batch
        assert abs(doubled - 2 * before) <= 128 * MiB, (before, doubled)

    pipelines = sum(group.count for group in load_config(repository / "pipeline").instance_group)
    set_instance_counts(repository, {"pipeline": 2 * pipelines})
    (more,) = pool_flags(repository, gpus=[0]).values()
    assert more > doubled and more >= sum(pool_worst_case(repository).values()) * 5 // 4

    config = load_config(repository / "pipeline")  # the pipeline's instances on GPU 1 only
    config.instance_group[0].gpus[:] = [1]
    save_config(repository / "pipeline", config)
    pools = pool_flags(repository, gpus=[0, 1])
    assert pools[1] == more and pools[0] < more, pools


def test_bls_calls_lists_every_model_the_pipeline_calls():
    """BLS_CALLS sizes the pool and /dev/shm for the calls of a BLS model and tells the watchdog whom to reload: it
    names every model the shipped pipeline calls, and a call it misses is named, with the fix (python_backend logs
    it as a warning)."""
    from {{ cookiecutter.package_name }}.model_repository import BLS_CALLS, undeclared_call

    called = set(re.findall(r'infer\(\s*"(\w+)"', (SHIPPED / "pipeline" / "1" / "model.py").read_text()))
    assert called and all(undeclared_call("pipeline", model) is None for model in called)
    assert set(BLS_CALLS["pipeline"]) == called
    unlisted = "_".join(["not", *sorted(called)])  # a model the pipeline does not call, whatever yours calls
    assert "BLS_CALLS in model_repository.py does not list for pipeline: add it there" in undeclared_call(
        "pipeline", unlisted
    )
