"""The compiled ResNet's cache (compiled.py), without a GPU: what keys a cache folder, what the stage does without a
ready one, and a real torch.compile cache filled once and compiled from in another process on the CPU (a small model:
resnet18 on 64x64 images, batches of 1 and 2)."""

import ast
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import compiled
from {{ cookiecutter.package_name }}.model_repository import load_config, pixels_dtype, resnet_weight_files, set_parameter
from {{ cookiecutter.package_name }}.stages import Classifier, build_resnet

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def small(tmp_path) -> compiled.Target:
    """resnet18 with 10 classes, for 64x64 images and batches of 1-2: two batch sizes to compile on 2 cores."""
    torch.manual_seed(0)
    weights = tmp_path / "weights.pt"
    torch.save(build_resnet("resnet18", None, 10).state_dict(), weights)
    return compiled.Target("resnet18", weights, torch.float32, 2, 10, "default", 64)


def test_targets_follow_the_resnet_config(model_repository):
    targets = compiled.targets(model_repository)
    assert [t.weights for t in targets] == resnet_weight_files(model_repository)  # a package per version (recipe 3)
    for target in targets:
        assert target.mode == "default" and target.image_size == 224
        assert target.dtype == pixels_dtype(model_repository)
        assert target.max_batch_size == load_config(model_repository / "resnet").max_batch_size


def test_compile_off_asks_for_nothing_and_an_unknown_mode_is_refused(model_repository, tmp_path):
    import shutil

    repo = tmp_path / "model_repository"
    shutil.copytree(model_repository, repo)
    set_parameter(repo, "resnet", "compile", "off")
    assert compiled.targets(repo) == []
    set_parameter(repo, "resnet", "compile", "fastest")
    with pytest.raises(ValueError, match="compile is 'fastest'; choose one of default, max-autotune, off"):
        compiled.targets(repo)


def test_every_input_of_the_compiled_code_is_in_the_key(small, cache, monkeypatch):
    base = small.path(CPU)
    assert base.parent == cache and base.suffix == "" and small.path(CPU) == base
    others = [
        replace(small, dtype=torch.float16),
        replace(small, max_batch_size=8),
        replace(small, num_classes=11),
        replace(small, mode="max-autotune"),
        replace(small, variant="resnet34"),
        replace(small, image_size=96),
    ]
    paths = {t.path(CPU) for t in others}
    assert base not in paths and len(paths) == len(others)
    # the same file name with other bytes in it: new weights (`weights import`) are a new key
    small.weights.write_bytes(small.weights.read_bytes() + b"\0")
    assert small.path(CPU) != base
    new_weights = small.path(CPU)
    monkeypatch.setattr(torch, "__version__", "0.0.0")  # another torch never uses an old cache
    assert small.path(CPU) != new_weights
    monkeypatch.setattr(compiled, "device_identity", lambda device: {"gpu": "Other GPU", "capability": "9.9"})
    assert small.path(CPU) != new_weights


def test_without_a_ready_cache_the_stage_says_why_it_runs_eager(small, cache):
    model, how = compiled.load(small, CPU)
    assert model is None and how.startswith("eager, not compiled: not compiled for these weights")
    (small.path(CPU) / "inductor").mkdir(parents=True)  # what a compile that is still running has written so far
    model, how = compiled.load(small, CPU)
    assert model is None and "not compiled for these weights" in how
    assert compiled.load(replace(small, mode="off"), CPU) == (None, "eager (compile is off)")


def test_a_failed_compile_is_said_and_not_tried_at_every_start(small, cache):
    path = small.path(CPU)
    cache.mkdir()
    path.with_suffix(".failed").write_text("CalledProcessError: g++ not found\n")
    model, how = compiled.load(small, CPU)
    assert model is None and "g++ not found" in how
    lines = []
    assert compiled.ensure_target(small, CPU, log=lines.append) is None
    assert "not available (CalledProcessError: g++ not found)" in lines[0] and "compile --force" in lines[0]


def test_without_a_compiler_nothing_is_compiled_or_kept_as_failed(small, cache, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    lines = []
    assert compiled.ensure_target(small, CPU, log=lines.append) is None
    assert lines == ["compiled resnet: not available (no C++ compiler here: install g++); eager with CUDA graphs"]
    assert not small.path(CPU).with_suffix(".failed").exists()  # installing one is enough: the next start compiles


LOAD_AND_RUN = """
import sys, torch
from pathlib import Path
from torch._dynamo.utils import counters
from {{ cookiecutter.package_name }} import compiled
from {{ cookiecutter.package_name }}.stages import Classifier
target = compiled.Target("resnet18", Path(sys.argv[1]), torch.float32, 2, 10, "default", 64)
model, how = compiled.load(target, torch.device("cpu"))
assert model is not None, how
pixels = torch.load(sys.argv[2])
classifier = Classifier("resnet18", target.weights, "cpu", max_batch_size=2, num_classes=10, compiled=model)
torch.save([classifier(pixels[:n]) for n in (1, 2, 3)], sys.argv[3])
print(dict(counters["inductor"]))
print(how)
"""


def test_compiled_once_the_stage_compiles_from_the_cache_and_answers_as_eager_does(small, cache, tmp_path):
    """Compiled in this process, every batch size, checked against eager; then, in another process (as each stub),
    compiled from the cache alone (Inductor's FX-graph cache: hits, no miss), for batches of 1 to more than the
    largest: the same logits as the eager model, within float rounding."""
    lines = []
    path = compiled.ensure_target(small, CPU, log=lines.append)
    assert path == small.path(CPU) and compiled.ready(path).is_file() and not path.with_suffix(".failed").exists()
    assert lines[0].startswith("compiling resnet (resnet18 fp32 for the CPU")
    assert "cached for the next start" in lines[0]
    fields = json.loads(compiled.ready(path).read_text())
    assert fields["weights_sha256"] == compiled.file_digest(small.weights) and fields["compile_s"] > 0
    assert fields["check"]["max_score_difference"] <= compiled.PARITY  # checked against eager before it was ready
    torch.manual_seed(1)
    torch.save(build_resnet("resnet18", None, 10).state_dict(), tmp_path / "other.pt")
    other = Classifier("resnet18", tmp_path / "other.pt", "cpu", max_batch_size=2, num_classes=10)
    with pytest.raises(ValueError, match="its scores differ from the eager model's"):
        compiled.check(small, CPU, other)  # a model that answers otherwise is never made ready
    # a second start finds it: nothing compiles again
    lines.clear()
    stamp = compiled.ready(path).stat().st_mtime_ns
    assert compiled.ensure_target(small, CPU, log=lines.append) == path
    assert len(lines) == 1 and lines[0].startswith("compiled resnet: cached, resnet18 fp32") and str(path) in lines[0]
    assert compiled.ready(path).stat().st_mtime_ns == stamp

    pixels = torch.randn(3, 3, 64, 64)
    torch.save(pixels, tmp_path / "pixels.pt")
    script = tmp_path / "load.py"
    script.write_text(LOAD_AND_RUN)
    done = subprocess.run(
        [sys.executable, script, small.weights, tmp_path / "pixels.pt", tmp_path / "out.pt"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    *_, inductor, how = done.stdout.strip().splitlines()
    assert how == f"compiled (default), cached in {path}"
    inductor = ast.literal_eval(inductor)  # the counters, printed
    assert inductor.get("fxgraph_cache_hit", 0) >= 2 and inductor.get("fxgraph_cache_miss", 0) == 0, inductor
    eager = Classifier("resnet18", small.weights, "cpu", max_batch_size=2, num_classes=10)
    for got, n in zip(torch.load(tmp_path / "out.pt"), (1, 2, 3)):
        assert got.shape == (n, 10) and got.dtype == torch.float32
        torch.testing.assert_close(got, eager(pixels[:n]), atol=1e-4, rtol=1e-4)
