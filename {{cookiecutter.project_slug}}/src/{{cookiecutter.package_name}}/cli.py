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


def health(args) -> int:
    """Exit 0 only if the server is ready and the pipeline answers a real request (a dead stub fails it)."""
    from .health import probe

    error = probe(args.url, args.model, timeout_s=args.timeout)
    print(f"unhealthy: {error}" if error else "healthy")
    return 1 if error else 0


def classify(args) -> int:
    from .client import ImageClassifier

    client = ImageClassifier(args.url, args.model)
    images = [Path(p).read_bytes() for p in args.images]
    parameters = dict(args.param)
    for path, predictions in zip(args.images, client.classify(images, parameters or None)):
        print(path)
        for p in predictions:
            print(f"  {p.score:7.4f}  {p.class_id:4d}  {p.label}")
    return 0


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not key or not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


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
        help="use /opt/tritonserver (default: when it exists) instead of the nvidia-pytriton wheel",
    )
    p.add_argument("--address", help="listen address (default: 127.0.0.1 locally, 0.0.0.0 in the container)")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the models to load")
    p.add_argument(
        "--watchdog-interval", type=float, default=10, help="seconds between stub health probes (0: no watchdog)"
    )
    p.add_argument("--print-flags", action="store_true", help="print the tritonserver flags, one per line, and exit")
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
