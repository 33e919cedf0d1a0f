"""What `serve` shows: a short progress view of the start, with tritonserver's full log kept in a file.

tritonserver's output goes through a pipe to `LogPump`, which writes every line to the log file and shows the
user only what matters: each model loading and loaded (with the time since the start), Triton's error lines,
and, with --verbose, everything. On a host without a GPU, Triton reports CUDA, NVML and DCGM as unavailable in
alarming words (`CUDA driver version is insufficient`, `CudaDriverHelper has not been initialized`, `Failed to
initialize NVML`): there they are expected and harmless, so they stay in the file, which explains them.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

# Triton's lines that only say "no GPU here"; harmless, and left out of the terminal, on a host without one.
HARMLESS_WITHOUT_GPU = (
    "CUDA driver version is insufficient",
    "CudaDriverHelper has not been initialized",
    "CUDA memory pool disabled",
    "Failed to initialize NVML",
    "DCGM unable to start",
)
LOADING = re.compile(r'"loading: ([^:"]+):\d+"')
LOADED = re.compile(r"\"successfully loaded '([^']+)'\"")
LOAD_FAILED = re.compile(r"\"failed to load '([^']+)' version \d+: (.*)\"$")
# An ensemble whose steps do not fit together is refused before it loads, in a line of its own (2.51).
ENSEMBLE_INVALID = re.compile(r"\"Invalid argument: in ensemble ([^,\s]+), (.*)\"$")
ERROR = re.compile(r"^E\d{4} |^Error: ")


def log_header(gpus: list[int]) -> str:
    note = (
        "no GPU here: the lines about CUDA ('CUDA driver version is insufficient', 'CudaDriverHelper has not been "
        "initialized', 'CUDA memory pool disabled'), NVML and DCGM are expected and harmless"
        if not gpus
        else f"GPUs {gpus}"
    )
    return f"# tritonserver log, started {time.strftime('%Y-%m-%d %H:%M:%S')}; {note}\n"


class LogPump(threading.Thread):
    """Copy tritonserver's output, line by line, to the log file; show progress, errors, or (verbose) all of it."""

    def __init__(self, stream, path: Path, gpus: list[int], verbose: bool, started: float):
        super().__init__(name="tritonserver-log", daemon=True)
        self.stream, self.path, self.verbose, self.started = stream, path, verbose, started
        self.cpu_only = not gpus
        self.loading: set[str] = set()
        self.quiet_lines = 0  # harmless lines left out of the terminal
        self.load_errors: dict[str, str] = {}  # model -> why it failed to load, as Triton logged it

    def harmless(self, line: str) -> bool:
        return self.cpu_only and any(text in line for text in HARMLESS_WITHOUT_GPU)

    def show(self, line: str) -> None:
        if failed := LOAD_FAILED.search(line.rstrip()) or ENSEMBLE_INVALID.search(line.rstrip()):
            self.load_errors.setdefault(failed.group(1), failed.group(2).replace("\\n", "\n").strip())
        if self.verbose:
            if self.harmless(line):
                self.quiet_lines += 1
                if self.quiet_lines == 1:
                    print(f"  (no GPU: Triton's lines about CUDA, NVML and DCGM are harmless here; in {self.path})")
                return
            sys.stdout.write(line)
            sys.stdout.flush()
            return
        loading, loaded = LOADING.search(line), LOADED.search(line)
        if loading and loading.group(1) not in self.loading:
            self.loading.add(loading.group(1))
            print(f"  loading  {loading.group(1)}", flush=True)
        elif loaded:
            self.loading.discard(loaded.group(1))
            print(f"  loaded   {loaded.group(1):24s} {time.monotonic() - self.started:6.1f} s", flush=True)
        elif ERROR.search(line) and not self.harmless(line):
            print(f"  tritonserver: {line.rstrip()}", flush=True)

    def run(self) -> None:
        with open(self.path, "a", encoding="utf-8") as log:
            for raw in iter(self.stream.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                log.write(line)
                log.flush()
                self.show(line)
