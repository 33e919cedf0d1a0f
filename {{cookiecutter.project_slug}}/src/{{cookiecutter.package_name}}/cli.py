"""`{{ cookiecutter.project_slug }}`: serve the model repository, classify images, write weights."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

REPOSITORY = Path("model_repository")


def serve(args) -> int:
    from .health import StubWatchdog
    from .server import CONTAINER_TRITONSERVER, ServerSettings, TritonServer, print_model_states, server_flags

    container = CONTAINER_TRITONSERVER.is_dir() if args.container is None else args.container
    address = args.address or ("0.0.0.0" if container else "127.0.0.1")
    settings = ServerSettings(args.model_repository, args.http_port, args.grpc_port, args.metrics_port, address=address)
    if args.print_flags:
        print("\n".join(server_flags(settings)))
        return 0
    if args.print_shm:
        print_shm_need(settings.model_repository)
        return 0
    check_dev_shm(settings.model_repository)
    # SIGTERM (docker stop) and SIGHUP (terminal closed) take the Ctrl-C path below. Stopping inside a handler
    # deadlocked: its Popen.wait() cannot reap while the interrupted outer wait() holds Popen's wait lock.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.default_int_handler)
    print(f"starting tritonserver on {settings.model_repository} (GPUs: {settings.gpus or 'none, CPU only'})")
    server = TritonServer(settings, container=container).start()
    watchdog = StubWatchdog(server.grpc_url, settings.admin_headers, interval_s=args.watchdog_interval)
    try:
        server.wait_ready(args.timeout, progress=print_model_states)
        print(
            f"ready.  gRPC localhost:{settings.grpc_port}   HTTP http://localhost:{settings.http_port}"
            f"   metrics http://localhost:{settings.metrics_port}/metrics   (Ctrl-C stops)"
        )
        if not os.environ.get("TRITON_ADMIN_KEY"):
            print(f"admin APIs (model load/unload, statistics, ...) need the key {settings.admin_key}")
        if args.watchdog_interval > 0:
            watchdog.start()
        server.process.wait()
    except KeyboardInterrupt:
        print("stopping (in-flight requests finish first)...")
    finally:
        watchdog.stop()  # no reloads while the server drains and stops
        returncode = server.stop()  # the exit code, also when the server had already exited
    return returncode or 0


def print_shm_need(repository: Path) -> int:
    """The /dev/shm the Python-backend stubs of `repository` can grow to (server.dev_shm_bytes), per model."""
    from .server import MiB, dev_shm_bytes

    need = dev_shm_bytes(repository)
    for model, (stubs, per_stub) in need.items():
        print(f"{model:12s} {stubs} stub(s) x {per_stub // MiB} MiB")
    total = sum(stubs * per_stub for stubs, per_stub in need.values())
    print(f"total        {total // MiB} MiB  (+ the regions of same-host shared-memory clients)")
    return total


def check_dev_shm(repository: Path) -> None:
    import shutil

    from .server import MiB, dev_shm_bytes

    need = sum(stubs * per_stub for stubs, per_stub in dev_shm_bytes(repository).values())
    size = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").is_dir() else 0
    if size < need:
        print(
            f"warning: /dev/shm is {size // MiB} MiB; at full batches the Python-backend stubs can use {need // MiB} "
            "MiB, and a request that does not fit fails (raise shm_size / TRITON_SHM_SIZE; serve --print-shm)"
        )


def health(args) -> int:
    """Exit 0 only if the server is ready and the pipeline answers a real request (a dead stub fails it)."""
    from .health import probe

    error = probe(args.url, args.model, timeout_s=args.timeout)
    print(f"unhealthy: {error}" if error else "healthy")
    return 1 if error else 0


def classify(args) -> int:
    from .client import ImageClassifier

    images = [Path(p).read_bytes() for p in args.images]
    try:
        client = ImageClassifier(args.url, args.model, shared_memory=args.shared_memory)
    except ValueError as exc:  # no admin key
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with client:
        if args.shared_memory == "cuda":
            results = client.classify_pixels(decode_on_gpu(client, images))
        else:
            results = client.classify(images, dict(args.param) or None)
    for path, predictions in zip(args.images, results):
        print(path)
        for p in predictions:
            print(f"  {p.score:7.4f}  {p.class_id:4d}  {p.label}")
    return 0


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not key or not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def decode_on_gpu(client, images: list[bytes]):
    """Pixels on this machine's GPU, preprocessed as the server's `preprocess` model would (its parameters and
    pixel type): what a client that decodes its own frames hands to `classify_pixels` over CUDA shared memory."""
    import torch

    from .stages import Preprocess

    if not torch.cuda.is_available():
        raise SystemExit("--shared-memory cuda needs a CUDA GPU on this machine (the pixels are decoded on it)")
    params = {k: v.string_value for k, v in client.client.get_model_config("preprocess").config.parameters.items()}
    dtype = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}[
        client._input_datatype("classify_pixels", "PIXELS")
    ]
    preprocess = Preprocess(
        torch.device("cuda", 0),
        dtype,
        resize=int(params["resize"]),
        crop=int(params["crop"]),
        max_pixels=int(params["max_image_pixels"]),
    )
    (pixels,) = preprocess.batch([images])
    if isinstance(pixels, Exception):
        raise SystemExit(f"cannot decode: {pixels}")
    return pixels


def weights(args) -> int:
    from . import weights as w

    variant = getattr(args, "variant", None)
    try:
        if args.source == "import":
            done = w.import_weights(args.model_repository, args.path, args.labels, variant, args.top_k, args.version)
        else:
            from .model_repository import resnet_weights

            variant = resnet_weights(args.model_repository)[0]
            state = w.pretrained_state(variant) if args.source == "pretrained" else w.random_state(variant, args.seed)
            done = w.install(args.model_repository, state, variant)
    except w.WeightsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.source} {done.variant} weights ({done.classes} classes, top-{done.top_k}) to {done.weights}, "
        f"labels to {done.labels}; (re)start `serve` to use them"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="{{ cookiecutter.project_slug }}", description=__doc__)
    commands = parser.add_subparsers(required=True)

    p = commands.add_parser("serve", help="run Triton on the model repository until Ctrl-C")
    p.add_argument("--model-repository", type=Path, default=REPOSITORY)
    p.add_argument("--http-port", type=int, default={{ cookiecutter.http_port }})
    p.add_argument("--grpc-port", type=int, default={{ cookiecutter.grpc_port }})
    p.add_argument("--metrics-port", type=int, default={{ cookiecutter.metrics_port }})
    p.add_argument(
        "--container",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="in a container: listen on every interface and use the image's /opt/tritonserver where it has one "
        "(the NGC image), else the nvidia-pytriton wheel's (default: when /opt/tritonserver exists)",
    )
    p.add_argument("--address", help="listen address (default: 127.0.0.1 locally, 0.0.0.0 in the container)")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the models to load")
    p.add_argument(
        "--watchdog-interval", type=float, default=10, help="seconds between stub health probes (0: no watchdog)"
    )
    p.add_argument("--print-flags", action="store_true", help="print the tritonserver flags, one per line, and exit")
    p.add_argument(
        "--print-shm", action="store_true", help="print how much /dev/shm the Python-backend stubs need, and exit"
    )
    p.set_defaults(run=serve)

    p = commands.add_parser("health", help="one small real inference; exit 0 if it is answered")
    p.add_argument("--url", default="localhost:{{ cookiecutter.grpc_port }}")
    p.add_argument("--model", default="pipeline")
    p.add_argument("--timeout", type=float, default=30)
    p.set_defaults(run=health)

    p = commands.add_parser("classify", help="send images over gRPC and print the top-k classes")
    p.add_argument("images", nargs="+")
    p.add_argument("--url", default="localhost:{{ cookiecutter.grpc_port }}")
    p.add_argument("--model", default="pipeline", help="pipeline (BLS) or ensemble")
    p.add_argument(
        "--param", type=key_value, action="append", default=[], metavar="KEY=VALUE", help="a request parameter"
    )
    p.add_argument(
        "--shared-memory",
        choices=["system", "cuda"],
        help="same host only, needs TRITON_ADMIN_KEY. system: images and results through /dev/shm; "
        "cuda: decode on this machine's GPU, pixels to classify_pixels through CUDA shared memory",
    )
    p.set_defaults(run=classify)

    p = commands.add_parser("weights", help="write the ResNet weights, labels.txt and the configs that depend on them")
    sources = p.add_subparsers(dest="source", required=True)
    s = sources.add_parser("pretrained", help="torchvision's ImageNet weights (downloads them: needs internet)")
    s = sources.add_parser("random", help="deterministic random ImageNet-shaped weights, offline")
    s.add_argument("--seed", type=int, default=0)
    s = sources.add_parser("import", help="your own torchvision ResNet state dict or training checkpoint")
    s.add_argument("path", type=Path, help="a .pt/.pth file: a state dict, or a checkpoint holding one")
    s.add_argument("--labels", type=Path, help="class names, one per line (default: class_0, ... or ImageNet's)")
    s.add_argument(
        "--variant",
        choices=["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"],
        help="the architecture (default: the configured one)",
    )
    s.add_argument("--top-k", type=int, help="classes returned per image (default: unchanged)")
    s.add_argument("--version", type=int, default=1, help="write resnet/VERSION (a canary or A/B version)")
    for s in sources.choices.values():
        s.add_argument("--model-repository", type=Path, default=REPOSITORY)
    p.set_defaults(run=weights)

    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress shows up at once, also in container logs
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
