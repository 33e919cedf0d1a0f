"""Shared memory, in one place: what a full /dev/shm says, how much the stubs need, and the clients' regions.

- The words: `DEV_SHM_ADVICE`, what a request that did not fit in /dev/shm says (from the Python backend, whose
  own words name only Docker's --shm-size, from the pipeline and from the client), and `SHM_GROWTH_FAILED`, how the
  Python backend says it.
- The sizing: `dev_shm_bytes()`, how far the Python-backend stubs' regions grow, and `dev_shm_need()`, that and a
  reload's new regions: what `serve` checks before it starts (sizing.py; `serve --print-shm` prints it).
- The clients' regions: `SystemRegions` and `CudaRegions`, one client's registered regions, and
  `remove_stale_regions()`, which removes those of clients that died without closing them.

Imported inside the Python-backend stub too (python_backend.py, for the words): only light imports at the top.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import time
from pathlib import Path

import numpy as np
from tritonclient.utils import InferenceServerException
from tritonclient.utils import shared_memory as system_shm

from .machine import visible_gpus
from .model_repository import BLS_CALLS, bytes_per_element, load_configs, loaded_versions, tensor_datatype
from .paths import is_own_file

MiB = 1 << 20
DEV_SHM = Path("/dev/shm")
DEV_SHM_ADVICE = (
    "/dev/shm is too small for this request: give the server more shared memory (`docker run --shm-size`, compose "
    "`shm_size` / TRITON_SHM_SIZE) or use fewer Python-backend instances or a smaller max batch; sizing rule: "
    "docs/deployment.md (`{{ cookiecutter.project_slug }} serve --print-shm`)"
)
SHM_GROWTH_FAILED = "Failed to increase the shared memory pool size"
# Every region a client makes is named <prefix><pid namespace>_<pid>_<random>_<use>: unique per client, and a
# region whose process is gone can be told apart from one still in use.
REGION_PREFIX = "{{ cookiecutter.package_name }}_client_"


class SharedMemoryFull(InferenceServerException):
    """A request failed because /dev/shm (the server's, or this client's region) had no room for it."""


# ------------------------------------------------------------------ the stubs' regions: how much /dev/shm


def dev_shm_bytes(
    repository: Path,
    gpus: int | None = None,
    image_bytes: int = 256 * 1024,
    label_bytes: int = 64,
    batches: int = 2,
    counts: dict[str, int] | None = None,
) -> dict[str, tuple[int, int]]:
    """How much /dev/shm the Python-backend models of a repository need: {model: (stubs, bytes per stub)}.

    Each instance is a stub process with its own region: it starts at 16 MiB (shm-default-byte-size), grows in
    16 MiB steps to hold what the stub has in flight, and never shrinks. In flight per stub: up to `batches` full
    batches (max_batch_size images of `image_bytes` encoded bytes each) of the host-memory tensors it receives and
    sends: every tensor that lives in host memory (a GPU tensor crosses through the CUDA memory pool; only its
    handle is in /dev/shm). A BLS model also holds the inputs and outputs of the models it calls (BLS_CALLS).
    Instances: `count` per GPU for KIND_GPU/KIND_AUTO on a GPU host, `count` for KIND_CPU; `counts` ({model:
    instances per GPU, or in all on a CPU}) stands in for the configs' counts of the models it names (serve's plan).
    """
    from tritonclient.grpc import model_config_pb2

    gpus = len(visible_gpus()) if gpus is None else gpus
    configs = load_configs(repository)

    def per_image(config, on_gpu: bool) -> int:
        total = 0
        for tensor in [*config.input, *config.output]:
            elements = 1
            for dim in tensor.dims:
                elements *= dim
            if tensor.data_type == model_config_pb2.TYPE_STRING:
                total += image_bytes if tensor.name == "IMAGE" else elements * label_bytes
            elif not on_gpu:
                total += elements * bytes_per_element(tensor_datatype(tensor))
        return total

    need = {}
    for name, config in sorted(configs.items()):
        if config.backend != "python":
            continue
        stubs, on_gpu = 0, False
        for group in config.instance_group or [model_config_pb2.ModelInstanceGroup()]:
            count = (counts or {}).get(name, group.count or 1)
            kind = model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind)
            if kind != "KIND_CPU" and gpus:
                stubs, on_gpu = stubs + count * (len(group.gpus) or gpus), True
            else:
                stubs += count
        stubs *= loaded_versions(Path(repository) / name, config)  # each loaded version has its own stubs
        held = per_image(config, on_gpu) + sum(
            per_image(configs[called], on_gpu) for called in BLS_CALLS.get(name, ()) if called in configs
        )
        batch_bytes = batches * max(1, config.max_batch_size) * held
        need[name] = (stubs, max(16 * MiB, -(-batch_bytes // (16 * MiB)) * 16 * MiB))
    return need


def dev_shm_need(repository: Path, gpus: int | None = None, counts: dict[str, int] | None = None) -> tuple[int, int]:
    """(bytes the stubs' regions grow to, bytes more during the largest reload): the rule `serve` checks before it
    starts (sizing.py) and that compose's shm_size and the Kubernetes /dev/shm limit follow."""
    from .rules import reload_headroom

    need = dev_shm_bytes(repository, gpus, counts=counts)
    running = sum(stubs * per_stub for stubs, per_stub in need.values())
    gpus = len(visible_gpus()) if gpus is None else gpus
    per_gpu = {m: stubs // max(1, gpus) for m, (stubs, _) in need.items()}
    reload = reload_headroom(per_gpu, {m: per_stub for m, (_, per_stub) in need.items()})[0]
    return running, reload


def print_shm_need(repository: Path, counts: dict[str, int] | None = None) -> int:
    """The /dev/shm the Python-backend stubs of `repository` can grow to (dev_shm_bytes), per model, and a reload."""
    for model, (stubs, per_stub) in dev_shm_bytes(repository, counts=counts).items():
        print(f"{model:12s} {stubs} stub(s) x {per_stub // MiB} MiB")
    running, reload = dev_shm_need(repository, counts=counts)
    print(f"reload       {reload // MiB} MiB more while a reload's new stubs start beside the old")
    print(f"total        {(running + reload) // MiB} MiB  (+ the regions of same-host shared-memory clients)")
    return running + reload


# ------------------------------------------------------------------ the clients' regions


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def stale(name: str) -> bool:
    """A region of this PID namespace whose client process is gone."""
    if not name.startswith(REGION_PREFIX):
        return False
    try:
        namespace, pid = (int(part) for part in name[len(REGION_PREFIX) :].split("_")[:2])
    except ValueError:
        return False
    return namespace == _pid_namespace() and not _alive(pid)


def remove_stale_regions(client=None, headers: dict | None = None, in_use_wait_s: float = 30) -> list[str]:
    """Unregister from the server (given a tritonclient.grpc client and the admin headers) and unlink from
    /dev/shm the regions of this host's clients that died without closing them (SIGKILL, a crash). Returns the
    names removed (unregistered, unlinked, or both).

    A dead client's request can still be in the server, which refuses to unregister a region in use: such a region
    is waited for up to `in_use_wait_s`, then left registered for the next call (its file still goes)."""
    removed = set()
    if client is not None:
        for kind in ("system", "cuda"):
            status = getattr(client, f"get_{kind}_shared_memory_status")(headers=headers, as_json=True)
            for name in status.get("regions", {}):  # {name: status}
                if not stale(name):
                    continue
                try:
                    unregister(client, kind, name, headers, in_use_wait_s)
                except InferenceServerException as exc:
                    if "in use" not in (exc.message() or ""):
                        raise
                    continue
                removed.add(name)
    for path in DEV_SHM.glob(REGION_PREFIX + "*"):
        if stale(path.name) and is_own_file(path):  # another user's file of that name is theirs
            with contextlib.suppress(OSError):
                path.unlink()
                removed.add(path.name)
    return sorted(removed)


def unregister(client, kind: str, name: str, headers: dict | None, timeout_s: float = 30) -> None:
    """Unregister a region; a region a request still uses is refused by the server: retry until it is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            getattr(client, f"unregister_{kind}_shared_memory")(name, headers=headers)
            return
        except InferenceServerException as exc:
            if "in use" not in (exc.message() or "") or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Regions:
    """The shared-memory regions of one client, one per use ("io", "pixels"), each sized for the largest request
    so far and reused. release() unregisters and frees them all; it also runs when the client is collected and at
    interpreter exit (weakref.finalize), so it holds no reference to the client object itself.

    A subclass per kind of memory: SystemRegions (/dev/shm), CudaRegions (CUDA IPC)."""

    kind = ""

    def __init__(self, client, headers: dict):
        self.client, self.headers = client, headers
        self.prefix = f"{REGION_PREFIX}{_pid_namespace()}_{os.getpid()}_{secrets.token_hex(4)}_"
        self.regions: dict[str, tuple[str, object, int]] = {}  # use -> (name, handle, byte size)

    def get(self, use: str, byte_size: int, device_id: int = 0):
        """(name, handle) of a registered region of at least byte_size bytes; grown (re-made) when too small."""
        if use in self.regions and self.regions[use][2] >= byte_size:
            return self.regions[use][:2]
        self.drop(use)
        size = max(MiB, 1 << (byte_size - 1).bit_length())  # powers of two: few re-makes as batches grow
        name = self.prefix + use
        self._create(use, name, size, device_id)
        return self.regions[use][:2]

    def _create(self, use: str, name: str, size: int, device_id: int) -> None:
        """Make, record (in self.regions) and register the region."""
        raise NotImplementedError

    def _destroy(self, handle) -> None:
        raise NotImplementedError

    def drop(self, use: str) -> None:
        if use not in self.regions:
            return
        name, handle, _ = self.regions.pop(use)
        try:
            unregister(self.client, self.kind, name, self.headers)
        except Exception:  # the server is gone or unreachable: its mapping went with it; free ours regardless
            pass
        finally:
            self._destroy(handle)

    def release(self) -> None:
        for use in list(self.regions):
            self.drop(use)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.regions.values()]


class SystemRegions(Regions):
    """Regions in /dev/shm, their pages allocated up front: a full /dev/shm fails here, not with SIGBUS later."""

    kind = "system"

    def _create(self, use: str, name: str, size: int, device_id: int) -> None:
        free = shutil.disk_usage(DEV_SHM).free
        if size > free:  # tmpfs would take it and then kill us with SIGBUS on the first write
            raise SharedMemoryFull(f"{DEV_SHM_ADVICE} (this client's region: {size >> 20} MiB, {free >> 20} free)")
        handle = system_shm.create_shared_memory_region(name, "/" + name, size, create_only=True)
        self.regions[use] = (name, handle, size)
        try:
            os.posix_fallocate(handle._mpsm_handle._fd, 0, size)  # the pages exist now, or ENOSPC here
        except OSError as exc:
            self.drop(use)
            raise SharedMemoryFull(f"{DEV_SHM_ADVICE} (this client's region: {exc})") from exc
        self.client.register_system_shared_memory(name, "/" + name, size, headers=self.headers)

    def _destroy(self, handle) -> None:
        system_shm.destroy_shared_memory_region(handle)

    @staticmethod
    def write(handle, arrays: list[np.ndarray]) -> None:
        system_shm.set_shared_memory_region(handle, arrays)

    @staticmethod
    def read(handle, dtype, shape: list[int], offset: int) -> np.ndarray:
        """A copy: the region is reused by the next call."""
        return np.array(system_shm.get_contents_as_numpy(handle, dtype, shape, offset=offset))


@functools.cache
def _cuda_shm():
    """tritonclient's CUDA shared-memory module: it needs cuda-python (the `cuda` extra), so only when used."""
    from tritonclient.utils import cuda_shared_memory

    return cuda_shared_memory


class CudaRegions(Regions):
    """Regions in GPU memory, shared with the server through CUDA IPC."""

    kind = "cuda"

    def _create(self, use: str, name: str, size: int, device_id: int) -> None:
        handle = _cuda_shm().create_shared_memory_region(name, size, device_id)
        self.regions[use] = (name, handle, size)
        raw = _cuda_shm().get_raw_handle(handle)
        self.client.register_cuda_shared_memory(name, raw, device_id, size, headers=self.headers)

    def _destroy(self, handle) -> None:
        _cuda_shm().destroy_shared_memory_region(handle)

    @staticmethod
    def write(handle, tensors: list) -> None:
        """Device to device, synchronized."""
        _cuda_shm().set_shared_memory_region_from_dlpack(handle, tensors)
