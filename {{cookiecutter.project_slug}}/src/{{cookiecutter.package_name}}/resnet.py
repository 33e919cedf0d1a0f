"""The ResNet stage as plain PyTorch: torchvision's model from a weights file, run at a few padded batch sizes, each
captured once as a CUDA graph on a GPU. `stages.py` holds it with the other two stages."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torchvision


def build_resnet(variant: str, weights: Path | str | None = None, num_classes: int | None = None) -> torch.nn.Module:
    """torchvision's architecture, with weights from a state-dict file (None: the untrained init).

    The class count is `num_classes`, else the weights' (rows of `fc.weight`), else ImageNet's 1000. Weights with
    another class count than `num_classes` raise a ValueError that says how to fix it.
    """
    state = None if weights is None else torch.load(weights, map_location="cpu", weights_only=True)
    found = state["fc.weight"].shape[0] if state is not None and "fc.weight" in state else None
    if num_classes is not None and found is not None and found != num_classes:
        raise ValueError(
            f"{weights} has {found} classes (fc.weight) but the model is configured for {num_classes}: "
            "write weights, labels.txt and config.pbtxt together with `weights import`"
        )
    model = torchvision.models.get_model(variant, weights=None, num_classes=num_classes or found or 1000)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes the classifier runs: powers of two below max_batch_size, and max_batch_size itself."""
    buckets, size = [], 1
    while size < max_batch_size:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch_size]


class Classifier:
    """Pixels -> FP32 logits [B, classes]. On the CPU, FP16 and BF16 are computed in FP32: without AVX512-BF16 or
    AMX, half-precision CPU convolutions crawl (resnet18, one image, AVX2: 0.056 s in FP32, 1.6 s FP16, 2.3 s BF16).

    Every batch is padded to the next of a few bucket sizes (`batch_buckets`), so the model only ever sees those
    shapes: per-shape state (cuDNN plans, oneDNN primitives, CUDA graphs) stays bounded however the dynamic batcher
    groups requests. On a GPU each bucket is captured once as a CUDA graph (`cuda_graphs`): one replay instead of
    some 150 kernel launches from Python, which is most of the time at small batches. The model is torchvision's
    eager one, or, given `compiled`, the same weights compiled for this GPU by torch.compile (compiled.py),
    captured the same way.
    """

    def __init__(
        self,
        variant: str,
        weights: Path | str | None,
        device="cpu",
        dtype=torch.float32,
        max_batch_size: int = 128,
        cuda_graphs: bool = True,
        image_size: int = 224,
        num_classes: int | None = None,
        compiled=None,
    ):
        started = time.monotonic()
        self.device = torch.device(device)
        half = dtype in (torch.float16, torch.bfloat16)
        self.dtype = torch.float32 if (self.device.type == "cpu" and half) else dtype
        self.memory_format = torch.channels_last if self.device.type == "cuda" else torch.contiguous_format
        model = build_resnet(variant, weights, num_classes)  # checks the weights against the class count
        # `compiled`: the same model compiled for this device (compiled.load), FP32 logits out
        if compiled is None:
            compiled = model.to(self.device, self.dtype, memory_format=self.memory_format)
        self.model = compiled
        self.buckets = batch_buckets(max_batch_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.load_seconds = {"built": time.monotonic() - started}
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # a few shapes only: pick each one's fastest kernels once
            if cuda_graphs:
                self._capture(image_size)
        # for the server log: a model's load (and so a watchdog reload) waits for these steps
        self.load_report = ", ".join(f"{step} in {seconds:.1f} s" for step, seconds in self.load_seconds.items())

    @torch.inference_mode()
    def _capture(self, image_size: int) -> None:
        shape = (self.buckets[-1], 3, image_size, image_size)
        self.static_input = torch.zeros(shape, dtype=self.dtype, device=self.device).contiguous(
            memory_format=self.memory_format
        )
        started = time.monotonic()
        side = torch.cuda.Stream(self.device)  # warm up (cuDNN autotuning) off the default stream, as capture needs
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for size in self.buckets:
                self.model(self.static_input[:size])
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.load_seconds[f"{len(self.buckets)} batch sizes autotuned"] = time.monotonic() - started
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()  # the graphs share one memory pool, largest captured first
        try:
            for size in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model(self.static_input[:size]).float()
                self.graphs[size] = (graph, logits)
        except RuntimeError as exc:  # a model that cannot be captured still serves, one launch at a time
            self.graphs.clear()
            self.load_seconds[f"not captured ({str(exc).splitlines()[0][:120]})"] = time.monotonic() - started
        else:
            self.load_seconds["captured as CUDA graphs"] = time.monotonic() - started
        # cuDNN's autotuning left the workspaces of every algorithm it tried cached (about 0.7 GiB at resnet50, batch
        # 128): the graphs keep the memory they replay in (their own pool), so the rest goes back to the driver.
        torch.cuda.empty_cache()

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        count, largest = pixels.shape[0], self.buckets[-1]
        if count > largest:
            return torch.cat([self(part) for part in pixels.split(largest)])
        bucket = next(size for size in self.buckets if size >= count)
        if self.graphs:
            # Rows past `count` hold earlier images: harmless, every row is computed on its own (eval mode).
            self.static_input[:count].copy_(pixels)
            graph, logits = self.graphs[bucket]
            graph.replay()
            return logits[:count].clone()  # the next replay overwrites the graph's output
        pixels = pixels.to(self.device, self.dtype, memory_format=self.memory_format)
        if bucket > count:
            pixels = torch.cat([pixels, pixels.new_zeros((bucket - count, *pixels.shape[1:]))])
        return self.model(pixels)[:count].float()
