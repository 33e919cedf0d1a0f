"""The ResNet compiled for this GPU (torch.compile, Inductor): compiled once per key into a cache on disk, from which
every resnet instance, restart and reload compiles in seconds instead of minutes.

Measured on an H100 (resnet50, fp16, batch 128, torch 2.11, one process): eager 12.1k images/s, compiled 24.3k,
compiled and captured as a CUDA graph (as the stage runs it) 25.0k. Batch norm is folded into each convolution first;
Inductor fuses the ReLUs and residual adds. The first compile of one batch size took 19 s, the same from the cache
4.4 s. Ahead-of-time compiling (torch.export + AOTInductor, a `.pt2` loaded without a compiler) was tried first:
on that H100 every load of its package crashed the process that loaded it (SIGSEGV in `aoti_load_package`, with or
without `run_single_threaded` or `device_index`), so the stage compiles in process from a warm cache instead.

`serve` fills the cache before tritonserver starts (`compile_for_serve`: a child process per GPU, so that neither a
compiler's crash nor a CUDA context stays with it): every batch size the stage runs (`resnet.batch_buckets`),
checked against the eager model (`PARITY`), then `ready.json`. A stage whose key has `ready.json` compiles from that
cache (Inductor's and Triton's caches, both inside the key's folder); one without it runs eager with CUDA graphs and
says why in one line.

The key (`Target.fields`) is everything the compiled code depends on: the weights' bytes, the variant, the class
count, the precision, the largest batch, the mode, the GPU's model and compute capability, and the torch and CUDA
versions. Another key is another folder, so changed weights compile again and a stale entry is never used. One
process fills a key at a time (a lock); a compile that fails leaves `<key>.failed` with the reason, and the stage
runs eager until `compile --force` tries again.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .paths import cache_dir

FORMAT = 2  # how the model is compiled (torch.compile from a cache folder): a change here is a new key
MODES = ("default", "max-autotune", "off")
# torch.compile's mode per config mode: the stage captures its own CUDA graphs, one per batch size (`Classifier`)
TORCH_MODES = {"default": "default", "max-autotune": "max-autotune-no-cudagraphs"}
# What a first start waits for, said before it starts: one batch size of resnet50 took 19 s in `default` on an H100
EXPECTED = {"default": "about 20 s a batch size", "max-autotune": "minutes a batch size (it times kernels)"}
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
        return cache_root() / f"{self.variant}-{fields['dtype']}-b{self.max_batch_size}-{digest}"

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


def use_cache(path: Path) -> None:
    """Point this process's Inductor and Triton caches into the key's folder `path` (read at each compile)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")


def compile_model(target: Target, device: torch.device, path: Path) -> torch.nn.Module:
    """The model with batch norm folded into its convolutions, compiled by torch.compile from the cache in `path`
    (the key's folder, `target.path`): it compiles (or finds in the cache) each batch size at its first call, one
    graph per size (`dynamic=False`)."""
    from torch.fx.experimental.optimization import fuse

    from .resnet import batch_buckets, build_resnet

    use_cache(path)
    sizes = len(batch_buckets(target.max_batch_size))
    for limit in ("recompile_limit", "cache_size_limit"):  # one compiled graph per batch size, never eager beyond 8
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), sizes + 1))
    memory_format = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    model = fuse(build_resnet(target.variant, target.weights, target.num_classes))  # conv + batch norm: one conv
    model = _Logits(model).to(device, target.dtype, memory_format=memory_format).eval()
    return torch.compile(model, mode=TORCH_MODES[target.mode], dynamic=False)


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


def ready(path: Path) -> Path:
    """The note that the key's folder `path` holds every batch size, checked: written last, read by the stages."""
    return path / "ready.json"


def warm(target: Target, device: torch.device, force: bool = False) -> Path:
    """Compile `target` for `device` into its key's folder, unless it is ready; return the folder.

    Every batch size the stage runs, in this process, as the stage runs them (captured as CUDA graphs on a GPU),
    then their scores against the eager model's (`check`). Until it ends well, a note says that it died: what a
    crash or a kill leaves behind (`failure`)."""
    from .resnet import Classifier

    fields = target.fields(device)
    path = target.path(device, fields)
    failed = path.with_suffix(".failed")
    with _locked(path):
        if ready(path).is_file() and not force:
            return path
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        ready(path).unlink(missing_ok=True)
        failed.write_text("the compiler died (a crash or a kill) during an earlier compile\n")
        started = time.monotonic()
        try:
            model = compile_model(target, device, path)
            stage = Classifier(*_stage(target, device), compiled=model, **_options(target))
            for size in stage.buckets:  # on a CPU nothing is captured: each size compiles at its first call
                stage(torch.zeros(size, 3, target.image_size, target.image_size, dtype=stage.dtype, device=device))
            compiled_s = time.monotonic() - started
            checked = check(target, device, stage)
        except Exception as exc:
            failed.write_text(f"{type(exc).__name__}: {exc}".splitlines()[0][:500] + "\n")
            raise
        except BaseException:  # Ctrl-C, or `serve` stopping: not the compiler's failure
            failed.unlink()
            raise
        fields |= {"compile_s": round(compiled_s, 1), "load_report": stage.load_report, "check": checked}
        written = path / "ready.json.part"
        written.write_text(json.dumps(fields, indent=2) + "\n")
        os.replace(written, ready(path))
        failed.unlink()
    return path


def _stage(target: Target, device: torch.device) -> tuple:
    return target.variant, target.weights, device, target.dtype, target.max_batch_size


def _options(target: Target) -> dict:
    return {"num_classes": target.num_classes, "image_size": target.image_size}


# The most a softmax score of the compiled model may differ from the eager model's (the e2e tests' fp16 tolerance)
PARITY = 0.02


def check(target: Target, device: torch.device, stage) -> dict:
    """`stage` (a Classifier of the compiled model) against the eager model on the same random pixels, at batch 1
    and at the largest: ValueError if a softmax score differs by more than PARITY. Returns the largest difference
    and whether the CUDA graphs were captured."""
    from .resnet import Classifier

    eager = Classifier(*_stage(target, device), cuda_graphs=False, **_options(target))
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for rows in sorted({1, target.max_batch_size}):
        pixels = torch.randn(rows, 3, target.image_size, target.image_size, generator=generator)
        pixels = pixels.to(device, eager.dtype)
        got, want = stage(pixels).float().softmax(1), eager(pixels).float().softmax(1)
        worst = max(worst, float((got - want).abs().max()))
    if worst > PARITY:
        raise ValueError(f"its scores differ from the eager model's by up to {worst:.4f} (more than {PARITY})")
    return {"max_score_difference": round(worst, 5), "cuda_graphs": bool(stage.graphs)}


def failure(path: Path) -> str | None:
    """Why the last compile of this key failed, if it did and has not been tried again since."""
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
    """The key's folder for `target`: ready, or compiled now in this process, with a line that says which (and a
    line every half minute while it compiles); None after a line that says why, where there is none (`failure`)."""
    path = target.path(device)
    if ready(path).is_file() and not force:
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
            warm(target, device, force=force)
    except Exception as exc:
        log(f"compiled resnet: not available ({failure(path) or exc}); eager with CUDA graphs")
        return None
    log(f"compiled resnet in {time.monotonic() - started:.0f} s")
    return path


def ensure(repository: Path | str, device: torch.device, force: bool = False, log=print) -> list[Path]:
    """`ensure_target` for every key the repository asks for (`targets`)."""
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
    for gpu in gpus:  # GPUs of one model share a key: the second finds it ready
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
    """(the compiled model, what was loaded) where the cache is ready for `target` on `device`, else (None, the one
    line that says why the stage runs eager). The model compiles from the cache at its first calls."""
    if target.mode == "off":
        return None, "eager (compile is off)"
    path = target.path(device)
    if not ready(path).is_file():
        reason = failure(path) or f"not compiled for these weights on this GPU yet ({path.name})"
        return None, f"eager, not compiled: {reason}; `serve` compiles it at start, `compile --force` tries again"
    try:
        return compile_model(target, device, path), f"compiled ({target.mode}), cached in {path}"
    except Exception as exc:  # weights that no longer build the model
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__
        return None, f"eager, not compiled: {why}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compile the resnet models a model repository asks for")
    parser.add_argument("--repository", type=Path, required=True, help="compile what its resnet config asks for")
    parser.add_argument("--device", type=int, default=0, help="the GPU; -1: the CPU")
    parser.add_argument("--force", action="store_true", help="compile again, also what is ready or failed")
    args = parser.parse_args(argv)
    device = torch.device("cuda", args.device) if args.device >= 0 else torch.device("cpu")
    ensure(args.repository, device, args.force, log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
