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
(`shm.remove_stale_regions`), and so does `serve`'s watchdog within seconds with nobody else calling.

Each mode is one transport object behind one interface (`Transport`): `InMessages`, `SystemShm`, `CudaShm`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

from .admin_key import ADMIN_KEY_HEADER
from .admin_key import find as find_admin_key
from .admin_key import key_file as admin_key_file
from .model_repository import OUTPUTS, PIXELS_MODEL, bytes_per_element, numpy_dtype, tensor_datatype, torch_dtype
from .shm import (
    DEV_SHM_ADVICE,
    SHM_GROWTH_FAILED,
    CudaRegions,
    Regions,
    SharedMemoryFull,
    SystemRegions,
    remove_stale_regions,
)

DEFAULT_URL = "localhost:{{ cookiecutter.grpc_port }}"
LABEL_BYTES = 4 + 252  # room per label in the output region: 4-byte length + up to 252 bytes of text


class AdminKeyError(ValueError):
    """No admin key for an admin API (shared memory), or a key the server rejected; the message says which."""


@dataclass(frozen=True)
class Prediction:
    class_id: int
    label: str
    score: float


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
        if shared_memory not in list(TRANSPORTS):
            raise ValueError(f"shared_memory must be None, 'system' or 'cuda', not {shared_memory!r}")
        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.timeout_s = timeout_s
        self.shared_memory = shared_memory
        self._configs: dict[str, object] = {}
        if shared_memory is None:
            self.transport: Transport = InMessages()
        else:
            self.transport = TRANSPORTS[shared_memory](self.client, self._admin_headers(url, admin_key))
            self._finalizer = weakref.finalize(self, self.transport.regions.release)

    def _admin_headers(self, url: str, admin_key: str | None) -> dict[str, str]:
        """The headers that open the shared-memory API, with a key the server accepts (AdminKeyError if none)."""
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
        return headers

    # ------------------------------------------------------------------ requests

    def infer(self, images: list[bytes], parameters: dict | None = None) -> grpcclient.InferResult:
        """The raw Triton result (SCORES, CLASS_IDS, LABELS) for a batch of encoded images, over plain gRPC.
        `parameters` go with the request; a BLS model.py reads them with `request.parameters()`
        (docs/customizing.md, recipe 3)."""
        batch = _image_batch(images)
        inputs = [grpcclient.InferInput("IMAGE", list(batch.shape), "BYTES")]
        inputs[0].set_data_from_numpy(batch)
        return self._call(self.model, inputs, _requested_outputs(), parameters)

    def outputs(self, images: list[bytes], parameters: dict | None = None) -> dict[str, np.ndarray]:
        """{SCORES, CLASS_IDS, LABELS: numpy array} for a batch of encoded images, by the chosen transport.
        CUDA shared memory is for pixels: encoded images go over gRPC in that mode."""
        return self.transport.images(self, images, parameters)

    def classify(self, images: list[bytes], parameters: dict | None = None) -> list[list[Prediction]]:
        return self._predictions(self.outputs(images, parameters))

    def classify_pixels(self, pixels) -> list[list[Prediction]]:
        """Top-k Predictions for preprocessed pixels ([n, 3, H, W], the dtype `classify_pixels` declares): a torch
        tensor on a GPU with shared_memory="cuda", else a torch tensor or numpy array anywhere."""
        return self._predictions(self.pixel_outputs(pixels))

    def pixel_outputs(self, pixels) -> dict[str, np.ndarray]:
        datatype = self.input_datatype(PIXELS_MODEL, "PIXELS")
        nbytes = int(np.prod(list(pixels.shape))) * bytes_per_element(datatype)
        return self.transport.pixels(self, pixels, datatype, nbytes)

    # ------------------------------------------------------------------ the server's side

    def is_live(self) -> bool:
        return self.client.is_server_live()

    def is_ready(self, model: str) -> bool:
        return self.client.is_model_ready(model)

    def config(self, model: str):
        """The model's config (a ModelConfig protobuf), as the server serves it; read once per client."""
        if model not in self._configs:
            self._configs[model] = self.client.get_model_config(model).config
        return self._configs[model]

    def input_datatype(self, model: str, name: str) -> str:
        """The datatype ("FP32", ...) the model declares for input `name`."""
        (tensor,) = [t for t in self.config(model).input if t.name == name]
        return tensor_datatype(tensor)

    # ------------------------------------------------------------------ lifecycle

    @property
    def region_names(self) -> list[str]:
        """The names of the shared-memory regions this client holds now (registered on the server)."""
        return self.transport.regions.names if self.transport.regions else []

    def close(self) -> None:
        """Unregister and free every region, then close the connection. Safe to call twice."""
        if self.transport.regions is not None:
            self._finalizer()
        self.client.close()

    def __enter__(self) -> ImageClassifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals (also the transports')

    def _call(self, model, inputs, outputs, parameters: dict | None = None) -> grpcclient.InferResult:
        try:
            # the deadline twice: the client gives up after timeout_s, and the server (its queues, each BLS call)
            # rejects the request once it has waited that long, instead of serving a client that has gone
            timeout_us = int(self.timeout_s * 1e6) if self.timeout_s else None
            return self.client.infer(
                model, inputs, outputs=outputs, client_timeout=self.timeout_s, timeout=timeout_us, parameters=parameters
            )
        except InferenceServerException as exc:
            message = exc.message() or ""
            if SHM_GROWTH_FAILED in message:  # a Python-backend stub's region could not grow
                advice = "" if DEV_SHM_ADVICE in message else f"{DEV_SHM_ADVICE}. "  # the pipeline adds it too
                raise SharedMemoryFull(f"{advice}{message}", exc.status()) from exc
            raise

    def _output_layout(self, model: str, batch: int, offset: int) -> dict:
        """Where each output goes in the region, after the input (64-byte aligned)."""
        layout, end = {}, offset
        for tensor in self.config(model).output:
            datatype = tensor_datatype(tensor)
            per = LABEL_BYTES if datatype == "STRING" else bytes_per_element(datatype)
            start = -(-end // 64) * 64
            size = batch * int(np.prod(tensor.dims)) * per
            layout[tensor.name] = (start, size, "BYTES" if datatype == "STRING" else datatype)
            end = start + size
        layout["end"] = end
        return layout

    @staticmethod
    def _predictions(arrays: dict[str, np.ndarray]) -> list[list[Prediction]]:
        scores, class_ids, labels = (arrays[name] for name in OUTPUTS)
        return [
            [Prediction(int(class_id), _text(label), float(score)) for score, class_id, label in zip(*row)]
            for row in zip(scores, class_ids, labels)
        ]


# ------------------------------------------------------------------ transports: how the tensors travel


class Transport:
    """How one client's tensors travel: one subclass per `shared_memory` mode. `images()` and `pixels()` send one
    request to an entry model and return its outputs as numpy arrays; `regions`: the shared-memory regions the
    transport holds (None: none)."""

    regions: Regions | None = None

    def images(self, classifier: ImageClassifier, images: list[bytes], parameters: dict | None) -> dict:
        """Encoded images to `classifier.model`: over gRPC, unless a subclass says otherwise."""
        return _arrays(classifier.infer(images, parameters))

    def pixels(self, classifier: ImageClassifier, pixels, datatype: str, nbytes: int) -> dict:
        """Preprocessed pixels of `datatype` (`nbytes` bytes in all) to `classify_pixels`."""
        raise NotImplementedError


class InMessages(Transport):
    """shared_memory=None: the tensors inside the gRPC messages (works from anywhere)."""

    def pixels(self, classifier, pixels, datatype, nbytes):
        array = _host_pixels(pixels, datatype)
        if datatype == "BF16":
            raise ValueError("BF16 pixels travel through shared memory: shared_memory='system' or 'cuda'")
        inputs = [grpcclient.InferInput("PIXELS", list(pixels.shape), datatype)]
        inputs[0].set_data_from_numpy(array)
        return _arrays(classifier._call(PIXELS_MODEL, inputs, _requested_outputs()))


class _InRegions(Transport):
    """What the shared-memory modes share: their regions serve one request at a time, and are released on any
    failure."""

    def __init__(self, regions: Regions):
        self.regions = regions
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def request(self):
        """One request through the regions. Any failure, Ctrl-C included: the server may still hold the request,
        so the regions are unregistered (once the server is done with them) and freed; the next call makes new
        ones."""
        with self.lock:
            try:
                yield
            except BaseException:
                self.regions.release()
                raise


class SystemShm(_InRegions):
    """shared_memory="system": the input, then every output, in one /dev/shm region ("io")."""

    def __init__(self, client: grpcclient.InferenceServerClient, headers: dict):
        super().__init__(SystemRegions(client, headers))

    def images(self, classifier, images, parameters):
        batch = _image_batch(images)
        serialized = serialize_byte_tensor(batch)
        with self.request():
            image = grpcclient.InferInput("IMAGE", list(batch.shape), "BYTES")
            size = serialized_byte_size(serialized)
            return self._infer(classifier, classifier.model, image, serialized, size, len(images), parameters)

    def pixels(self, classifier, pixels, datatype, nbytes):
        array = _host_pixels(pixels, datatype)
        with self.request():
            inputs = grpcclient.InferInput("PIXELS", list(pixels.shape), datatype)
            return self._infer(classifier, PIXELS_MODEL, inputs, array, nbytes, pixels.shape[0])

    def _infer(self, classifier, model, tensor, data, size, batch, parameters=None) -> dict[str, np.ndarray]:
        """`data` (`size` bytes) at the start of the region as the input `tensor`, every output after it."""
        layout = classifier._output_layout(model, batch, offset=size)
        name, handle = self.regions.get("io", layout["end"])
        self.regions.write(handle, [data])
        tensor.set_shared_memory(name, size)
        outputs = []
        for output in OUTPUTS:
            requested = grpcclient.InferRequestedOutput(output)
            requested.set_shared_memory(name, layout[output][1], offset=layout[output][0])
            outputs.append(requested)
        result = classifier._call(model, [tensor], outputs, parameters)
        arrays = {}
        for output in OUTPUTS:
            start, _, datatype = layout[output]
            dtype = np.object_ if datatype == "BYTES" else numpy_dtype(datatype)
            arrays[output] = self.regions.read(handle, dtype, list(result.get_output(output).shape), start)
        return arrays


class CudaShm(_InRegions):
    """shared_memory="cuda": pixels already on a GPU through a CUDA IPC region ("pixels"): the server reads them
    from GPU memory. Encoded images, and the small results, over gRPC."""

    def __init__(self, client: grpcclient.InferenceServerClient, headers: dict):
        super().__init__(CudaRegions(client, headers))

    def pixels(self, classifier, pixels, datatype, nbytes):
        if not getattr(pixels, "is_cuda", False):
            raise ValueError("shared_memory='cuda' sends pixels that are already on a GPU: a torch CUDA tensor")
        pixels = pixels.to(torch_dtype(datatype)).contiguous()
        with self.request():
            name, handle = self.regions.get("pixels", nbytes, pixels.device.index or 0)
            self.regions.write(handle, [pixels])  # device to device, synchronized
            inputs = [grpcclient.InferInput("PIXELS", list(pixels.shape), datatype)]
            inputs[0].set_shared_memory(name, nbytes)
            return _arrays(classifier._call(PIXELS_MODEL, inputs, _requested_outputs()))


TRANSPORTS = {None: InMessages, "system": SystemShm, "cuda": CudaShm}


def _image_batch(images: list[bytes]) -> np.ndarray:
    return np.array([[image] for image in images], dtype=object)


def _requested_outputs() -> list[grpcclient.InferRequestedOutput]:
    return [grpcclient.InferRequestedOutput(name) for name in OUTPUTS]


def _arrays(result: grpcclient.InferResult) -> dict[str, np.ndarray]:
    return {name: result.as_numpy(name) for name in OUTPUTS}


def _host_pixels(pixels, datatype: str) -> np.ndarray:
    """Contiguous host pixels in the declared type; BF16 as its raw 16-bit patterns (numpy has no bfloat16)."""
    if hasattr(pixels, "detach"):  # a torch tensor, anywhere
        import torch

        tensor = pixels.detach().to("cpu", torch_dtype(datatype)).contiguous()
        return (tensor.view(torch.int16) if datatype == "BF16" else tensor).numpy()
    return np.ascontiguousarray(pixels, dtype=numpy_dtype(datatype))


def _text(label) -> str:
    return label.decode() if isinstance(label, bytes) else str(label)


def classify_each(client: ImageClassifier, images: dict[str, bytes], parameters: dict | None, on_gpu: bool) -> dict:
    """{name: predictions, or why it failed}, for `classify` of the CLI. Batches of up to the model's max batch size;
    a batch that fails is sent again image by image, so one bad image fails alone. `on_gpu`: decoded here, on this
    machine's GPU (decode_on_gpu), and sent as pixels to `classify_pixels` over CUDA shared memory."""

    def one(data: list[bytes]):
        if on_gpu:
            return client.classify_pixels(decode_on_gpu(client, data))
        return client.classify(data, parameters)

    def reason(exc: Exception) -> str:
        text = exc.message() if isinstance(exc, InferenceServerException) else str(exc)
        return (text or type(exc).__name__).strip()

    paths, results = list(images), {}
    size = max(1, client.config(client.model).max_batch_size) if not on_gpu else 1
    for start in range(0, len(paths), size):
        chunk = paths[start : start + size]
        try:
            results.update(zip(chunk, one([images[p] for p in chunk])))
            continue
        except (InferenceServerException, ValueError) as exc:
            if len(chunk) == 1:
                results[chunk[0]] = reason(exc)
                continue
        for path in chunk:
            try:
                results[path] = one([images[path]])[0]
            except (InferenceServerException, ValueError) as exc:
                results[path] = reason(exc)
    return results


def decode_on_gpu(client, images: list[bytes]):
    """Pixels on this machine's GPU, preprocessed as the server's `preprocess` model would (its parameters and
    pixel type): what a client that decodes its own frames hands to `classify_pixels` over CUDA shared memory."""
    import torch

    from .stages import Preprocess

    if not torch.cuda.is_available():
        raise ValueError("--shared-memory cuda needs a CUDA GPU on this machine (the pixels are decoded on it)")
    params = {k: v.string_value for k, v in client.config("preprocess").parameters.items()}
    dtype = torch_dtype(client.input_datatype(PIXELS_MODEL, "PIXELS"))
    preprocess = Preprocess.from_parameters(torch.device("cuda", 0), dtype, params)
    (pixels,) = preprocess.batch([images])
    if isinstance(pixels, Exception):
        raise ValueError(f"cannot decode: {pixels}")
    return pixels
