"""`{{ cookiecutter.project_slug }}`: serve the model repository, classify images, write weights."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPOSITORY = Path("model_repository")


def serve(args) -> int:
    """Run tritonserver on the model repository until Ctrl-C (serving.py)."""
    from .serving import serve

    return serve(args)


def plan(args) -> int:
    """The instance counts `serve` would start, and what they hold, without starting anything."""
    from . import sizing
    from .machine import visible_gpus
    from .serving import gpu_memory, instances

    try:
        cap, gpus = gpu_memory(args), visible_gpus()
        if args.gpus is not None or (not gpus and cap is not None):  # GPUs described (--gpus, or one), not found
            if not isinstance(cap, int):
                raise ValueError("give --gpu-memory as a size (16GiB): there is no GPU here to take a fraction of")
            count = 1 if args.gpus is None else args.gpus
            devices = [sizing.Device(i, args.gpu_name, cap, cap, hypothetical=True) for i in range(count)]
            plans = sizing.plan(args.model_repository, devices, cap, instances(args), mps=args.mps)
        else:
            plans = sizing.plan_for_serve(args.model_repository, gpus, cap, instances(args), args.mps)
    except (sizing.NothingFits, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"devices": [p.as_json() for p in plans]}, indent=2))
    else:
        for device_plan in plans:
            print(device_plan.line())
    return 0


def reload(args) -> int:
    """Load a model again from its files: a new version, an edited config.pbtxt or model.py goes live, with the
    instance count `serve` sized (its sized config is written again first); the old version serves until the new
    one is ready."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from . import admin_key, sized
    from .admin_key import ADMIN_KEY_HEADER

    key, _ = admin_key.find()
    if not key:
        return fail(f"reload uses the server's admin APIs: set {admin_key.ENV}, or run it where `serve` keeps the key")
    port = args.url.rsplit(":", 1)[-1]
    if port.isdigit():
        sized.sync_configs(args.model_repository, sized.config_name(int(port)))
    try:
        with grpcclient.InferenceServerClient(args.url) as client:
            client.load_model(args.model, headers={ADMIN_KEY_HEADER: key})
            config = client.get_model_config(args.model).config
    except InferenceServerException as exc:
        return fail(f"{args.model}: {(exc.message() or str(exc)).strip()}")
    count = sum(g.count for g in config.instance_group)
    print(f"reloaded {args.model}" + (f" ({count} instances)" if count else ""))
    return 0


def health(args) -> int:
    """Exit 0 only if the server is ready and the pipeline answers a real request (a dead stub fails it), or refuses
    it for overload: busy is not broken, and a readiness probe that failed then would take every pod out at once."""
    from . import sized
    from .health import busy, probe
    from .restarts import summary

    error = probe(args.url, args.model, timeout_s=args.timeout)
    if error and busy(error):
        print(f"healthy, busy: {error}")
        error = None
    else:
        print(f"unhealthy: {error}" if error else "healthy")
    port = args.url.rsplit(":", 1)[-1]
    if port.isdigit() and (counts := sized.summary(int(port))):  # a `serve` of this host serves that port
        print(counts)
    if port.isdigit() and (restarts := summary(int(port))):
        print(restarts)
    return 1 if error else 0


def classify(args) -> int:
    """One row per image (its best class, the rest of its top-k beneath), `error: <file>: <reason>` on stderr for
    one that could not be classified while the others still print; exit 1 if any failed, 2 if none could be
    sent (no server, no admin key, a rejected key). --json: one JSON array on stdout instead. When no file can be
    read at all, that is the error: no server is asked."""
    from tritonclient.utils import InferenceServerException

    from . import admin_key
    from .client import AdminKeyError, ImageClassifier, classify_each

    images, outcome = {}, {}  # path -> bytes; path -> [Prediction, ...] or the reason it failed
    for path in args.images:
        try:
            images[path] = Path(path).read_bytes()
        except FileNotFoundError:
            outcome[path] = "no such file"
        except IsADirectoryError:
            outcome[path] = "is a directory, not an image"
        except OSError as exc:
            outcome[path] = (exc.strerror or str(exc)).lower()
    if not images:  # every path is wrong: that, not the server, is what to fix first
        return report(args, outcome)
    if args.shared_memory and not admin_key.find()[0]:  # the client looks it up the same way
        return fail(
            f"--shared-memory uses the server's admin APIs and needs its admin key: set {admin_key.ENV}, or run "
            f"this on the host where `{{ cookiecutter.project_slug }} serve` keeps it ({admin_key.key_file()})"
        )
    try:
        client = ImageClassifier(args.url, args.model, shared_memory=args.shared_memory)
    except AdminKeyError as exc:
        return fail(str(exc))
    except InferenceServerException as exc:
        return fail(unreachable(args.url, exc))
    with client:
        try:
            if not client.is_live():
                return fail(f"the server at {args.url} is not live")
        except InferenceServerException as exc:
            return fail(unreachable(args.url, exc))
        try:
            if not client.is_ready(args.model):
                return fail(not_ready(args.url, args.model))
            outcome |= classify_each(client, images, dict(args.param) or None, args.shared_memory == "cuda")
        except InferenceServerException as exc:  # the model went away between the calls
            return fail(f"{not_ready(args.url, args.model)} ({(exc.message() or str(exc)).splitlines()[0]})")
    return report(args, outcome)


def not_ready(url: str, model: str) -> str:
    return (
        f"the server at {url} has no model {model!r} ready: `{{ cookiecutter.project_slug }} health` lists the "
        f"models that are, `{{ cookiecutter.project_slug }} reload {model}` loads it again"
    )


def report(args, outcome: dict) -> int:
    """Print each image's predictions or error, in the order given; exit 1 if any failed."""
    ordered = [(path, outcome[path]) for path in dict.fromkeys(args.images)]
    if args.json:
        print(json.dumps([as_json(path, result) for path, result in ordered], indent=2))
    else:
        print_table(ordered)
    return 1 if any(isinstance(result, str) for _, result in ordered) else 0


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def unreachable(url: str, exc) -> str:
    reason = (exc.message() or str(exc)).splitlines()[0]
    return f"no server answers at {url} ({reason}): start one with `{{ cookiecutter.project_slug }} serve`, or pass --url"


HEADER = ("score", "class id", "label")


def print_table(rows: list[tuple[str, object]]) -> None:
    """image | score | class id | label; the image's name on its best class, its other top-k rows beneath."""
    width = max([len("image"), *(len(path) for path, result in rows if not isinstance(result, str))])
    header = False
    for path, result in rows:
        if isinstance(result, str):
            print(f"error: {path}: {result}", file=sys.stderr, flush=True)
            continue
        if not header:
            print(f"{'image':{width}s}  {HEADER[0]:>7s}  {HEADER[1]:>8s}  {HEADER[2]}")
            header = True
        for rank, p in enumerate(result):
            print(f"{path if rank == 0 else '':{width}s}  {p.score:7.4f}  {p.class_id:8d}  {p.label}", flush=True)


def as_json(path: str, result) -> dict:
    if isinstance(result, str):
        return {"image": path, "error": result}
    return {
        "image": path,
        "predictions": [{"score": p.score, "class_id": p.class_id, "label": p.label} for p in result],
    }


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not key or not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def compile_resnet(args) -> int:
    """Compile the resnet models the repository asks for now, on each GPU, into their cache (serve does it at start)."""
    from .compiled import compile_for_serve
    from .machine import visible_gpus

    gpus = visible_gpus()
    if not gpus:
        print("no GPU here: the resnet stage runs eager on the CPU, with nothing to compile")
        return 0
    return compile_for_serve(args.model_repository, gpus, force=args.force)


def weights(args) -> int:
    import contextlib

    from . import weights as w

    variant, others = getattr(args, "variant", None), []
    try:
        if args.source == "import":
            done = w.import_weights(args.model_repository, args.path, args.labels, variant, args.top_k, args.version)
        else:
            from .model_repository import labels_path, num_classes, resnet_weights
            from .stages import read_labels

            variant, labels = resnet_weights(args.model_repository)[0], None
            if args.source == "pretrained":  # ImageNet's weights: its 1000 classes and labels
                state = w.pretrained_state(variant)
            elif args.imagenet:
                state = w.random_state(variant, args.seed)
            else:  # the classes and labels the repository has (yours, after `weights import`), kept as they are
                classes = num_classes(args.model_repository)
                state = w.random_state(variant, args.seed, classes)
                with contextlib.suppress(OSError, ValueError):
                    labels = read_labels(labels_path(args.model_repository))
                if labels is not None and len(labels) != classes:
                    labels = None
            done = w.install(args.model_repository, state, variant, labels)
            if args.source == "random" and not args.imagenet:  # other versions (recipe 3) without weights: theirs
                others = w.write_random_versions(args.model_repository, args.seed, only_missing=True)
    except w.WeightsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.source == "import":
        what = f"imported {done.variant} weights from {args.path}"
    else:
        what = f"wrote {args.source} {done.variant} weights"
    if others:
        print(f"wrote random {done.variant} weights for the other versions: {', '.join(map(str, others))}")
    print(
        f"{what} ({done.classes} classes, top-{done.top_k}): {done.weights}, labels {done.labels}; "
        "(re)start `serve` to use them"
    )
    return 0


def add_serve(commands) -> None:
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
        "--watchdog-interval",
        type=float,
        default=10,
        help="seconds between probes of the pipeline; stub processes are watched every second (0: no watchdog)",
    )
    p.add_argument(
        "--mps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA MPS on the GPUs: a private daemon for this run, so that the stubs' kernels run concurrently "
        "(default: on wherever there is a GPU; --no-mps: off)",
    )
    p.add_argument(
        "--verbose", action="store_true", help="also show tritonserver's own log here (it is always in --log-file)"
    )
    p.add_argument(
        "--log-file",
        type=Path,
        help="where tritonserver's log goes (default: ~/.cache/{{ cookiecutter.project_slug }}/tritonserver-<gRPC port>.log)",
    )
    p.add_argument(
        "--new-admin-key",
        action="store_true",
        help="rotate the admin key: write a new one to its file before starting (clients of the old one are refused)",
    )
    p.add_argument(
        "--trace",
        metavar="URL|FILE",
        help="trace requests, a pipeline request's three stage calls beneath it: to an OpenTelemetry collector "
        "(http://collector:4318/v1/traces), or as Triton's JSON to a file, written as the server stops "
        "($TRITON_TRACE; default: off)",
    )
    p.add_argument("--trace-rate", type=int, default=1, help="with --trace: trace every Nth request (default: 1)")
    add_sizing(p)
    p.add_argument("--print-flags", action="store_true", help="print the tritonserver flags, one per line, and exit")
    p.add_argument(
        "--print-shm", action="store_true", help="print how much /dev/shm the Python-backend stubs need, and exit"
    )
    p.set_defaults(run=serve)


def add_sizing(p) -> None:
    """The flags `serve` and `plan` share: the budget and the pinned counts."""
    p.add_argument(
        "--gpu-memory",
        metavar="SIZE|FRACTION",
        help="cap each GPU's budget, for a GPU shared with other work: a size (16GiB) or a fraction of the GPU (0.5); "
        "default: its free memory ($TRITON_GPU_MEMORY)",
    )
    p.add_argument(
        "--instances",
        nargs="+",
        metavar="MODEL=N",
        help="pin these counts as given (per GPU); the other models are sized to the budget, the configs' counts "
        "the ceiling ($TRITON_INSTANCES: pipeline=8,preprocess=2)",
    )


def add_plan(commands) -> None:
    p = commands.add_parser(
        "plan", help="print the instance counts serve would start for a budget and the memory they take; start nothing"
    )
    p.add_argument("--model-repository", type=Path, default=REPOSITORY)
    add_sizing(p)
    p.add_argument("--gpus", type=int, help="plan for this many GPUs of --gpu-memory each instead of this machine's")
    p.add_argument("--gpu-name", default="unknown GPU", help="the GPUs' name, with --gpus or on a host without one")
    p.add_argument("--mps", action=argparse.BooleanOptionalAction, default=True, help="count MPS's 48 clients")
    p.add_argument("--json", action="store_true", help="per GPU: budget_bytes, counts, estimated_bytes, ...")
    p.set_defaults(run=plan)


def add_reload(commands) -> None:
    from .client import DEFAULT_URL

    p = commands.add_parser(
        "reload", help="load a model again from its files (a new version, config or model.py), counts kept"
    )
    p.add_argument("model", nargs="?", default="pipeline")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--model-repository", type=Path, default=REPOSITORY)
    p.set_defaults(run=reload)


def add_health(commands) -> None:
    from .client import DEFAULT_URL

    p = commands.add_parser("health", help="one small real inference; exit 0 if it is answered")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--model", default="pipeline")
    p.add_argument("--timeout", type=float, default=30)
    p.set_defaults(run=health)


def add_classify(commands) -> None:
    from .client import DEFAULT_URL

    p = commands.add_parser("classify", help="send images over gRPC and print the top-k classes")
    p.add_argument("images", nargs="+")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--model", default="pipeline", help="pipeline (BLS) or ensemble")
    p.add_argument(
        "--param", type=key_value, action="append", default=[], metavar="KEY=VALUE", help="a request parameter"
    )
    p.add_argument(
        "--shared-memory",
        choices=["system", "cuda"],
        help="same host only, needs the admin key (TRITON_ADMIN_KEY, else the file `serve` keeps it in). system: "
        "images and results through /dev/shm; "
        "cuda: decode on this machine's GPU, pixels to classify_pixels through CUDA shared memory",
    )
    p.add_argument("--json", action="store_true", help="print one JSON array (image, predictions or error) for scripts")
    p.set_defaults(run=classify)


def add_weights(commands) -> None:
    p = commands.add_parser("weights", help="write the ResNet weights, labels.txt and the configs that depend on them")
    sources = p.add_subparsers(dest="source", required=True)
    s = sources.add_parser("pretrained", help="torchvision's ImageNet weights (downloads them: needs internet)")
    s = sources.add_parser(
        "random", help="deterministic random weights for the configured classes and labels (yours once imported)"
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--imagenet", action="store_true", help="ImageNet's 1000 classes and labels instead (config too)")
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


def add_compile(commands) -> None:
    p = commands.add_parser(
        "compile", help="compile the ResNet for this GPU now (serve does it at start when it is not cached)"
    )
    p.add_argument("--model-repository", type=Path, default=REPOSITORY)
    p.add_argument("--force", action="store_true", help="compile again, also what is cached or failed before")
    p.set_defaults(run=compile_resnet)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="{{ cookiecutter.project_slug }}", description=__doc__)
    commands = parser.add_subparsers(required=True)
    for add in (add_serve, add_plan, add_health, add_classify, add_reload, add_weights, add_compile):
        add(commands)
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress shows up at once, also in container logs
    try:
        return args.run(args)
    except BrokenPipeError:  # `... | head`: the reader stopped reading; no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
