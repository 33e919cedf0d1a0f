"""The ResNet compiled ahead of time (torch.export + AOTInductor): compiled once per key, cached on disk, loaded by
every resnet instance, restart and reload.

Compiling takes minutes (batch norm is folded into each convolution, Inductor fuses the ReLUs and residual adds and,
in `max-autotune`, times candidate kernels for every convolution on this GPU); loading the package (`.pt2`) takes
seconds and needs no compiler. `serve` compiles what is missing before tritonserver starts (`compile_for_serve`, in a
child process: a compiler's crash is not the server's), and the stage loads it (`load`); a stage that finds no
package, or cannot load one, runs eager with CUDA graphs and says why in one line.

The key (`Target.fields`) is everything the compiled code depends on: the weights' bytes, the variant, the class
count, the precision, the largest batch, the mode, the GPU's model and compute capability, and the torch, CUDA and
package-format versions. Another key is another file, so changed weights compile again and a stale package is never
loaded. A package is written whole and renamed into place, under a lock, so two processes never compile the same key
and no one reads half a file. A compile that fails leaves `<name>.failed` with the reason: the stage runs eager
until `compile --force` tries again.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import inspect
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .paths import cache_dir

FORMAT = 1  # what a package holds and how it is exported: a change here is a new key
MODES = ("max-autotune", "default", "off")
# Inductor's options per mode. Batch norm is folded into the convolutions before export (`export`).
INDUCTOR_OPTIONS = {"max-autotune": {"max_autotune": True}, "default": {}}
# What a first start waits for, said before it starts: resnet50 in max-autotune took 303 s to compile on an H100
EXPECTED = {"max-autotune": "about 5 min", "default": "a few minutes at most"}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
CACHE_ENV = "TRITON_COMPILE_CACHE"


def cache_root() -> Path:
    """Where packages live: $TRITON_COMPILE_CACHE (the container's named volume), else the user's cache."""
    return Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else cache_dir() / "compiled"


def file_digest(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def device_identity(device: torch.device) -> dict[str, str]:
    """The device's model and compute capability (GPUs of one model share a package); a CPU's architecture."""
    if device.type != "cuda":
        return {"gpu": f"CPU ({platform.machine()})", "capability": "cpu"}
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "capability": f"{props.major}.{props.minor}"}


@dataclass(frozen=True)
class Target:
    """One compiled model: what it is compiled from and for."""

    variant: str
    weights: Path
    dtype: torch.dtype
    max_batch_size: int
    num_classes: int
    mode: str = "max-autotune"
    image_size: int = 224

    def fields(self, device: torch.device) -> dict:
        """Everything the compiled code depends on (the weights by their bytes' digest)."""
        return {
            "format": FORMAT,
            "variant": self.variant,
            "weights_sha256": file_digest(self.weights),
            "num_classes": self.num_classes,
            "dtype": DTYPE_NAMES[self.dtype],
            "max_batch_size": self.max_batch_size,
            "image_size": self.image_size,
            "mode": self.mode,
            **device_identity(device),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        }

    def path(self, device: torch.device, fields: dict | None = None) -> Path:
        fields = fields or self.fields(device)
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        return cache_root() / f"{self.variant}-{fields['dtype']}-b{self.max_batch_size}-{digest}.pt2"

    def describe(self, device: torch.device) -> str:
        return (
            f"{self.variant} {DTYPE_NAMES[self.dtype]} for the {device_identity(device)['gpu']}, "
            f"batch 1-{self.max_batch_size}, {self.mode}"
        )

    def arguments(self) -> list[str]:
        """This target as the command line of `python -m {{ cookiecutter.package_name }}.compiled`."""
        return [
            f"--variant={self.variant}",
            f"--weights={self.weights}",
            f"--dtype={DTYPE_NAMES[self.dtype]}",
            f"--max-batch-size={self.max_batch_size}",
            f"--num-classes={self.num_classes}",
            f"--mode={self.mode}",
            f"--image-size={self.image_size}",
        ]


class _Logits(torch.nn.Module):
    """The model as the stage runs it: FP32 logits, whatever the precision inside."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixels).float()


def export(target: Target, device: torch.device) -> torch.export.ExportedProgram:
    """The model with batch norm folded into its convolutions, exported with a batch of 1 to max_batch_size."""
    from torch.fx.experimental.optimization import fuse

    from .stages import build_resnet

    model = fuse(build_resnet(target.variant, target.weights, target.num_classes))  # conv + batch norm: one conv
    model = _Logits(model).to(device, target.dtype, memory_format=torch.channels_last).eval()
    shape = (target.max_batch_size, 3, target.image_size, target.image_size)
    example = torch.zeros(shape, dtype=target.dtype, device=device).contiguous(memory_format=torch.channels_last)
    dynamic = None
    if target.max_batch_size > 1:
        dynamic = ({0: torch.export.Dim("batch", min=1, max=target.max_batch_size)},)
    with torch.no_grad():
        return torch.export.export(model, (example,), dynamic_shapes=dynamic)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock beside `path`, for as long as one process compiles it (another waits, then finds it)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def compile_package(target: Target, device: torch.device, force: bool = False) -> Path:
    """Compile `target` for `device` in this process, unless its package exists; return the package's path.

    Run it in a process of its own (`compile_for_serve`): loading a package in the process that compiled it crashed
    in torch 2.11, and a compiler that crashes must not take anything else with it. Until it ends well, a note says
    that it died: what a crash or a kill leaves behind (`failure`)."""
    from torch._inductor import aoti_compile_and_package

    fields = target.fields(device)
    path = target.path(device, fields)
    failed = path.with_suffix(".failed")
    with _locked(path):
        if path.is_file() and not force:
            return path
        failed.write_text("the compiler died (a crash or a kill) during an earlier compile\n")
        started = time.monotonic()
        try:
            program = export(target, device)
            exported = time.monotonic() - started
            with tempfile.TemporaryDirectory(dir=path.parent) as work:
                made = aoti_compile_and_package(
                    program,
                    package_path=str(Path(work) / path.name),
                    inductor_configs=INDUCTOR_OPTIONS[target.mode],
                )
                compiled_s = time.monotonic() - started
                checked = check_in_a_fresh_process(target, device, Path(made))
                os.replace(made, path)
        except Exception as exc:
            failed.write_text(f"{type(exc).__name__}: {exc}".splitlines()[0][:500] + "\n")
            raise
        except BaseException:  # Ctrl-C, or `serve` stopping: not the compiler's failure
            failed.unlink()
            raise
        fields |= {"export_s": round(exported, 1), "compile_s": round(compiled_s, 1), "check": checked}
        path.with_suffix(".json").write_text(json.dumps(fields, indent=2) + "\n")
        failed.unlink()
    return path


# The most a softmax score of the package may differ from the eager model's (the e2e tests' tolerance for fp16)
PARITY = 0.02


def check_in_a_fresh_process(target: Target, device: torch.device, package: Path) -> dict:
    """`check_package` in a process of its own, as a stage loads the package: a package that crashes the process
    that loads it, or answers otherwise than eager, is never put in place (ValueError, the reason)."""
    gpu = device.index or 0 if device.type == "cuda" else -1
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.compiled", f"--check={package}"]
    command += [*target.arguments(), f"--device={gpu}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        why = lines[-1] if lines else f"it ended with code {done.returncode}"
        raise ValueError(f"the package failed its check in a fresh process: {why[:300]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_package(target: Target, device: torch.device, package: Path) -> dict:
    """Load `package` as the stage does (captured as CUDA graphs on a GPU) and compare its softmax scores with the
    eager model's on the same random pixels, at batch 1 and at the largest; ValueError if they differ by more than
    PARITY. Returns the largest difference and whether the CUDA graphs were captured."""
    from .stages import Classifier

    stage = (target.variant, target.weights, device, target.dtype, target.max_batch_size)
    options = dict(num_classes=target.num_classes, image_size=target.image_size)
    graphs = Classifier(*stage, compiled=_load_package(package, device), **options)
    eager = Classifier(*stage, cuda_graphs=False, **options)
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for rows in sorted({1, target.max_batch_size}):
        pixels = torch.randn(rows, 3, target.image_size, target.image_size, generator=generator)
        pixels = pixels.to(device, eager.dtype)
        got, want = graphs(pixels).float().softmax(1), eager(pixels).float().softmax(1)
        worst = max(worst, float((got - want).abs().max()))
    if worst > PARITY:
        raise ValueError(f"its scores differ from the eager model's by up to {worst:.4f} (more than {PARITY})")
    return {"max_score_difference": round(worst, 5), "cuda_graphs": bool(graphs.graphs)}


def _load_package(path: Path, device: torch.device):
    from torch._inductor import aoti_load_package

    options = inspect.signature(aoti_load_package).parameters
    kwargs = {}
    if "run_single_threaded" in options:  # the stage captures it in CUDA graphs: no locking between threads
        kwargs["run_single_threaded"] = True
    if "device_index" in options and device.type == "cuda":
        kwargs["device_index"] = device.index or 0
    return aoti_load_package(str(path), **kwargs)


def failure(path: Path) -> str | None:
    """Why the last compile of this package failed, if it did and has not been tried again since."""
    failed = path.with_suffix(".failed")
    return (failed.read_text().strip() or "unknown error") if failed.is_file() else None


def targets(repository: Path | str) -> list[Target]:
    """What the resnet model's config asks to compile: one target per version with weights (none if `compile` is
    off). Its precision is its PIXELS input's."""
    from .model_repository import load_config, resnet_weight_files, tensor_datatype, torch_dtype

    resnet = Path(repository) / "resnet"
    if not (resnet / "config.pbtxt").is_file():  # a repository of the user's own, without the resnet model
        return []
    config = load_config(resnet)
    params = {key: value.string_value for key, value in config.parameters.items()}
    mode = params.get("compile", "off")
    if mode == "off":
        return []
    if mode not in MODES:
        raise ValueError(f"{resnet}/config.pbtxt: compile is {mode!r}; choose one of {', '.join(MODES)}")
    (pixels,) = [i for i in config.input if i.name == "PIXELS"]
    (logits,) = [o for o in config.output if o.name == "LOGITS"]
    dtype = torch_dtype(tensor_datatype(pixels))
    return [
        Target(params["variant"], weights, dtype, config.max_batch_size, logits.dims[0], mode, pixels.dims[-1])
        for weights in resnet_weight_files(repository)
        if weights.is_file()
    ]


def ensure_target(target: Target, device: torch.device, force: bool = False, log=print) -> Path | None:
    """The package for `target`: cached, or compiled now in this process, with a line that says which (and a line
    every half minute while it compiles); None after a line that says why, where there is none (`failure`)."""
    path = target.path(device)
    if path.is_file() and not force:
        log(f"compiled resnet: cached, {target.describe(device)} ({path})")
        return path
    if (reason := failure(path)) and not force:
        log(f"compiled resnet: not available ({reason}); eager with CUDA graphs. `compile --force` tries again")
        return None
    if not shutil.which(os.environ.get("CXX") or "g++"):  # not a failure to keep: a compiler installed next fixes it
        log("compiled resnet: not available (no C++ compiler here: install g++); eager with CUDA graphs")
        return None
    expected = EXPECTED[target.mode]
    log(f"compiling resnet ({target.describe(device)}): {expected}, cached for the next start in {path.parent}")
    started = time.monotonic()
    try:
        with _heartbeat(log, started):
            compile_package(target, device, force=force)
    except Exception as exc:
        log(f"compiled resnet: not available ({failure(path) or exc}); eager with CUDA graphs")
        return None
    log(f"compiled resnet in {time.monotonic() - started:.0f} s")
    return path


def ensure(repository: Path | str, device: torch.device, force: bool = False, log=print) -> list[Path]:
    """`ensure_target` for every package the repository asks for (`targets`)."""
    return [path for target in targets(repository) if (path := ensure_target(target, device, force, log))]


@contextlib.contextmanager
def _heartbeat(log, started: float, every_s: float = 30):
    """A line every `every_s` while a compile runs (Inductor itself says nothing for minutes)."""
    import threading

    done = threading.Event()

    def beat():
        while not done.wait(every_s):
            log(f"  still compiling resnet: {time.monotonic() - started:.0f} s")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def compile_for_serve(repository: Path | str, gpus: list[int], force: bool = False) -> int:
    """What `serve` (and `compile`) runs before tritonserver starts: `ensure` on each GPU, each in a child process,
    so that neither a compiler's crash nor a CUDA context stays with the caller. Its lines show here."""
    if not gpus or not targets(repository):
        return 0
    code = 0
    for gpu in gpus:  # GPUs of one model share a package: the second finds it cached
        command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.compiled", f"--repository={repository}"]
        command += [f"--device={gpu}"] + (["--force"] if force else [])
        child = subprocess.Popen(command)
        try:
            returncode = child.wait()
        except KeyboardInterrupt:  # stopping: the child ends as after a Ctrl-C (no note that it crashed)
            child.send_signal(signal.SIGINT)
            child.wait()
            raise
        if returncode != 0:
            print(f"compiled resnet: the compile on GPU {gpu} ended with code {returncode}; eager with CUDA graphs")
            code = returncode
    return code


def load(target: Target, device: torch.device):
    """(the package's model, what was loaded) where one is cached for `target` on `device`, else (None, the one line
    that says why the stage runs eager)."""
    if target.mode == "off":
        return None, "eager (compile is off)"
    path = target.path(device)
    if not path.is_file():
        reason = failure(path) or f"no package for these weights on this GPU yet ({path.name})"
        return None, f"eager, not compiled: {reason}; `serve` compiles it at start, `compile --force` tries again"
    try:
        return _load_package(path, device), f"compiled ({target.mode}): {path}"
    except Exception as exc:  # a package from another build of torch, a corrupt file
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__
        return None, f"eager, not compiled: {path.name} did not load ({why})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compile the resnet packages a model repository asks for")
    parser.add_argument("--repository", type=Path, help="compile what its resnet config asks for (`ensure`)")
    parser.add_argument("--device", type=int, default=0, help="the GPU; -1: the CPU")
    parser.add_argument("--force", action="store_true", help="compile again, also what is cached or failed")
    parser.add_argument("--check", type=Path, metavar="PACKAGE", help="check one package (`check_package`)")
    for name in ("variant", "weights", "dtype", "max-batch-size", "num-classes", "mode", "image-size"):
        parser.add_argument(f"--{name}")  # the target of --check (Target.arguments)
    args = parser.parse_args(argv)
    device = torch.device("cuda", args.device) if args.device >= 0 else torch.device("cpu")
    if args.check:
        dtype = {name: dtype for dtype, name in DTYPE_NAMES.items()}[args.dtype]
        sizes = int(args.max_batch_size), int(args.num_classes)
        target = Target(args.variant, Path(args.weights), dtype, *sizes, args.mode, int(args.image_size))
        print(json.dumps(check_package(target, device, args.check)), flush=True)
        return 0
    ensure(args.repository, device, args.force, log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
