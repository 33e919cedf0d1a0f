"""docs/customizing.md, recipe by recipe, against a real tritonserver over gRPC.

The guide's `weights import` commands are run and its diffs applied exactly as written, in order, to a fresh copy
of this project's model repository; one server then serves them all. Recipe 4 is tested twice: its HTTP call
promotes recipe 3's canary here, and tests/test_reliability.py loads a new pipeline version under load. A diff
that no longer applies fails here: update the guide along with the file it changes.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
import tritonclient.grpc as grpcclient
from conftest import (
    EXTERNAL_GRPC_URL,
    PROJECT,
    assert_same_answers,
    image_input,
    infer,
    local_server,
    make_image,
    outputs,
)
from PIL import Image
from test_e2e import tolerance
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from {{ cookiecutter.package_name }}.model_repository import BLS_CALLS, load_config, pixels_dtype, top_k
from {{ cookiecutter.package_name }}.stages import Reference

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(bool(EXTERNAL_GRPC_URL), reason="applies the recipes to a server of its own"),
]
GUIDE = PROJECT / "docs" / "customizing.md"
MY_LABELS = [f"my class {i}" for i in range(10)]  # recipe 1's my_labels.txt: a 10-class ResNet-18


def sections(guide: str) -> dict[int, str]:
    """The guide's numbered recipes: {1: text of "## 1. ...", ...}."""
    parts = guide.split("\n## ")
    return {int(part.split(".")[0]): part for part in parts[1:] if part[:1].isdigit()}


# Set by the template's own tests, where the project is as generated: a recipe that no longer applies to the file it
# edits is then a failure (the guide must follow the file). In your project, once you change that file, the recipe
# tests skip with one line instead.
RECIPES_MUST_APPLY = "RECIPES_MUST_APPLY"


def blocks(section: str, language: str) -> list[str]:
    """The fenced ```language blocks of a section, in order."""
    return [block.split("```", 1)[0] for block in section.split(f"```{language}\n")[1:]]


def apply_diffs(section: str, project: Path) -> list[Path]:
    """Apply the section's ```diff blocks to the files they name (paths relative to the project root).

    Hunks carry no line numbers: each hunk's context and removed lines must appear exactly once in the file,
    and are replaced by its context and added lines.
    """
    changed = []
    for block in blocks(section, "diff"):
        lines = block.splitlines()
        assert lines[0].startswith("--- ") and lines[1].startswith("+++ "), block
        path = project / lines[1][4:].strip()
        text = path.read_text().splitlines()
        hunks, hunk = [], None
        for line in lines[2:]:
            if line.startswith("@@"):
                hunk = ([], [])
                hunks.append(hunk)
            else:
                sign, content = (line[:1], line[1:]) if line else (" ", "")
                if sign in " -":
                    hunk[0].append(content)
                if sign in " +":
                    hunk[1].append(content)
        for before, after in hunks:
            at = [i for i in range(len(text) - len(before) + 1) if text[i : i + len(before)] == before]
            if len(at) != 1 and not os.environ.get(RECIPES_MUST_APPLY):  # your project, no longer as generated
                pytest.skip(f"{path.relative_to(project)} is yours now: the guide's recipes apply to it as generated")
            assert len(at) == 1, (
                f"the guide's diff for {path.relative_to(project)} does not apply ({len(at)} matches of):\n"
                + "\n".join(before)
                + "\nupdate docs/customizing.md along with the file"
            )
            text[at[0] : at[0] + len(before)] = after
        path.write_text("\n".join(text) + "\n")
        changed.append(path)
    return changed


def run_commands(section: str, cwd: Path, repository: Path) -> None:
    """Run the section's `weights import` command lines, as written, on `repository`."""
    commands = [line for block in blocks(section, "bash") for line in block.splitlines() if " weights import " in line]
    assert commands, "the recipe shows its weights import command"
    for line in commands:
        args = shlex.split(line.split("#")[0])[1:]  # the console script -> this interpreter's module
        cli = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", *args, "--model-repository", str(repository)]
        subprocess.run(cli, cwd=cwd, check=True, capture_output=True, timeout=300)


def save_resnet18(path: Path, seed: int) -> Path:
    """A 10-class ResNet-18 state dict, as fine-tuning with a new fc leaves it."""
    torch.manual_seed(seed)
    torch.save(torchvision.models.resnet18(num_classes=len(MY_LABELS)).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def guide() -> dict[int, str]:
    if not GUIDE.is_file():
        pytest.skip("docs/customizing.md is not here (the container image has no docs)")
    return sections(GUIDE.read_text())


@pytest.fixture(scope="module")
def project(guide, tmp_path_factory) -> Path:
    """A copy of the project with recipes 1, 2 and 3 applied as the guide says: returns its root."""
    root = tmp_path_factory.mktemp("customized")
    repository = root / "model_repository"
    ignore = shutil.ignore_patterns("weights.pt", "__pycache__")
    shutil.copytree(PROJECT / "model_repository", repository, ignore=ignore)
    save_resnet18(root / "my_resnet18.pt", seed=1)
    (root / "my_labels.txt").write_text("".join(label + "\n" for label in MY_LABELS))
    run_commands(guide[1], root, repository)
    apply_diffs(guide[2], root)
    save_resnet18(root / "my_resnet18_v2.pt", seed=2)
    run_commands(guide[3], root, repository)
    apply_diffs(guide[3], root)
    return root


@pytest.fixture(scope="module")
def server(project, tmp_path_factory):
    """One server for every recipe, on the customized repository."""
    with local_server(project / "model_repository", tmp_path_factory.mktemp("log") / "tritonserver.log") as triton:
        yield triton


@pytest.fixture(scope="module")
def references(project, server) -> dict[int, Reference]:
    """{resnet version: the same stages in-process with that version's weights}, on the server's device."""
    repository = project / "model_repository"
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        kinds = {group.kind for group in client.get_model_config("preprocess").config.instance_group}
    device = "cuda" if model_config_pb2.ModelInstanceGroup.KIND_GPU in kinds else "cpu"
    dtype = pixels_dtype(repository)
    weights = {v: repository / "resnet" / str(v) / "weights.pt" for v in (1, 2)}
    return {v: Reference("resnet18", w, top_k(repository), device=device, dtype=dtype) for v, w in weights.items()}


def assert_answers(result, images, reference):
    scores, class_ids = reference(images)
    np.testing.assert_allclose(result.as_numpy("SCORES"), scores.cpu().numpy(), **tolerance(reference))
    assert (result.as_numpy("CLASS_IDS")[:, 0] == class_ids[:, 0].cpu().numpy()).all()


def dark_image() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (160, 120), (8, 6, 10)).save(out, format="PNG")
    return out.getvalue()


def test_recipe_1_your_classifier_answers_with_your_labels(server, project, references):
    max_batch = load_config(project / "model_repository" / "pipeline").max_batch_size
    images = [make_image(300), make_image(301, fmt="PNG")][:max_batch]
    bls = infer(server.grpc_url, [image_input(images)], "pipeline")
    assert_answers(bls, images, references[1])
    class_ids, labels = bls.as_numpy("CLASS_IDS"), bls.as_numpy("LABELS")
    assert [[label.decode() for label in row] for row in labels] == [[MY_LABELS[i] for i in row] for row in class_ids]
    if (project / "model_repository" / "ensemble").is_dir():
        ensemble = infer(server.grpc_url, [image_input(images)], "ensemble")
        assert_same_answers(outputs(ensemble), outputs(bls), project / "model_repository")


def test_recipe_2_the_gate_rejects_a_too_dark_image_alone(server, references):
    good = make_image(310)

    def send(image):
        try:
            return int(infer(server.grpc_url, [image_input([image])]).as_numpy("CLASS_IDS")[0, 0])
        except InferenceServerException as exc:
            return exc.status(), exc.message()

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, [dark_image(), good, dark_image(), good]))
    expected = int(references[1]([good])[1][0, 0])
    assert answers[1] == answers[3] == expected
    for status, message in (answers[0], answers[2]):
        assert status == "StatusCode.INVALID_ARGUMENT" and "too dark to classify" in message, message


def test_recipe_3_a_request_parameter_picks_the_resnet_version(server, project, references):
    image = make_image(320)
    a, b = (references[v]([image])[0] for v in (1, 2))
    assert not torch.allclose(a, b, **tolerance(references[1])), "the two versions answer differently"

    def send(version):
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            parameters = None if version is None else {"resnet_version": version}
            return client.infer("pipeline", [image_input([image])], parameters=parameters, client_timeout=120)

    with ThreadPoolExecutor(6) as pool:  # concurrent requests for both versions share execute() batches
        routes = [None, "2", "1", "2", None, "2"]
        results = list(pool.map(send, routes))
    for route, result in zip(routes, results):
        assert_answers(result, [image], references[2 if route == "2" else 1])  # no parameter: the pinned 1
    with pytest.raises(InferenceServerException) as error:
        send("7")
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT" and "is not one of" in error.value.message()
    if (project / "model_repository" / "ensemble").is_dir():  # pinned to version 1: it cannot route
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            pinned = client.infer("ensemble", [image_input([image])], parameters={"resnet_version": "2"})
        assert_answers(pinned, [image], references[1])


def test_recipe_4_promoting_the_canary_under_load_loses_no_request(guide, server, project, references):
    """Recipe 3's promotion (the pinned default becomes version 2) with recipe 4's HTTP call, as the guide writes
    it, while two clients keep sending."""
    (curl,) = [line for block in blocks(guide[4], "bash") for line in block.splitlines() if "curl" in line]
    header = re.search(r'-H "([^:]+): \$TRITON_ADMIN_KEY"', curl).group(1)
    path = re.search(r"localhost:\d+(/v2/\S+)", curl).group(1)
    config = project / "model_repository" / "pipeline" / "config.pbtxt"
    pinned = '{ key: "resnet_version", value: { string_value: "1" } }'
    assert config.read_text().count(pinned) == 1
    config.write_text(config.read_text().replace(pinned, pinned.replace('"1"', '"2"')))

    image = make_image(330)
    expected = {v: references[v]([image])[0].cpu().numpy() for v in (1, 2)}
    stop, answers = threading.Event(), {0: [], 1: []}  # per client, in order

    def client(i):
        with grpcclient.InferenceServerClient(server.grpc_url) as c:
            deadline = time.monotonic() + 300
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    scores = c.infer("pipeline", [image_input([image])], client_timeout=120).as_numpy("SCORES")
                    close = [v for v in (1, 2) if np.allclose(scores, expected[v], **tolerance(references[v]))]
                    answers[i].append(close[0] if len(close) == 1 else f"neither version: {scores}")
                except InferenceServerException as exc:
                    answers[i].append(f"error: {exc.message()}")

    threads = [threading.Thread(target=client, args=(i,)) for i in answers]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1)
        url = f"http://{server.settings.address}:{server.settings.http_port}{path}"
        request = urllib.request.Request(url, method="POST", headers={header: server.settings.admin_key})
        with urllib.request.urlopen(request, timeout=300) as response:
            assert response.status == 200
        deadline = time.monotonic() + 120
        while any(seen[-2:] != [2, 2] for seen in answers.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    every = answers[0] + answers[1]
    print(f"\npromotion: {every.count(1)} answered by version 1, then {every.count(2)} by version 2")
    assert [a for a in every if a not in (1, 2)] == []
    for seen in answers.values():  # each client: version 1, then from the switch on version 2 only
        assert seen[0] == 1 and seen[-1] == 2 and seen == sorted(seen)


def test_recipe_4_is_the_reliability_hot_reload_test(guide):
    name = "test_hot_reload_of_the_pipeline_under_load_loses_no_request"
    assert f"tests/test_reliability.py::{name}" in guide[4]
    assert f"def {name}(" in (PROJECT / "tests" / "test_reliability.py").read_text()


@pytest.mark.parametrize("recipes", [(2,), (3,), (2, 3)], ids=["2-alone", "3-alone", "2-then-3"])
def test_the_recipes_apply_alone_and_leave_lint_free_code(guide, tmp_path, recipes):
    model_py = tmp_path / "model_repository" / "pipeline" / "1" / "model.py"
    shutil.copytree(PROJECT / "model_repository", tmp_path / "model_repository", ignore=shutil.ignore_patterns("*.pt"))
    for recipe in recipes:
        apply_diffs(guide[recipe], tmp_path)
    called = set(re.findall(r'infer\(\s*"(\w+)"', model_py.read_text()))  # the pipeline's BLS calls
    assert called and called <= set(BLS_CALLS["pipeline"]), "a model the pipeline calls goes in BLS_CALLS"
    ruff = shutil.which("ruff") or pytest.skip("ruff is not installed")
    config = ["--config", str(PROJECT / "pyproject.toml")]
    for args in (["check"], ["format", "--check"]):
        result = subprocess.run([ruff, *args, *config, str(model_py)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_recipes_1_2_and_3_apply_in_order_after_an_import_with_its_own_top_k(guide, tmp_path):
    """Recipe 1 with 3 classes and `--top-k 3` edits only the values that depend on them, so recipe 3's config
    diffs (and recipe 2's) still apply to the files it wrote, with every comment of the configs kept."""
    repository = tmp_path / "model_repository"
    shutil.copytree(PROJECT / "model_repository", repository, ignore=shutil.ignore_patterns("*.pt", "__pycache__"))
    configs = sorted(repository.glob("*/config.pbtxt"))
    comments = {p: [line for line in p.read_text().splitlines() if "#" in line] for p in configs}
    torch.manual_seed(3)
    torch.save(torchvision.models.resnet18(num_classes=3).state_dict(), tmp_path / "my_resnet18.pt")
    (tmp_path / "my_labels.txt").write_text("cat\ndog\nbird\n")
    cli = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", "weights", "import", "my_resnet18.pt"]
    cli += ["--labels", "my_labels.txt", "--variant", "resnet18", "--top-k", "3", "--model-repository", str(repository)]
    subprocess.run(cli, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    for path, lines in comments.items():
        kept = [line for line in path.read_text().splitlines() if "#" in line]
        assert kept == lines, f"{path.relative_to(tmp_path)}: its comments are kept"
    changed = [*apply_diffs(guide[2], tmp_path), *apply_diffs(guide[3], tmp_path)]
    assert {p.relative_to(tmp_path).as_posix() for p in changed} >= {
        "model_repository/pipeline/config.pbtxt",
        "model_repository/resnet/config.pbtxt",
        "model_repository/pipeline/1/model.py",
    }
    assert [list(o.dims) for o in load_config(repository / "pipeline").output] == [[3]] * 3
    assert load_config(repository / "pipeline").parameters["resnet_versions"].string_value == "1,2"
