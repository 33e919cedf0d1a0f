"""Bake the template: the exact tree, nothing unrendered, valid configs, validated answers, hostile input."""

from __future__ import annotations

import json
import os
import py_compile
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import bake
from cookiecutter.exceptions import FailedHookException
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

EXPECTED_TREE = sorted(
    """
.cookiecutter.json
.dockerignore
.github/workflows/ci.yml
.gitignore
.pre-commit-config.yaml
ARCHITECTURE.md
Dockerfile
Makefile
README.md
benchmarks/__init__.py
benchmarks/_common.py
benchmarks/budgets.py
benchmarks/e2e.py
benchmarks/hop.py
benchmarks/overload.py
benchmarks/hop_models/hop_driver/1/model.py
benchmarks/hop_models/hop_driver/config.pbtxt
benchmarks/hop_models/hop_sink/1/model.py
benchmarks/hop_models/hop_sink/config.pbtxt
benchmarks/inprocess.py
benchmarks/reload_stress.py
benchmarks/results/.gitignore
benchmarks/run.py
benchmarks/soak.py
benchmarks/shm.py
docker-compose.cpu.yml
docker-compose.ngc.yml
docker-compose.yml
deploy/kubernetes/base/admin-key.env
deploy/kubernetes/base/compiled-resnet.yaml
deploy/kubernetes/base/deployment.yaml
deploy/kubernetes/base/hpa.yaml
deploy/kubernetes/base/kustomization.yaml
deploy/kubernetes/base/networkpolicy.yaml
deploy/kubernetes/base/pdb.yaml
deploy/kubernetes/base/services.yaml
deploy/kubernetes/cpu/kustomization.yaml
deploy/kubernetes/monitoring/prometheus-adapter-values.yaml
deploy/kubernetes/monitoring/servicemonitor.yaml
docker/constraints-ngc.txt
docker/constraints.txt
docker/ngc.Dockerfile
docs/customizing.md
docs/deployment.md
docs/kubernetes.md
docs/performance.md
model_repository/classify_pixels/1/.gitkeep
model_repository/classify_pixels/config.pbtxt
model_repository/ensemble/1/.gitkeep
model_repository/ensemble/config.pbtxt
model_repository/pipeline/1/model.py
model_repository/pipeline/config.pbtxt
model_repository/postprocess/1/model.py
model_repository/postprocess/config.pbtxt
model_repository/preprocess/1/model.py
model_repository/preprocess/config.pbtxt
model_repository/resnet/1/model.py
model_repository/resnet/config.pbtxt
model_repository/resnet/labels.txt
pyproject.toml
scripts/compose_e2e.sh
scripts/demo.py
src/image_classifier/__init__.py
src/image_classifier/admin_key.py
src/image_classifier/batches.py
src/image_classifier/cli.py
src/image_classifier/client.py
src/image_classifier/compiled.py
src/image_classifier/console.py
src/image_classifier/counters.py
src/image_classifier/health.py
src/image_classifier/images.py
src/image_classifier/machine.py
src/image_classifier/model_repository.py
src/image_classifier/paths.py
src/image_classifier/mps.py
src/image_classifier/python_backend.py
src/image_classifier/resnet.py
src/image_classifier/restarts.py
src/image_classifier/rules.py
src/image_classifier/runtime.py
src/image_classifier/server.py
src/image_classifier/serving.py
src/image_classifier/shm.py
src/image_classifier/sized.py
src/image_classifier/sizing.py
src/image_classifier/stages.py
src/image_classifier/stub_deaths.py
src/image_classifier/weights.py
tests/conftest.py
tests/test_architecture.py
tests/test_cli.py
tests/test_compiled.py
tests/test_customizing.py
tests/test_e2e.py
tests/test_gpu.py
tests/test_hostile_clients.py
tests/test_mps.py
tests/test_observability.py
tests/test_reliability.py
tests/test_security.py
tests/test_shared_memory.py
tests/test_sizing.py
tests/test_stages.py
tests/test_weights.py
""".split()
)

# Supported option combinations, each baked and checked by id.
COMBINATIONS = {
    "default": {},
    "resnet18-fp16-no-ensemble": {"resnet_variant": "resnet18", "precision": "fp16", "include_ensemble": False},
    "resnet152-bf16-batch1-top1": {"resnet_variant": "resnet152", "precision": "bf16", "max_batch_size": 1, "top_k": 1},
    "resnet34-batch1024-top1000": {"resnet_variant": "resnet34", "max_batch_size": 1024, "top_k": 1000},
    "custom-names-and-ports": {
        "project_name": "Cat Detector",
        "package_name": "catdet",
        "http_port": 9000,
        "grpc_port": 9001,
        "metrics_port": 9002,
    },
}

# Jinja left behind, or a `cookiecutter.x` variable reference (`.cookiecutter.json`, the replay file, is fine).
UNRENDERED = re.compile(r"\{\{\s*cookiecutter|\{%|%\}|(?<!\.)cookiecutter\.(?!json)")


def tree(project: Path) -> list[str]:
    return sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file())


def model_config(project: Path, model: str) -> model_config_pb2.ModelConfig:
    text = (project / "model_repository" / model / "config.pbtxt").read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_default_bake_has_exactly_the_expected_tree(default_project):
    assert default_project.name == "image-classifier"
    assert tree(default_project) == EXPECTED_TREE


def test_generated_modules_stay_small_enough_to_read_and_the_pipeline_thin(default_project):
    """As generated, each module of the package reads in one sitting (at most 450 lines), and the pipeline's
    model.py, the file a user makes theirs, stays routing (at most 70): what grows goes into the layers below.
    Checked here, not in the project's own suite, which a user's recipes and code may grow."""
    package = next((default_project / "src").glob("*/__init__.py")).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in package.glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 450} == {}
    pipeline = default_project / "model_repository" / "pipeline" / "1" / "model.py"
    assert len(pipeline.read_text().splitlines()) <= 70


@pytest.mark.parametrize("answers", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_every_combination_bakes_completely(baker, answers):
    project = baker(**answers)
    files = tree(project)
    assert all("{{" not in f and "}}" not in f for f in files)
    for name in files:
        text = (project / name).read_text()
        assert not UNRENDERED.search(text), f"{name} has unrendered template text"
    for name in files:
        if name.endswith(".py"):
            py_compile.compile(str(project / name), doraise=True)
    assert tomllib.loads((project / "pyproject.toml").read_text())["project"]["name"] == project.name
    ensemble = answers.get("include_ensemble", True)
    assert (project / "model_repository" / "ensemble").is_dir() == ensemble


@pytest.mark.parametrize("answers", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_every_config_is_a_valid_model_config_with_the_answers(baker, answers):
    project = baker(**answers)
    context = json.loads((Path(__file__).parents[1] / "cookiecutter.json").read_text()) | answers
    batch, top_k = int(context["max_batch_size"]), int(context["top_k"])
    precision = answers.get("precision", context["precision"][0])  # a choice defaults to its first
    models = sorted(p.name for p in (project / "model_repository").iterdir())
    for model in models:
        config = model_config(project, model)
        assert config.name == model and config.max_batch_size == batch
    pixels = model_config(project, "preprocess").output[0]
    assert model_config_pb2.DataType.Name(pixels.data_type) == f"TYPE_{precision.upper()}"
    queue = {m: model_config(project, m).dynamic_batching.default_queue_policy.max_queue_size for m in models}
    # 64 clients at once queue at any max batch; preprocess also queues the pipeline's BLS calls.
    assert queue["pipeline"] == max(64, 4 * batch) and queue["preprocess"] == 2 * queue["pipeline"]
    assert queue["resnet"] == queue["postprocess"] == queue["preprocess"], "every stage's queue is bounded"
    variant = answers.get("resnet_variant", "resnet50")
    assert model_config(project, "resnet").parameters["variant"].string_value == variant
    # The class count lives in resnet's labels file (Triton's label_filename); every dims value agrees with it.
    logits = next(o for o in model_config(project, "resnet").output if o.name == "LOGITS")
    labels = (project / "model_repository" / "resnet" / logits.label_filename).read_text().splitlines()
    assert len(labels) == 1000 and all(labels) and labels[0] == "tench"
    post = model_config(project, "postprocess")
    assert list(logits.dims) == list(post.input[0].dims) == [len(labels)] and top_k <= len(labels)
    labels_file = post.parameters["labels_file"].string_value
    assert (project / "model_repository" / "postprocess" / labels_file).resolve() == (
        project / "model_repository" / "resnet" / logits.label_filename
    ).resolve()
    for entry in ("pipeline", "ensemble") if "ensemble" in models else ("pipeline",):
        config = model_config(project, entry)
        outputs = {o.name: (model_config_pb2.DataType.Name(o.data_type), list(o.dims)) for o in config.output}
        assert outputs == {
            "SCORES": ("TYPE_FP32", [top_k]),
            "CLASS_IDS": ("TYPE_INT64", [top_k]),
            "LABELS": ("TYPE_STRING", [top_k]),
        }


@pytest.mark.parametrize("answers", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_generated_code_passes_ruff(baker, answers):
    project = baker(**answers)
    for args in (["check"], ["format", "--check"]):
        result = subprocess.run([sys.executable, "-m", "ruff", *args, "."], cwd=project, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


INVALID = {
    "slug-with-spaces": ({"project_slug": "my project"}, "project_slug 'my project' must be lowercase"),
    "package-keyword": ({"package_name": "class"}, "package_name 'class' must be a lowercase Python identifier"),
    "package-not-identifier": ({"package_name": "1pkg"}, "package_name '1pkg' must be"),
    "package-shadows-torch": ({"package_name": "torch"}, "would shadow the module"),
    "package-shadows-stdlib": ({"package_name": "json"}, "would shadow the module"),
    "batch-zero": ({"max_batch_size": 0}, "max_batch_size must be from 1 to 1024, got 0"),
    "batch-too-big": ({"max_batch_size": 4096}, "max_batch_size must be from 1 to 1024"),
    "batch-not-a-number": ({"max_batch_size": "lots"}, "max_batch_size must be a whole number"),
    "batch-leading-zero": ({"max_batch_size": "064"}, "max_batch_size must be a whole number"),
    "port-with-spaces": ({"http_port": " 9000"}, "http_port must be a whole number"),
    "newline-in-description": ({"description": "two\nlines"}, "description contains a control character"),
    "top-k-over-classes": ({"top_k": 1001}, "top_k must be from 1 to 1000"),
    "unsupported-triton": ({"triton_version": "23.01"}, "triton_version '23.01' is not supported"),
    "same-ports": ({"grpc_port": 8000}, "three different ports"),
    "port-out-of-range": ({"metrics_port": 70000}, "metrics_port must be from 1024 to 65535"),
}


@pytest.mark.parametrize("answers, message", INVALID.values(), ids=INVALID.keys())
def test_invalid_answers_fail_with_the_hooks_message(baker, capfd, tmp_path, answers, message):
    with pytest.raises(FailedHookException):
        baker(**answers)
    err = capfd.readouterr().err
    assert any(line.startswith("ERROR: ") and message in line for line in err.splitlines()), err
    assert not any(tmp_path.iterdir()), "nothing is generated for invalid answers"


def test_a_rejected_answer_says_nothing_was_generated_and_which_lines_to_read(baker, capfd):
    with pytest.raises(FailedHookException):
        baker(top_k=0)
    err = capfd.readouterr().err.splitlines()
    assert err[0] == "ERROR: top_k must be from 1 to 1000, got 0"
    assert err[1].startswith("Nothing was generated. The ERROR line(s) above say what to fix")


def test_a_bake_prints_the_next_commands(baker, capfd):
    project = baker(project_name="Pet Classifier")
    out = capfd.readouterr().out
    assert project.name == "pet-classifier"
    assert "  cd pet-classifier && make setup weights-random demo\n" in out
    for target in ("setup", "weights-random", "demo", "serve", "test"):
        assert f"\n{target}:" in (project / "Makefile").read_text(), f"the message names make {target}"


@pytest.mark.parametrize("makefile", ["template", "generated"])
def test_make_help_has_no_colour_codes_when_piped_and_aligned_columns(default_project, makefile):
    cwd = Path(__file__).parents[1] if makefile == "template" else default_project
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    out = subprocess.run(["make", "--no-print-directory", "help"], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "\033" not in out.stdout and out.stdout, out.stderr
    lines = out.stdout.splitlines()
    targets = [line.split()[0] for line in lines]
    column = max(map(len, targets)) + 4  # "  target  description"
    assert all(line[column - 2 : column] == "  " and line[column] != " " for line in lines), out.stdout
    assert {"help", "test"} <= set(targets)


@pytest.mark.parametrize("minor, accepted", [(9, False), (10, True), (12, True), (13, False)])
def test_make_setup_checks_the_python_version_before_installing(baker, tmp_path, minor, accepted):
    """A stand-in interpreter that reports 3.<minor> to the check and stops at the next step (the venv)."""
    project = baker()
    fake = tmp_path / f"python3.{minor}"
    fake.write_text(
        "#!/bin/sh\n"
        f"if [ \"$1\" = -c ]; then exec {sys.executable} -c "
        f"'import sys; sys.version_info = (3, {minor}, 1, \"final\", 0); exec(sys.argv[2])' \"$@\"; fi\n"
        'echo "past the check: $*" >&2; exit 3\n'
    )
    fake.chmod(0o755)
    result = subprocess.run(["make", "setup", f"PYTHON={fake}"], cwd=project, capture_output=True, text=True)
    assert result.returncode != 0 and not (project / ".venv").exists()
    if accepted:
        assert "past the check: -m venv .venv" in result.stderr, result.stderr
    else:
        assert result.stderr.startswith(
            f"error: this project needs Python 3.10, 3.11 or 3.12, and {fake} is 3.{minor}: numpy<2"
        ), result.stderr
        assert "make setup PYTHON=python3.12" in result.stderr and "past the check" not in result.stderr
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["project"]["requires-python"] == ">=3.10,<3.13"
    assert "Python 3.10, 3.11 or 3.12" in (project / "README.md").read_text()
    assert "-rs" in pyproject["tool"]["pytest"]["ini_options"]["addopts"], "every skip says why"


def test_hostile_text_bakes_safely(baker):
    hostile = 'Bob\'s "Quoted" \\ Classifier ünï 😺 $HOME `id`'
    project = baker(project_name=hostile, description=hostile + " desc", author_name=hostile)
    assert project.name == "bob-s-quoted-classifier-uni-home-id"
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["description"] == hostile + " desc"
    assert meta["authors"] == [{"name": hostile}]
    for path in project.rglob("*.py"):
        py_compile.compile(str(path), doraise=True)
    assert hostile in (project / "README.md").read_text()


def test_e2e_ratios_pair_each_round_of_each_server(default_project, monkeypatch):
    """benchmarks/e2e.py's BLS / ensemble ratios on synthetic rows: per round and per server, never across them; a
    round where either entry point failed a request or answered none is n/a and left out of the median."""
    monkeypatch.syspath_prepend(str(default_project))
    from benchmarks import e2e

    def row(server, model, rnd, img_s, errors=0, n=16, c=8):
        return {"server": server, "precision": "as baked", "model": model, "round": rnd, "images_per_request": n,
                "concurrency": c, "img_s": img_s, "errors": errors}  # fmt: skip

    rows = [row(1, "pipeline", 1, 900.0), row(1, "ensemble", 1, 1000.0)]
    rows += [row(1, "ensemble", 2, 1000.0), row(1, "pipeline", 2, 1100.0)]
    rows += [row(2, "pipeline", 1, 500.0), row(2, "ensemble", 1, 1000.0)]  # same label, another server
    rows += [row(1, "pipeline", 1, 800.0, c=64), row(1, "ensemble", 1, 0.0, c=64)]  # nothing answered
    rows += [row(1, "pipeline", 2, 800.0, errors=3, c=64), row(1, "ensemble", 2, 900.0, c=64)]  # failed requests
    rows += [row(1, "pipeline", 1, 10.0, n=1, c=1)]  # no ensemble at this point: no ratio
    got = {(r["concurrency"], r["bls_vs_ensemble"][0] == 0.5): r for r in e2e.ratios(rows)}
    assert got[(8, False)]["bls_vs_ensemble"] == [0.9, 1.1] and got[(8, False)]["median"] == 1.0
    assert got[(8, True)]["rounds"] == [1] and got[(8, True)]["median"] == 0.5
    assert got[(64, False)]["bls_vs_ensemble"] == [None, None] and got[(64, False)]["median"] is None
    assert len(got) == 3
    table = e2e.ratio_table(e2e.ratios(rows))
    assert "| as baked | 16 | 8 | 0.90, 1.10 | 1.00 |" in table and "| n/a, n/a | n/a |" in table
    assert e2e.ratio_table([]) == ""
    with pytest.raises(SystemExit):
        e2e.parse_args(["--rounds", "0"])


def test_soak_verdict_tells_a_plateau_from_growth(default_project, monkeypatch):
    """benchmarks/soak.py's verdict on synthetic samples: growth that levels off passes, steady growth fails."""
    monkeypatch.syspath_prepend(str(default_project))
    from benchmarks import soak

    def samples(rss, shm=16.0):
        return [
            {
                "t_s": 5.0 * i,
                "rss_no_shm_mib": {"resnet": r, "tritonserver": 100.0},
                "shm_regions_mib": {"resnet": shm, "pipeline": 16.0},
                "shm_mib": shm + 16.0,
            }
            for i, r in enumerate(rss)
        ]

    def verdicts(rows):
        return {(r["metric"], r["process"]): r["verdict"] for r in rows}

    levelling = [900 + min(i, 10) * 90 + (i % 3) * 20 for i in range(30)]  # +900 MiB, then noise only
    levelling[26] += 400  # one large batch late in the run: a spike, not growth
    assert set(verdicts(soak.judge(samples(levelling), 64, 16)).values()) == {"flat", "reported"}  # reported: no bound
    leaking = [900 + 10 * i for i in range(30)]  # 10 MiB per sample, to the end
    rows = verdicts(soak.judge(samples(leaking), 64, 16))
    assert rows[("RSS - shm", "resnet")].startswith("GROWS") and rows[("RSS - shm", "tritonserver")] == "flat"
    # a region that steps up once, late, has met a larger burst; one that keeps stepping up is leaking
    once = [
        dict(s, shm_regions_mib={"resnet": 16.0 + 16 * (i >= 25), "pipeline": 16.0})
        for i, s in enumerate(samples(levelling))
    ]
    assert verdicts(soak.judge(once, 64, 16))[("/dev/shm", "resnet region")] == "flat"
    steps = [
        dict(s, shm_regions_mib={"resnet": 16.0 + 16 * (i // 5), "pipeline": 16.0})
        for i, s in enumerate(samples(levelling))
    ]
    rows = verdicts(soak.judge(steps, 64, 16))
    assert rows[("/dev/shm", "resnet region")].startswith("GROWS") and rows[("/dev/shm", "pipeline region")] == "flat"
    assert verdicts(soak.judge(samples([900, 1000, 1100]), 64, 16))[("RSS - shm", "resnet")].startswith("not judged")


SUITE_COMBINATIONS = {"default": {}}
# The second whole-suite bake is also made the user's own with recipe 1 (one bake, no extra server starts).
MADE_YOURS = {"resnet_variant": "resnet18", "precision": "fp16", "max_batch_size": 4}


def run_baked_tests(project: Path, *pytest_args: str, as_generated: bool = True) -> subprocess.CompletedProcess:
    """The baked project's own tests (all, or those pytest_args select), against a real local tritonserver.
    as_generated=False: a project its user changed, where the guide's recipes skip instead of failing."""
    # Triton's Python-backend stubs import the package from this interpreter's site-packages (PYTHONPATH does
    # not reach them), so the baked project is installed, as its own Makefile would.
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(project)]
    subprocess.run(pip, check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if as_generated:
        env["RECIPES_MUST_APPLY"] = "1"  # the project as generated: docs/customizing.md's diffs must apply to it
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *pytest_args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(result.stdout if result.returncode else result.stdout[-6000:], result.stderr[-3000:])  # all of a failure
    return result


def passed(result: subprocess.CompletedProcess) -> bool:
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    return result.returncode == 0 and " passed" in summary and "failed" not in summary and "error" not in summary


def test_a_users_own_model_py_skips_the_guides_recipe_tests_instead_of_failing_them(tmp_path):
    """The recipe tests apply docs/customizing.md's diffs to the generated files. Once the user has changed
    pipeline/1/model.py, they skip with one line in the user's project, and still fail in the template's own run
    (RECIPES_MUST_APPLY), where the guide must follow the file."""
    project = bake(tmp_path)
    model_py = project / "model_repository" / "pipeline" / "1" / "model.py"
    old = "        logits = pixels.then(self.resnet)"  # a line recipe 2's diff edits around
    assert old in model_py.read_text()
    model_py.write_text(model_py.read_text().replace(old, "        logits = pixels.then(self.resnet)  # mine"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(project)]
    subprocess.run(pip, check=True, timeout=300)
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_customizing.py"]
    argv += ["-k", "lint_free"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "RECIPES_MUST_APPLY")}
    yours = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert yours.returncode == 0 and " skipped" in yours.stdout, yours.stdout + yours.stderr
    assert "model.py is yours now: the guide's recipes apply to it as generated" in yours.stdout
    env["RECIPES_MUST_APPLY"] = "1"
    template = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert template.returncode == 1 and "update docs/customizing.md along with the file" in template.stdout


@pytest.mark.parametrize("answers", SUITE_COMBINATIONS.values(), ids=SUITE_COMBINATIONS.keys())
def test_baked_project_passes_its_own_test_suite(tmp_path, answers):
    """The baked project's unit, end-to-end and reliability tests, against a real local tritonserver."""
    assert passed(run_baked_tests(bake(tmp_path, **answers)))


def save_resnet18(path: Path, classes: int, seed: int) -> Path:
    """A fine-tuned torchvision ResNet-18's state dict (its own fc, `classes` outputs), made here, seeded."""
    import torch
    import torchvision

    torch.manual_seed(seed)
    torch.save(torchvision.models.resnet18(num_classes=classes).state_dict(), path)
    return path


def run_guide_commands(project: Path, recipe: int, *options: str) -> None:
    """docs/customizing.md's `weights import` lines of that recipe, as a user runs them in their own project, with
    `options` added (e.g. --top-k 3)."""
    guide = (project / "docs" / "customizing.md").read_text()
    section = guide.split(f"\n## {recipe}. ", 1)[1].split("\n## ", 1)[0]
    commands = [line for line in section.splitlines() if " weights import " in line and line.startswith(".venv/")]
    assert commands, f"recipe {recipe} shows its weights import command"
    package = tomllib.loads((project / "pyproject.toml").read_text())["project"]["scripts"][project.name]
    for line in commands:
        args = [*shlex.split(line.split("#")[0])[1:], *options]  # .venv/bin/<slug> -> this interpreter's module
        cli = [sys.executable, "-m", package.split(":")[0], *args]
        env = {**os.environ, "PYTHONPATH": str(project / "src")}  # not installed yet: run_baked_tests does that
        done = subprocess.run(cli, cwd=project, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr


def apply_guide_diffs(project: Path, recipe: int) -> None:
    """docs/customizing.md's diffs of that recipe, applied to the project's files by the project's own
    tests/test_customizing.py (which fails if one does not apply)."""
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, 'tests'); import test_customizing as t; "
        f"t.apply_diffs(t.sections(t.GUIDE.read_text())[{recipe}], Path('.'))"
    )
    env = {**os.environ, "PYTHONPATH": str(project / "src"), "RECIPES_MUST_APPLY": "1"}
    argv = [sys.executable, "-c", code]
    done = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def recipe_1(project: Path, classes: int = 10, *options: str) -> list[str]:
    """docs/customizing.md's recipe 1 as a user runs it in their own project: a fine-tuned ResNet-18 (its own fc,
    `classes` outputs) and its labels file in the project root, then the recipe's `weights import` lines as
    written, with `options` added. Nothing is downloaded. Returns the labels."""
    save_resnet18(project / "my_resnet18.pt", classes, seed=7)
    labels = [f"breed {i}" for i in range(classes)]
    (project / "my_labels.txt").write_text("".join(label + "\n" for label in labels))
    run_guide_commands(project, 1, *options)
    return labels


GATE_CONFIG = """name: "gate"
backend: "python"
max_batch_size: {batch}
input [ {{ name: "PIXELS", data_type: {dtype}, dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "BRIGHTNESS", data_type: TYPE_FP32, dims: [ 1 ] }} ]
dynamic_batching {{ }}
instance_group [ {{ count: 1, kind: KIND_AUTO }} ]
parameters [ {{ key: "FORCE_CPU_ONLY_INPUT_TENSORS", value: {{ string_value: "no" }} }} ]
"""
GATE_MODEL = '''"""Pixels -> the mean brightness of each image (0 black, 1 white)."""

import torch
import triton_python_backend_utils as pb_utils

from {package}.python_backend import Instance, exit_stub, to_triton
from {package}.stages import IMAGENET_MEAN, IMAGENET_STD


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            pixels = self.instance.input(request, "PIXELS").float()
            mean = torch.tensor(IMAGENET_MEAN, device=pixels.device).view(1, 3, 1, 1)
            std = torch.tensor(IMAGENET_STD, device=pixels.device).view(1, 3, 1, 1)
            brightness = (pixels * std + mean).mean(dim=(1, 2, 3)).unsqueeze(1)
            responses.append(pb_utils.InferenceResponse([to_triton("BRIGHTNESS", brightness)]))
        return responses

    def finalize(self):
        exit_stub()
'''
GATE_CALL = '''
    def gate(self, pixels):
        """Reject a request whose images are too dark to classify, by a BLS call to the gate model."""
        result = self.instance.infer("gate", [to_triton("PIXELS", pixels)], ["BRIGHTNESS"], self.timeout_us)
        if bool((self.instance.to_torch(result["BRIGHTNESS"]) < 0.1).any()):
            raise InvalidImage("too dark to classify")
'''


def add_a_gate_model(project: Path, package: str) -> None:
    """A fourth model in the BLS pipeline, as docs/customizing.md's recipe 2 says a stage of its own is added: its
    directory in the model repository, a BLS call in the pipeline, and its entry in BLS_CALLS."""
    repository = project / "model_repository"
    resnet = model_config(project, "resnet")
    dtype = model_config_pb2.DataType.Name(resnet.input[0].data_type)
    (repository / "gate" / "1").mkdir(parents=True)
    (repository / "gate" / "config.pbtxt").write_text(GATE_CONFIG.format(batch=resnet.max_batch_size, dtype=dtype))
    (repository / "gate" / "1" / "model.py").write_text(GATE_MODEL.format(package=package))
    model_py = repository / "pipeline" / "1" / "model.py"
    lines = model_py.read_text().splitlines(keepends=True)
    last_pixels = max(i for i, line in enumerate(lines) if line.startswith("        pixels = "))
    lines.insert(last_pixels + 1, "        pixels = pixels.each(self.gate)  # a model of its own\n")
    text = "".join(lines)
    if "InvalidImage" not in text:
        text = text.replace("    to_triton,\n)\n", f"    to_triton,\n)\nfrom {package}.stages import InvalidImage\n", 1)
    at = text.index("    def resnet(self, pixels")
    text = text[:at] + GATE_CALL.lstrip("\n") + "\n" + text[at:]
    model_py.write_text(text)
    source = project / "src" / package / "model_repository.py"
    old = 'BLS_CALLS = {"pipeline": ("preprocess", "resnet", "postprocess")}'
    assert old in source.read_text()
    source.write_text(source.read_text().replace(old, old.replace('"postprocess")', '"postprocess", "gate")')))


def test_a_project_made_yours_keeps_its_own_suite_green(tmp_path):
    """A user who follows docs/customizing.md in their own project keeps a green `make test`: recipe 1 with 3
    classes and `--top-k 3` (a 3-class ResNet-18, their labels; the bake's top-5 cut to 3), recipe 2's gate,
    recipe 3's routing (a second ResNet version, both loaded), then a fourth model added to the pipeline as the
    guide says. Then the baked project's whole CPU suite runs as the user's: unit, end-to-end, reliability, shared
    memory, and the customizing recipes (which skip on the files that are now the user's). Also the second option
    combination the whole suite runs for: fp16, max batch 4, no ensemble."""
    project = bake(tmp_path, **MADE_YOURS, include_ensemble=False)
    labels = recipe_1(project, 3, "--top-k", "3")
    apply_guide_diffs(project, 2)
    save_resnet18(project / "my_resnet18_v2.pt", 3, seed=8)
    run_guide_commands(project, 3)
    apply_guide_diffs(project, 3)
    add_a_gate_model(project, "image_classifier")
    repository = project / "model_repository"
    assert (repository / "resnet" / "labels.txt").read_text().splitlines() == labels
    assert [list(o.dims) for o in model_config(project, "resnet").output] == [[3]]
    assert [list(o.dims) for o in model_config(project, "pipeline").output] == [[3]] * 3
    assert (repository / "resnet" / "2" / "weights.pt").is_file()
    assert passed(run_baked_tests(project, as_generated=False))


def test_smallest_max_batch_serves_ordinary_concurrency_and_still_rejects_overload(tmp_path):
    """max_batch_size=1 is where a queue sized by the batch alone would be smallest: 16 clients at once are all
    served (and the 8-client load test holds), while true overload is still rejected fast. Only these tests:
    the whole suite already runs for two other combinations."""
    answers = {"resnet_variant": "resnet18", "precision": "bf16", "max_batch_size": 1, "top_k": 1000}
    project = bake(tmp_path, **answers, include_ensemble=False)
    selected = "ordinary_concurrency or load_holds or overload_is_rejected"
    result = run_baked_tests(project, "-rA", "tests/test_reliability.py", "-k", selected)
    assert passed(result)
    ran = re.findall(r"^PASSED tests/test_reliability.py::(test_\w+)", result.stdout, re.MULTILINE)
    assert set(ran) == {
        "test_ordinary_concurrency_is_served_not_rejected",
        "test_load_holds_with_no_errors_and_no_leak",
        "test_overload_is_rejected_fast_instead_of_queued_forever",
    }, result.stdout[-3000:]
