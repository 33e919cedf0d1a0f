"""Instance counts sized to the machine `serve` starts on: the configs' counts are the ceiling, memory decides.

Every Python-backend instance is a process with its own CUDA context, so the counts that serve best on a large GPU
(the configs') do not start on a 16 GiB one. `serve` (locally, in the container, on Kubernetes) therefore plans the
counts first (`plan()`), from what it finds:

- the budget, per GPU: its free memory (nvidia-smi), capped by `--gpu-memory SIZE|FRACTION` ($TRITON_GPU_MEMORY),
  less a margin (`MARGIN`) for what the estimates miss;
- what each instance costs (`instance_bytes`): a CUDA context, plus what its stage holds (the preprocess stage's
  capped peak, the ResNet's weights, activations and workspace, ...). The figures were measured per process
  (NVML, under CUDA MPS, after load and under load) on an H100 at the default settings and scale with the configs
  (max batch size, precision, variant). A GPU it has never seen is costed as an H100: a context's fixed part grows
  with the SM count, which a T4, L4 or A10G has fewer of. A model of your own costs a context and
  `OTHER_STAGE_BYTES`, or what its config's `instance_gpu_memory` parameter says ("1.5GiB");
- tritonserver itself: its context and the CUDA memory pool, which follows the counts (rules.cuda_pool_bytes);
- headroom for a reload (`reload_headroom`): a reload starts the new stubs before the old ones go, so the largest
  of the pipeline's hot reload and the watchdog's reload of a model whose stub died (the dead stub's memory is
  already free) must fit beside what runs. The watchdog then reloads the BLS models calling it, but only once that
  model's replaced stubs have ended (health.StubWatchdog.reload), so that reload is a caller's hot reload;
- CUDA MPS's 48 clients per GPU (the stubs, tritonserver and the new stubs of the reload that starts the most),
  and /dev/shm (each stub's region as it grows, shm.dev_shm_bytes, the largest reload's too).

The counts are the configs' scaled by one factor, rounded, at least one of each (a count you pinned with
`--instances MODEL=N` or $TRITON_INSTANCES is kept as given): the largest factor at which everything above fits.
So the configs' proportions stay, and more memory never means fewer instances of any model. If one instance of each
does not fit, `NothingFits` says so before anything loads.

On a host without a GPU the same rule sizes from RAM (MemAvailable, the stubs' resident memory) and cores: a stage
instance per 4 cores, a pipeline instance per 2 (torch in every stub uses all cores; more stubs than that only cost
memory and start-up time).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .machine import MAX_CLIENTS
from .model_repository import BLS_CALLS, instances_on_gpu, load_configs, loaded_versions
from .rules import cuda_pool_bytes, mps_clients, reload_headroom

MiB, GiB = 1 << 20, 1 << 30
MARGIN = 0.05  # of the budget, kept free for what the estimates miss (fragmentation, a driver's own allocations)
MAX_MPS_CLIENTS = MAX_CLIENTS  # per GPU, NVIDIA's documented limit for Volta and later

# Measured per process on an H100 80GB HBM3 under CUDA MPS, after load and under load, at the defaults (resnet50,
# fp16, max batch 128, 500x375 JPEGs): docs/benchmarks/gpu-budgets.json in the template repository.
CONTEXT_BYTES = 348 * MiB  # a stub's context, stack trimmed, once a torch kernel has run (the pipeline's: 254)
SERVER_BYTES = 530 * MiB  # tritonserver without its CUDA memory pool
POSTPROCESS_BYTES = 16 * MiB  # the top-k's kernels and buffers, beside the context
PREPROCESS_BYTES = 362 * MiB  # beside the context (710 MiB a stub in all), at the defaults, whose ...
PREPROCESS_PEAK_BYTES = 420_245_760  # ... torch cap (stages.preprocess_peak_bytes()) this is, of which ...
PREPROCESS_TORCH_BYTES = 250 * MiB  # ... torch held this after the warm-up; the rest (nvJPEG, kernels) is fixed
RESNET50_BYTES = 990 * MiB  # beside the context: weights, the CUDA graphs' activations, cuDNN's workspace
OTHER_STAGE_BYTES = 256 * MiB  # a model this file does not know, beside its context
# The ResNets' activations relative to resnet50's at the same batch (basic blocks carry 64-512 channels where
# bottlenecks carry 256-2048), and their parameters.
RESNET_ACTIVATIONS = {"resnet18": 0.3, "resnet34": 0.3, "resnet50": 1.0, "resnet101": 1.0, "resnet152": 1.0}
RESNET_PARAMS = {"resnet18": 11.7e6, "resnet34": 21.8e6, "resnet50": 25.6e6, "resnet101": 44.5e6, "resnet152": 60.2e6}

# On a CPU host: resident memory per stub (torch, the stage, a full batch in flight), measured on x86_64.
CPU_STUB_BYTES = 450 * MiB
CPU_RESNET_BYTES = 1200 * MiB
CPU_SERVER_BYTES = 300 * MiB


class NothingFits(RuntimeError):
    """Even one instance of each model (or the pinned counts) does not fit: str() says what is needed and found."""


def parse_size(text: str) -> int | float:
    """`--gpu-memory`: a size ("16GiB", "16G", "16gb", "800MiB", bytes) as int bytes, or a fraction of the GPU's
    memory in (0, 1] as a float."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not match:
        raise ValueError(f"{text!r} is neither a size (16GiB, 800MiB) nor a fraction of the GPU (0.5)")
    number, unit = float(match.group(1)), match.group(2)
    if not unit and not match.group(3) and number <= 1:
        if number <= 0:
            raise ValueError(f"{text!r}: a fraction of the GPU must be above 0")
        return number
    return int(number * 1024 ** "kmgt".index(unit) * 1024) if unit else int(number)


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


@dataclass
class Device:
    """One budget: a GPU (index, name, total and free bytes) or, with index None, the host's RAM and cores."""

    index: int | None
    name: str
    total: int
    free: int
    cores: int = 0
    hypothetical: bool = False  # `plan --gpu-memory` where there is no GPU, or --gpus: a budget, not a GPU found

    @property
    def label(self) -> str:
        return "CPU" if self.index is None else f"GPU {self.index}"


def gpus_found() -> list[Device]:
    """The GPUs the server will see (CUDA_VISIBLE_DEVICES), with their free memory now, from nvidia-smi; [] when
    there is none. Numbered as the server numbers them, from 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    query = ["nvidia-smi", "--query-gpu=index,uuid,name,memory.total,memory.free", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    rows = [[part.strip() for part in line.split(",")] for line in out.stdout.splitlines() if line.strip()]
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        rows = [next((r for r in rows if len(r) > 1 and (w in r[:2] or r[1].startswith(w))), None) for w in wanted]
        rows = [r for r in rows if r is not None]
    try:
        return [Device(i, r[2], int(float(r[3])) * MiB, int(float(r[4])) * MiB) for i, r in enumerate(rows)]
    except (IndexError, ValueError):  # not the answer asked for (a stand-in nvidia-smi, a GPU that gives none)
        return []


def host_found() -> Device:
    """The host's RAM (MemTotal, MemAvailable) and the cores this process may use."""
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    total = info.get("MemTotal", 0)
    return Device(None, "CPU", total, info.get("MemAvailable", total), cores)


def dev_shm_free() -> int | None:
    """Free bytes of /dev/shm (None where there is none)."""
    return shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else None


# ------------------------------------------------------------------ what one instance costs


def _parameter(config, key: str) -> str | None:
    return config.parameters[key].string_value if key in config.parameters else None


def _pixels_bytes(configs) -> int:
    from .model_repository import bytes_per_element, tensor_datatype

    pre = configs.get("preprocess")
    pixels = [o for o in pre.output if o.name == "PIXELS"] if pre is not None else []
    return bytes_per_element(tensor_datatype(pixels[0])) if pixels else 2


def preprocess_bytes(peak: int) -> int:
    """What a preprocess stub whose torch cap is `peak` holds beside its context: the measured cost scaled by the
    peak, but with a smaller peak (a smaller max batch) never less than the part that does not follow the cap
    (nvJPEG's buffers, the kernels) plus torch's measured share or the whole cap, whichever is less. Measured
    against max batch 128 (one process, batches of photos; H100): 106 MiB less at max batch 8 and 296 less at
    max batch 1. Scaling alone counts 195 and 206 less, 89 MiB short at max batch 8; this counts 65 and 77 less,
    an upper bound at both (nvJPEG's one-image decode, at max batch 1, holds less than its batched one)."""
    scaled = PREPROCESS_BYTES * peak // PREPROCESS_PEAK_BYTES
    return max(scaled, PREPROCESS_BYTES - PREPROCESS_TORCH_BYTES + min(peak, PREPROCESS_TORCH_BYTES))


def instance_bytes(name: str, configs: dict, on_gpu: bool = True) -> int:
    """What one instance of model `name` holds: GPU bytes (on_gpu), else resident host bytes."""
    config = configs[name]
    if (declared := _parameter(config, "instance_gpu_memory" if on_gpu else "instance_host_memory")) is not None:
        return int(parse_size(declared))
    batch = max(1, config.max_batch_size)
    if not on_gpu:
        return CPU_RESNET_BYTES if name == "resnet" else CPU_STUB_BYTES
    if name == "pipeline":
        fused = 0
        if _parameter(config, "preprocess") == "in_process" and "preprocess" in configs:
            fused += instance_bytes("preprocess", configs) - CONTEXT_BYTES
        if _parameter(config, "postprocess") == "in_process":
            fused += POSTPROCESS_BYTES
        return CONTEXT_BYTES + fused
    if name == "postprocess":
        return CONTEXT_BYTES + POSTPROCESS_BYTES
    if name == "preprocess":
        from .stages import preprocess_peak_bytes

        params = {key: value.string_value for key, value in config.parameters.items()}
        peak = preprocess_peak_bytes(batch, int(params.get("crop", 224)), _pixels_bytes(configs))
        return CONTEXT_BYTES + preprocess_bytes(peak)
    if name == "resnet":
        variant = _parameter(config, "variant") or "resnet50"
        dtype = _pixels_bytes(configs)
        dtype = 4 if dtype == 4 else 2
        weights = int(RESNET_PARAMS.get(variant, 60.2e6) * dtype)
        work = RESNET50_BYTES - int(RESNET_PARAMS["resnet50"] * 2)
        work = int(work * RESNET_ACTIVATIONS.get(variant, 1.0) * batch / 128 * dtype / 2)
        return CONTEXT_BYTES + weights + work
    return CONTEXT_BYTES + OTHER_STAGE_BYTES


# ------------------------------------------------------------------ the plan


def ceilings(configs: dict, gpu: int | None) -> dict[str, int]:
    """{model: its config's count}: per GPU `gpu`, or in all on the CPU (gpu None); ensembles have none."""
    from tritonclient.grpc import model_config_pb2

    out = {}
    for name, config in sorted(configs.items()):
        if config.platform == "ensemble":
            continue
        if gpu is not None:
            out[name] = instances_on_gpu(config, gpu)
        else:
            groups = config.instance_group or [model_config_pb2.ModelInstanceGroup()]
            out[name] = sum(g.count or 1 for g in groups)
    order = [m for caller, called in BLS_CALLS.items() for m in (caller, *called)]  # the pipeline's order first
    ranked = sorted(out, key=lambda m: (order.index(m) if m in order else len(order), m))
    return {name: out[name] for name in ranked if out[name]}


@dataclass
class DevicePlan:
    device: Device
    budget_bytes: int  # what the counts may use, the margin already taken off
    counts: dict[str, int]
    estimated_bytes: int  # what those counts hold once loaded
    headroom_bytes: int  # kept free for the largest reload
    cost: dict[str, int] = field(default_factory=dict)  # per instance
    ceiling: dict[str, int] = field(default_factory=dict)  # the configs' counts
    limited_by: str = ""
    cap: str = ""  # how the budget was set: "free", "--gpu-memory 16GiB"
    mps_clients: int = 0  # the most these counts take on the GPU: stubs, tritonserver, the largest reload's new stubs

    @property
    def overrides(self) -> dict[str, int] | None:
        """The counts that differ from the configs' (None when none does: the configs are served as they are)."""
        return {m: n for m, n in self.counts.items() if n != self.ceiling.get(m)} or None

    def line(self) -> str:
        """'GPU 0: 24.0 GiB free -> pipeline 8, preprocess 3, ... (~ 14.0 GiB, ...)', as serve and health say it."""
        d = self.device
        what = f"{gib(d.free)} free" if d.index is not None else f"{gib(d.free)} RAM available, {d.cores} cores"
        if d.hypothetical:
            what = f"a budget of {gib(d.free)}"
        elif self.cap:
            what += f", {self.cap}"
        counts = ", ".join(f"{m} {n}" for m, n in self.counts.items())
        return (
            f"{d.label}: {what} -> {counts} (~{gib(self.estimated_bytes)}, {gib(self.headroom_bytes)} kept for a "
            f"reload; {self.limited_by})"
        )

    def as_json(self) -> dict:
        return {
            "device": self.device.label,
            "name": self.device.name,
            "free_bytes": self.device.free,
            "budget_bytes": self.budget_bytes,
            "counts": self.counts,
            "estimated_bytes": self.estimated_bytes,
            "headroom_bytes": self.headroom_bytes,
            "instance_bytes": self.cost,
            "limited_by": self.limited_by,
            "mps_clients": self.mps_clients,
        }


def plan(
    repository: Path | str,
    devices: list[Device],
    cap: int | float | None = None,
    pinned: dict[str, int] | None = None,
    shm_free: int | None = None,
    mps: bool = True,
) -> list[DevicePlan]:
    """The counts for `repository` on `devices` (GPUs, or one CPU Device): one DevicePlan per device, all with the
    same counts (a config's count applies to every GPU alike), those of the tightest device. Raises NothingFits."""
    from .shm import dev_shm_need

    configs = load_configs(repository)
    pinned = dict(pinned or {})
    on_gpu = devices[0].index is not None
    ceiling = ceilings(configs, 0 if on_gpu else None)
    unknown = sorted(set(pinned) - set(ceiling))
    if unknown:
        raise ValueError(f"--instances names {', '.join(unknown)}: no such Python model in {repository}")
    # A count starts that many instances of every version the model loads (recipe 3 keeps two resnets loaded).
    versions = {name: loaded_versions(Path(repository) / name, configs[name]) for name in ceiling}
    stub_cost = {name: instance_bytes(name, configs, on_gpu) for name in ceiling}
    cost = {name: stub_cost[name] * versions[name] for name in ceiling}  # per count: its stub on every version

    def stubs(counts: dict[str, int]) -> dict[str, int]:
        return {m: counts[m] * versions[m] for m in counts}

    def budget(device: Device) -> tuple[int, str]:
        if not on_gpu:
            return int(device.free * (1 - MARGIN)), ""
        limit, how = device.free, ""
        if cap is not None:
            size = int(cap * device.total) if isinstance(cap, float) else cap
            how = f"--gpu-memory {gib(size)}"
            if isinstance(cap, float):
                how = f"--gpu-memory {cap:g} of {gib(device.total)}"
            limit = min(limit, size)
        return int(limit * (1 - MARGIN)), how

    def fixed(counts: dict[str, int]) -> int:
        if not on_gpu:
            return CPU_SERVER_BYTES
        return SERVER_BYTES + cuda_pool_bytes(repository, 0, counts=counts)

    def need(counts: dict[str, int]) -> tuple[int, int]:
        return fixed(counts) + sum(counts[m] * cost[m] for m in counts), reload_headroom(stubs(counts), stub_cost)[0]

    def shm_need(counts: dict[str, int]) -> int:  # every GPU's stubs share the one /dev/shm
        return sum(dev_shm_need(repository, gpus=len(devices) if on_gpu else 0, counts=counts))

    def clients(counts: dict[str, int]) -> int:
        return mps_clients(stubs(counts))[0]

    budgets = [budget(d) for d in devices]
    tightest = min(range(len(devices)), key=lambda i: budgets[i][0])
    limit = budgets[tightest][0]

    def why_not(counts: dict[str, int]) -> str | None:
        used, headroom = need(counts)
        if used + headroom > limit:
            return "memory"
        if on_gpu and mps and clients(counts) > MAX_MPS_CLIENTS:
            return "MPS clients"
        if shm_free is not None and shm_need(counts) > shm_free:
            return "/dev/shm"
        return None

    counts = {name: pinned.get(name, 1) for name in ceiling}
    if (reason := why_not(counts)) is not None:
        device = devices[tightest]
        one = "the pinned counts" if pinned else "one instance of each model"
        if reason == "memory":
            used, headroom = need(counts)
            what = "free" if on_gpu else "of RAM available"
            budget_note = f" (the budget: {budgets[tightest][1]})" if budgets[tightest][1] else ""
            raise NothingFits(
                f"{device.label}: needs about {gib(used + headroom)} for {one} ({gib(used)}, and {gib(headroom)} for "
                f"a reload), {gib(device.free)} {what}{budget_note}. Free some "
                f"{'GPU ' if on_gpu else ''}memory, or lower max_batch_size or the precision in the configs"
            )
        if reason == "/dev/shm":
            raise NothingFits(
                f"/dev/shm: needs about {shm_need(counts) // MiB} MiB for {one}, {shm_free // MiB} MiB free: give "
                "the server more shared memory (`docker run --shm-size`, compose shm_size / TRITON_SHM_SIZE)"
            )
        raise NothingFits(f"{device.label}: {one} need {clients(counts)} MPS clients, over {MAX_MPS_CLIENTS}: --no-mps")

    cores = devices[0].cores
    per_core = {name: ceiling[name] for name in ceiling}
    if not on_gpu:  # a stage instance per 4 cores, a pipeline (BLS) instance per 2
        per_core = {n: min(c, max(1, cores // (2 if n in BLS_CALLS else 4))) for n, c in ceiling.items()}

    # One factor scales every count that is not pinned (rounded, at least 1, at most its cap): the largest factor
    # whose counts fit. More memory never means fewer instances of any model, and the configs' proportions stay.
    def scaled(factor: float) -> dict[str, int]:
        return {m: pinned.get(m, max(1, min(per_core[m], math.floor(ceiling[m] * factor + 0.5)))) for m in ceiling}

    steps = sorted({(k - 0.5) / ceiling[m] for m in ceiling if m not in pinned for k in range(2, ceiling[m] + 1)})
    stopped: set[str] = set()
    for factor in [*steps, 1.0]:
        trial = scaled(factor)
        if trial == counts:
            continue
        if (reason := why_not(trial)) is not None:
            stopped.add(reason)
            break
        counts = trial
    if any(counts[m] < min(per_core[m], ceiling[m]) for m in ceiling if m not in pinned) and not stopped:
        stopped.add("cores")
    if not on_gpu and any(per_core[m] < ceiling[m] for m in ceiling if m not in pinned):
        stopped.add("cores")
    words = {"memory": "GPU memory" if on_gpu else "RAM", "MPS clients": "MPS's 48 clients"}
    reasons = sorted(words.get(r, r) for r in stopped)
    limited_by = "limited by " + ", ".join(reasons) if reasons else "the configs' counts"
    if pinned:
        limited_by += "; pinned: " + ", ".join(f"{m}={n}" for m, n in pinned.items())
    used, headroom = need(counts)
    most_clients = clients(counts) if on_gpu else 0
    return [
        DevicePlan(d, b, dict(counts), used, headroom, cost, dict(ceiling), limited_by, how, most_clients)
        for d, (b, how) in zip(devices, budgets)
    ]


def parse_instances(items: list[str] | str | None) -> dict[str, int]:
    """`--instances pipeline=8 preprocess=2` or $TRITON_INSTANCES "pipeline=8,preprocess=2" -> {model: count}."""
    if not items:
        return {}
    if isinstance(items, str):
        items = [part for part in re.split(r"[,\s]+", items) if part]
    counts = {}
    for item in items:
        model, sep, count = item.partition("=")
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"{item!r}: write MODEL=COUNT, COUNT at least 1 (pipeline=8)")
        counts[model.strip()] = int(count)
    return counts


def plan_for_serve(repository: Path | str, gpus: list[int], cap, pinned: dict[str, int], mps: bool) -> list[DevicePlan]:
    """The plan `serve` starts with: the GPUs it will use, or the host when there is none."""
    found = gpus_found() if gpus else []
    if gpus and not found:  # GPUs, but nvidia-smi cannot say how much is free: size as for an unseen H100
        found = [Device(i, "unknown GPU", 80 * GiB, 80 * GiB) for i in gpus]
    devices = found[: len(gpus)] if gpus else [host_found()]
    return plan(repository, devices, cap=cap if gpus else None, pinned=pinned, shm_free=dev_shm_free(), mps=mps)
