"""A small gRPC client for the entry points: `pipeline` (BLS), `ensemble`, and `classify_pixels` (pixels in).

`shared_memory` picks how the tensors travel, for a client on the same host as the server:
- None: inside the gRPC messages (works from anywhere);
- "system": the encoded images and the results through a /dev/shm region the client creates and the server maps:
  no serialization of large batches into protobuf;
- "cuda": pixels the client already holds on a GPU (`classify_pixels`) through a CUDA IPC region: the server reads
  them from GPU memory, no round trip through the host. The small results come back over gRPC.

Registering a region makes the server map memory it is told to by name, so the shared-memory API stays behind the
admin key: these modes need the server's key (`admin_key=`, else TRITON_ADMIN_KEY, else the file a local `serve`
keeps it in, admin_key.key_file()). The client unregisters and
frees every region it made on close(), on any error, on Ctrl-C and at interpreter exit. A client killed outright
(SIGKILL) cannot; the next shared-memory client on the host, and `serve` when it stops, remove what it left
(`remove_stale_regions`), and so does `serve`'s watchdog within seconds with nobody else calling.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

from .admin_key import find as find_admin_key
from .admin_key import key_file as admin_key_file
from .server import DEV_SHM_ADVICE, SHM_GROWTH_FAILED

DEFAULT_URL = "localhost:{{ cookiecutter.grpc_port }}"
ADMIN_KEY_HEADER = "triton-grpc-protocol-admin-key"
PIXELS_MODEL = "classify_pixels"
OUTPUTS = ("SCORES", "CLASS_IDS", "LABELS")
DEV_SHM = Path("/dev/shm")
# Every region a client makes is named <prefix><pid namespace>_<pid>_<random>_<use>: unique per client, and a
# region whose process is gone can be told apart from one still in use.
REGION_PREFIX = "{{ cookiecutter.package_name }}_client_"
LABEL_BYTES = 4 + 252  # room per label in the output region: 4-byte length + up to 252 bytes of text
BYTES_PER_ELEMENT = {"FP32": 4, "FP16": 2, "BF16": 2, "INT64": 8}
MiB = 1 << 20


class AdminKeyError(ValueError):
    """No admin key for an admin API (shared memory), or a key the server rejected; the message says which."""


class SharedMemoryFull(InferenceServerException):
    """A request failed because /dev/shm (the server's, or this client's region) had no room for it."""


@dataclass(frozen=True)
class Prediction:
    class_id: int
    label: str
    score: float


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


def _stale(name: str) -> bool:
    """A region of this PID namespace whose client process is gone."""
    if not name.startswith(REGION_PREFIX):
        return False
    try:
        namespace, pid = (int(part) for part in name[len(REGION_PREFIX) :].split("_")[:2])
    except ValueError:
        return False
    return namespace == _pid_namespace() and not _alive(pid)


def remove_stale_regions(
    client: grpcclient.InferenceServerClient | None = None, headers: dict | None = None, in_use_wait_s: float = 30
):
    """Unregister from the server (given a client and the admin headers) and unlink from /dev/shm the regions of
    this host's clients that died without closing them (SIGKILL, a crash). Returns the names removed (unregistered,
    unlinked, or both).

    A dead client's request can still be in the server, which refuses to unregister a region in use: such a region
    is waited for up to `in_use_wait_s`, then left registered for the next call (its file still goes)."""
    removed = set()
    if client is not None:
        for kind in ("system", "cuda"):
            status = getattr(client, f"get_{kind}_shared_memory_status")(headers=headers, as_json=True)
            for name in status.get("regions", {}):  # {name: status}
                if not _stale(name):
                    continue
                try:
                    _unregister(client, kind, name, headers, in_use_wait_s)
                except InferenceServerException as exc:
                    if "in use" not in (exc.message() or ""):
                        raise
                    continue
                removed.add(name)
    for path in DEV_SHM.glob(REGION_PREFIX + "*"):
        if _stale(path.name):
            path.unlink(missing_ok=True)
            removed.add(path.name)
    return sorted(removed)


def _unregister(client, kind: str, name: str, headers: dict | None, timeout_s: float = 30) -> None:
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


class _Regions:
    """The shared-memory regions of one client, one per use ("io", "pixels"), each sized for the largest request
    so far and reused. release() unregisters and frees them all; it also runs when the client is collected and at
    interpreter exit (weakref.finalize), so it holds no reference to the client object itself."""

    def __init__(self, client: grpcclient.InferenceServerClient, kind: str, headers: dict):
        self.client, self.kind, self.headers = client, kind, headers
        self.prefix = f"{REGION_PREFIX}{_pid_namespace()}_{os.getpid()}_{secrets.token_hex(4)}_"
        self.regions: dict[str, tuple[str, object, int]] = {}  # use -> (name, handle, byte size)

    def get(self, use: str, byte_size: int, device_id: int = 0):
        """(name, handle) of a registered region of at least byte_size bytes; grown (re-made) when too small."""
        if use in self.regions and self.regions[use][2] >= byte_size:
            return self.regions[use][:2]
        self.drop(use)
        size = max(MiB, 1 << (byte_size - 1).bit_length())  # powers of two: few re-makes as batches grow
        name = self.prefix + use
        if self.kind == "system":
            from tritonclient.utils import shared_memory as shm

            free = shutil.disk_usage(DEV_SHM).free
            if size > free:  # tmpfs would take it and then kill us with SIGBUS on the first write
                raise SharedMemoryFull(f"{DEV_SHM_ADVICE} (this client's region: {size >> 20} MiB, {free >> 20} free)")
            handle = shm.create_shared_memory_region(name, "/" + name, size, create_only=True)
            self.regions[use] = (name, handle, size)
            try:
                os.posix_fallocate(handle._mpsm_handle._fd, 0, size)  # the pages exist now, or ENOSPC here
            except OSError as exc:
                self.drop(use)
                raise SharedMemoryFull(f"{DEV_SHM_ADVICE} (this client's region: {exc})") from exc
            self.client.register_system_shared_memory(name, "/" + name, size, headers=self.headers)
        else:
            from tritonclient.utils import cuda_shared_memory as cudashm

            handle = cudashm.create_shared_memory_region(name, size, device_id)
            self.regions[use] = (name, handle, size)
            raw = cudashm.get_raw_handle(handle)
            self.client.register_cuda_shared_memory(name, raw, device_id, size, headers=self.headers)
        return name, handle

    def drop(self, use: str) -> None:
        if use not in self.regions:
            return
        name, handle, _ = self.regions.pop(use)
        try:
            _unregister(self.client, self.kind, name, self.headers)
        except Exception:  # the server is gone or unreachable: its mapping went with it; free ours regardless
            pass
        finally:
            if self.kind == "system":
                from tritonclient.utils import shared_memory as shm

                shm.destroy_shared_memory_region(handle)
            else:
                from tritonclient.utils import cuda_shared_memory as cudashm

                cudashm.destroy_shared_memory_region(handle)

    def release(self) -> None:
        for use in list(self.regions):
            self.drop(use)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.regions.values()]


class ImageClassifier:
    """classify([jpeg_or_png_bytes, ...]) -> one list of top-k Predictions per image, best first.

    classify_pixels(pixels) does the same for preprocessed [n, 3, H, W] pixels (a torch tensor, on a GPU with
    shared_memory="cuda") through `classify_pixels`. A context manager; not for concurrent use from several threads
    (one client per thread: each has its own regions).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        model: str = "pipeline",
        timeout_s: float | None = 60,
        shared_memory: str | None = None,
        admin_key: str | None = None,
    ):
        if shared_memory not in (None, "system", "cuda"):
            raise ValueError(f"shared_memory must be None, 'system' or 'cuda', not {shared_memory!r}")
        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.timeout_s = timeout_s
        self.shared_memory = shared_memory
        self._configs: dict[str, object] = {}
        self._lock = threading.Lock()
        self._regions = None
        if shared_memory:
            source = "admin_key="
            if not admin_key:
                admin_key, source = find_admin_key()
            if not admin_key:
                raise AdminKeyError(
                    "shared memory is an admin API of this server and no admin key was found: pass admin_key=, set "
                    f"TRITON_ADMIN_KEY, or run on the host where `serve` keeps its key ({admin_key_file()})"
                )
            headers = {ADMIN_KEY_HEADER: admin_key}
            try:
                remove_stale_regions(self.client, headers)  # also checks the key: a wrong one fails here
            except InferenceServerException as exc:
                if "restricted" not in (exc.message() or ""):
                    raise
                raise AdminKeyError(
                    f"admin key rejected: the server at {url} does not accept the key from {source}; use the key of "
                    f"the running `serve` (TRITON_ADMIN_KEY, or {admin_key_file()} on its host; "
                    "`serve --new-admin-key` makes a new one)"
                ) from None
            self._regions = _Regions(self.client, shared_memory, headers)
            self._finalizer = weakref.finalize(self, self._regions.release)

    # ------------------------------------------------------------------ requests

    def infer(self, images: list[bytes], parameters: dict | None = None) -> grpcclient.InferResult:
        """The raw Triton result (SCORES, CLASS_IDS, LABELS) for a batch of encoded images, over plain gRPC.
        `parameters` go with the request; a BLS model.py reads them with `request.parameters()`
        (docs/customizing.md, recipe 3)."""
        batch = np.array([[image] for image in images], dtype=object)
        inputs = [grpcclient.InferInput("IMAGE", list(batch.shape), "BYTES")]
        inputs[0].set_data_from_numpy(batch)
        outputs = [grpcclient.InferRequestedOutput(name) for name in OUTPUTS]
        return self._call(self.model, inputs, outputs, parameters)

    def outputs(self, images: list[bytes], parameters: dict | None = None) -> dict[str, np.ndarray]:
        """{SCORES, CLASS_IDS, LABELS: numpy array} for a batch of encoded images, by the chosen transport.
        CUDA shared memory is for pixels: encoded images go over gRPC in that mode."""
        if self.shared_memory != "system":
            result = self.infer(images, parameters)
            return {name: result.as_numpy(name) for name in OUTPUTS}
        batch = np.array([[image] for image in images], dtype=object)
        serialized = serialize_byte_tensor(batch)
        with self._lock, self._release_on_error():
            size = serialized_byte_size(serialized)
            layout = self._output_layout(self.model, len(images), offset=size)
            name, handle = self._regions.get("io", layout["end"])
            from tritonclient.utils import shared_memory as shm

            shm.set_shared_memory_region(handle, [serialized])
            inputs = [grpcclient.InferInput("IMAGE", list(batch.shape), "BYTES")]
            inputs[0].set_shared_memory(name, size)
            return self._infer_to_region(self.model, inputs, name, handle, layout, parameters)

    def classify(self, images: list[bytes], parameters: dict | None = None) -> list[list[Prediction]]:
        return self._predictions(self.outputs(images, parameters))

    def classify_pixels(self, pixels) -> list[list[Prediction]]:
        """Top-k Predictions for preprocessed pixels ([n, 3, H, W], the dtype `classify_pixels` declares): a torch
        tensor on a GPU with shared_memory="cuda", else a torch tensor or numpy array anywhere."""
        return self._predictions(self.pixel_outputs(pixels))

    def pixel_outputs(self, pixels) -> dict[str, np.ndarray]:
        datatype = self._input_datatype(PIXELS_MODEL, "PIXELS")
        shape = list(pixels.shape)
        nbytes = int(np.prod(shape)) * BYTES_PER_ELEMENT[datatype]
        outputs = [grpcclient.InferRequestedOutput(name) for name in OUTPUTS]
        inputs = [grpcclient.InferInput("PIXELS", shape, datatype)]
        if self.shared_memory == "cuda":
            from tritonclient.utils import cuda_shared_memory as cudashm

            if not getattr(pixels, "is_cuda", False):
                raise ValueError("shared_memory='cuda' sends pixels that are already on a GPU: a torch CUDA tensor")
            pixels = pixels.to(_torch_dtype(datatype)).contiguous()
            with self._lock, self._release_on_error():
                name, handle = self._regions.get("pixels", nbytes, pixels.device.index or 0)
                cudashm.set_shared_memory_region_from_dlpack(handle, [pixels])  # device to device, synchronized
                inputs[0].set_shared_memory(name, nbytes)
                result = self._call(PIXELS_MODEL, inputs, outputs)
                return {name: result.as_numpy(name) for name in OUTPUTS}
        array = _host_pixels(pixels, datatype)
        if self.shared_memory == "system":
            from tritonclient.utils import shared_memory as shm

            with self._lock, self._release_on_error():
                layout = self._output_layout(PIXELS_MODEL, shape[0], offset=nbytes)
                name, handle = self._regions.get("io", layout["end"])
                shm.set_shared_memory_region(handle, [array])
                inputs[0].set_shared_memory(name, nbytes)
                return self._infer_to_region(PIXELS_MODEL, inputs, name, handle, layout)
        if datatype == "BF16":
            raise ValueError("BF16 pixels travel through shared memory: shared_memory='system' or 'cuda'")
        inputs[0].set_data_from_numpy(array)
        result = self._call(PIXELS_MODEL, inputs, outputs)
        return {name: result.as_numpy(name) for name in OUTPUTS}

    # ------------------------------------------------------------------ lifecycle

    @property
    def region_names(self) -> list[str]:
        """The names of the shared-memory regions this client holds now (registered on the server)."""
        return self._regions.names if self._regions else []

    def close(self) -> None:
        """Unregister and free every region, then close the connection. Safe to call twice."""
        if self._regions is not None:
            self._finalizer()
        self.client.close()

    def __enter__(self) -> ImageClassifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _call(self, model, inputs, outputs, parameters: dict | None = None) -> grpcclient.InferResult:
        try:
            return self.client.infer(
                model, inputs, outputs=outputs, client_timeout=self.timeout_s, parameters=parameters
            )
        except InferenceServerException as exc:
            message = exc.message() or ""
            if SHM_GROWTH_FAILED in message:  # a Python-backend stub's region could not grow
                advice = "" if DEV_SHM_ADVICE in message else f"{DEV_SHM_ADVICE}. "  # the pipeline adds it too
                raise SharedMemoryFull(f"{advice}{message}", exc.status()) from exc
            raise

    @contextlib.contextmanager
    def _release_on_error(self):
        """Any failure, Ctrl-C included: the server may still hold the request, so the regions are unregistered
        (once the server is done with them) and freed; the next call makes new ones."""
        try:
            yield
        except BaseException:
            self._regions.release()
            raise

    def _config(self, model: str):
        if model not in self._configs:
            self._configs[model] = self.client.get_model_config(model).config
        return self._configs[model]

    def _input_datatype(self, model: str, name: str) -> str:
        from tritonclient.grpc import model_config_pb2

        (tensor,) = [t for t in self._config(model).input if t.name == name]
        return model_config_pb2.DataType.Name(tensor.data_type).removeprefix("TYPE_")

    def _output_layout(self, model: str, batch: int, offset: int) -> dict:
        """Where each output goes in the region, after the input (64-byte aligned)."""
        from tritonclient.grpc import model_config_pb2

        layout, end = {}, offset
        for tensor in self._config(model).output:
            datatype = model_config_pb2.DataType.Name(tensor.data_type).removeprefix("TYPE_")
            per = LABEL_BYTES if datatype == "STRING" else BYTES_PER_ELEMENT[datatype]
            start = -(-end // 64) * 64
            size = batch * int(np.prod(tensor.dims)) * per
            layout[tensor.name] = (start, size, "BYTES" if datatype == "STRING" else datatype)
            end = start + size
        layout["end"] = end
        return layout

    def _infer_to_region(self, model, inputs, name, handle, layout, parameters=None) -> dict[str, np.ndarray]:
        from tritonclient.utils import shared_memory as shm

        outputs = []
        for output in OUTPUTS:
            requested = grpcclient.InferRequestedOutput(output)
            requested.set_shared_memory(name, layout[output][1], offset=layout[output][0])
            outputs.append(requested)
        result = self._call(model, inputs, outputs, parameters)
        arrays = {}
        for output in OUTPUTS:
            start, _, datatype = layout[output]
            shape = list(result.get_output(output).shape)
            dtype = np.object_ if datatype == "BYTES" else np.dtype(datatype.lower().replace("fp", "float"))
            # a copy: the region is reused by the next call
            arrays[output] = np.array(shm.get_contents_as_numpy(handle, dtype, shape, offset=start))
        return arrays

    @staticmethod
    def _predictions(arrays: dict[str, np.ndarray]) -> list[list[Prediction]]:
        scores, class_ids, labels = (arrays[name] for name in OUTPUTS)
        return [
            [Prediction(int(class_id), _text(label), float(score)) for score, class_id, label in zip(*row)]
            for row in zip(scores, class_ids, labels)
        ]


def _torch_dtype(datatype: str):
    import torch

    return {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}[datatype]


def _host_pixels(pixels, datatype: str) -> np.ndarray:
    """Contiguous host pixels in the declared type; BF16 as its raw 16-bit patterns (numpy has no bfloat16)."""
    if hasattr(pixels, "detach"):  # a torch tensor, anywhere
        import torch

        tensor = pixels.detach().to("cpu", _torch_dtype(datatype)).contiguous()
        return (tensor.view(torch.int16) if datatype == "BF16" else tensor).numpy()
    return np.ascontiguousarray(pixels, dtype={"FP32": np.float32, "FP16": np.float16}[datatype])


def _text(label) -> str:
    return label.decode() if isinstance(label, bytes) else str(label)
