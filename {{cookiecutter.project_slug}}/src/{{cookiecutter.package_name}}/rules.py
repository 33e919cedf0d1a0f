"""Plain rules over the model repository's configs: what the processes will hold, computed without starting any.

- `cuda_pool_bytes`: the CUDA memory pool a GPU needs (`--cuda-memory-pool-byte-size`);
- `reload_sets`, `reload_headroom`: the reloads that start new stubs beside the running ones, and the largest;
- `mps_clients`: the MPS clients a GPU's stubs and that reload make;
- `OVERLOAD_MESSAGES`: Triton's words for a request its queues refused (UNAVAILABLE: busy, not broken).

Sizing (sizing.py), /dev/shm (shm.py), MPS (mps.py) and the server's flags (server.py) use them; they use only the
configs (model_repository.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from .model_repository import BLS_CALLS, bytes_per_element, instances_on_gpu, load_configs, tensor_datatype

MiB = 1 << 20

# A request refused by a full queue, or one that waited longer than its timeout: the server is busy, not broken.
OVERLOAD_MESSAGES = ("Exceeds maximum queue size", "Request timeout expired")


def cuda_pool_bytes(repository: Path | str, gpu: int = 0, counts: dict[str, int] | None = None) -> int:
    """The CUDA memory pool of GPU `gpu` (`--cuda-memory-pool-byte-size`), sized from the repository's configs, so
    that an edit of max_batch_size, of a tensor or of an instance count after baking resizes it at the next start.

    Every GPU tensor that crosses between a Python-backend stub and the server lives in this pool: the buffers a
    stub's GPU outputs are written to (the requester's: a BLS caller's response, an ensemble's step output), the
    copy the Python backend makes of each GPU input of a BLS call, and the copy of a GPU input that arrives from
    outside the pool (a CUDA shared-memory client's). When the pool is full, Triton 2.51 falls back to CUDA IPC or
    host memory without failing the request: slower, a hop through the CPU. So the pool holds every batch in flight:

        pool(gpu) = 5/4 x sum over the models (ensembles aside) with instances on `gpu` of
                    instances on gpu x max_batch_size x GPU bytes per batch element its instance holds

    An instance executes one batch at a time, and holds the GPU tensors of that batch: its model's own inputs and
    outputs and, for a BLS model (BLS_CALLS), the inputs and outputs of every model it calls (the pipeline holds
    preprocess's PIXELS response and the copy it sends resnet, then resnet's LOGITS). GPU tensors are the
    non-string ones (strings always travel through /dev/shm), at their config dims and dtype. Instances on `gpu`:
    the `count` of every instance_group that is not KIND_CPU and lists no `gpus`, or lists this one. The sum is the
    worst case of every instance executing a full batch at once (the stages' instances serving ensembles, whose
    step outputs the server holds, while every pipeline instance waits with its pixels); the quarter on top is for
    the pool's fragmentation under varied batch sizes. Rounded up to 64 MiB, at least 512 MiB. `counts` ({model:
    instances per GPU}) stands in for the configs' counts of the models it names (the counts `serve` sized). Not
    bounded by any instance count: an ensemble's step outputs still waiting in the next step's queue; a sustained
    ensemble load that outpaces its next step can still fill the pool (requests then slow down; they do not fail).
    """
    from tritonclient.grpc import model_config_pb2

    configs = load_configs(repository)

    def gpu_bytes(config) -> int:  # one batch element's GPU tensors: every non-string input and output
        total = 0
        for tensor in [*config.input, *config.output]:
            if tensor.data_type == model_config_pb2.TYPE_STRING:
                continue
            if any(dim < 0 for dim in tensor.dims):
                raise ValueError(
                    f"{config.name}: {tensor.name} has a variable dim; the CUDA memory pool is sized from fixed dims "
                    "(rules.cuda_pool_bytes)"
                )
            total += math.prod(tensor.dims) * bytes_per_element(tensor_datatype(tensor))
        return total

    need = 0
    for name, config in configs.items():
        if config.platform == "ensemble":
            continue
        held = gpu_bytes(config) + sum(gpu_bytes(configs[c]) for c in BLS_CALLS.get(name, ()) if c in configs)
        instances = (counts or {}).get(name, instances_on_gpu(config, gpu))
        need += instances * max(1, config.max_batch_size) * held
    return max(512 * MiB, -(-(need * 5 // 4) // (64 * MiB)) * 64 * MiB)


def reload_sets(counts: dict[str, int]) -> list[tuple[list[str], int]]:
    """(models, new stubs minus the dead one) for each reload whose new stubs start beside the running ones: the
    watchdog's of a model whose stub died, and a BLS model's hot reload (the pipeline's by `reload`, or the
    watchdog's of a caller, which waits for the called model's replaced stubs to end)."""
    sets = [([name], -1) for name in counts]  # the dead stub's process is gone
    for caller in BLS_CALLS:
        if caller in counts:
            sets.append(([caller], 0))  # a hot reload: every old stub still runs
    return sets


def reload_headroom(counts: dict[str, int], cost: dict[str, int]) -> tuple[int, int, str]:
    """(bytes, stubs, which reload) of the largest reload beside the running stubs."""
    best = (0, 0, "none")
    for models, less in reload_sets(counts):
        size = sum(counts[m] * cost[m] for m in models) + less * cost[models[0]]
        stubs = sum(counts[m] for m in models) + less
        if size > best[0]:
            best = (size, stubs, " and ".join(models))
    return best


def mps_clients(stubs: dict[str, int]) -> tuple[int, int, str]:
    """(clients, new stubs, which reload) for `stubs` per model on one GPU (every loaded version's): those stubs,
    tritonserver, and the new stubs of the reload that starts the most, whatever their bytes."""
    _, reload, models = reload_headroom(stubs, dict.fromkeys(stubs, 1))
    return sum(stubs.values()) + 1 + reload, reload, models
