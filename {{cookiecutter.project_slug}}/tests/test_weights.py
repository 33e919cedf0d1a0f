"""`weights import | random | pretrained` and the files they keep consistent: weights.pt, labels.txt and every
config.pbtxt field that depends on the class count. No server: checks of the files themselves."""

import argparse
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torchvision
from conftest import PROJECT

from {{ cookiecutter.package_name }}.model_repository import labels_path, load_config, num_classes, resnet_weights, top_k
from {{ cookiecutter.package_name }}.stages import Classifier, imagenet_labels, read_labels
from {{ cookiecutter.package_name }}.weights import (
    WeightsError,
    import_weights,
    load_state_dict,
    random_state,
)


def dims(repository, model, name):
    config = load_config(repository / model)
    return [list(t.dims) for t in (*config.input, *config.output) if t.name == name][0]


def assert_consistent(repository, classes, k):
    """Every place the class count and top-k live agrees."""
    labels = read_labels(labels_path(repository))
    assert len(labels) == num_classes(repository) == classes
    assert dims(repository, "resnet", "LOGITS") == dims(repository, "postprocess", "LOGITS") == [classes]
    labels_file = load_config(repository / "postprocess").parameters["labels_file"].string_value
    assert (repository / "postprocess" / labels_file).resolve() == labels_path(repository).resolve()
    for model in ("postprocess", "pipeline", "ensemble"):
        if (repository / model).is_dir():
            for name in ("SCORES", "CLASS_IDS", "LABELS"):
                assert dims(repository, model, name) == [k]
    return labels


@pytest.fixture
def repository(tmp_path):
    repo = tmp_path / "model_repository"
    shutil.copytree(PROJECT / "model_repository", repo, ignore=shutil.ignore_patterns("weights.pt", "__pycache__"))
    return repo


@pytest.fixture(scope="module")
def resnet18_10(tmp_path_factory):
    """A 10-class ResNet-18 state dict, as fine-tuning with a new fc leaves it."""
    torch.manual_seed(1)
    return torchvision.models.resnet18(num_classes=10).state_dict()


def test_the_project_repository_is_consistent_at_its_own_class_count():
    """The project's own repository, as shipped or as `weights import` left it: its class count (the lines of
    labels.txt), labels and top-k agree everywhere. Where it holds ImageNet's labels, they are exactly ImageNet's."""
    repository = PROJECT / "model_repository"
    classes = len(read_labels(labels_path(repository)))
    labels = assert_consistent(repository, classes, top_k(repository))
    assert 1 <= top_k(repository) <= classes
    if classes == 1000 and labels[0] == imagenet_labels()[0]:
        assert labels == imagenet_labels()


@pytest.mark.parametrize("wrap", ["state-dict", "checkpoint-with-module-prefix", "lightning-style"])
def test_import_a_10_class_resnet18_writes_weights_labels_and_configs(repository, resnet18_10, tmp_path, wrap):
    path, labels = tmp_path / "mine.pt", [f"kind {i}" for i in range(10)]
    torch.save(
        {
            "state-dict": resnet18_10,
            "checkpoint-with-module-prefix": {
                "epoch": 7,
                "state_dict": {f"module.{k}": v for k, v in resnet18_10.items()},
            },
            "lightning-style": {"state_dict": {f"model.{k}": v for k, v in resnet18_10.items()}, "global_step": 3},
        }[wrap],
        path,
    )
    (tmp_path / "labels.txt").write_text("\n".join(labels) + "\n")
    done = import_weights(repository, path, tmp_path / "labels.txt", variant="resnet18", top_k=3)
    assert (done.classes, done.top_k, done.variant) == (10, 3, "resnet18")
    assert assert_consistent(repository, 10, 3) == labels
    variant, weights = resnet_weights(repository)
    assert variant == "resnet18"
    saved = torch.load(weights, weights_only=True)
    assert saved.keys() == resnet18_10.keys() and all(torch.equal(saved[k], resnet18_10[k]) for k in saved)
    assert Classifier(variant, weights, num_classes=10)(torch.zeros(1, 3, 224, 224)).shape == (1, 10)
    header = (repository / "resnet" / "config.pbtxt").read_text().splitlines()[0]
    assert header.startswith("# "), "the rewritten config keeps its header comment"


def test_random_keeps_the_imported_classes_labels_and_configs_and_imagenet_brings_them_back(
    repository, resnet18_10, tmp_path
):
    """`weights random` (what `make serve` runs on a fresh clone without weights.pt) writes weights for the classes
    you imported and leaves labels.txt and every config byte for byte as they were; `--imagenet` goes back."""
    torch.save(resnet18_10, tmp_path / "mine.pt")
    (tmp_path / "labels.txt").write_text("".join(f"kind {i}\n" for i in range(10)))
    import_weights(repository, tmp_path / "mine.pt", tmp_path / "labels.txt", variant="resnet18", top_k=3)
    files = {p: p.read_bytes() for p in repository.rglob("*") if p.is_file() and p.suffix in (".txt", ".pbtxt")}
    cli = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", "weights", "random", "--model-repository"]
    subprocess.run([*cli, str(repository)], check=True, capture_output=True, timeout=300)
    assert {p: p.read_bytes() for p in files} == files
    assert torch.load(resnet_weights(repository)[1], weights_only=True)["fc.weight"].shape == (10, 512)
    subprocess.run([*cli, str(repository), "--imagenet"], check=True, capture_output=True, timeout=300)
    assert assert_consistent(repository, 1000, 3) == imagenet_labels()
    assert torch.load(resnet_weights(repository)[1], weights_only=True)["fc.weight"].shape == (1000, 512)


def test_random_also_writes_the_other_versions_that_have_no_weights(repository, resnet18_10, tmp_path):
    """A project with recipe 3's second resnet version, cloned fresh (weights.pt is git-ignored): `weights random`,
    which `make serve` runs, writes weights for version 2 too, or serve would refuse it as missing."""
    torch.save(resnet18_10, tmp_path / "mine.pt")
    import_weights(repository, tmp_path / "mine.pt", variant="resnet18")
    second = import_weights(repository, tmp_path / "mine.pt", variant="resnet18", version=2).weights
    for weights in repository.glob("resnet/*/weights.pt"):
        weights.unlink()
    cli = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", "weights", "random", "--model-repository"]
    out = subprocess.run([*cli, str(repository)], check=True, capture_output=True, text=True, timeout=300).stdout
    assert f"the other versions: {second}" in out
    first = torch.load(resnet_weights(repository)[1], weights_only=True)
    other = torch.load(second, weights_only=True)
    assert first["fc.weight"].shape == other["fc.weight"].shape == (10, 512)
    assert not torch.equal(first["fc.weight"], other["fc.weight"]), "each version its own seed"


def test_default_labels_are_numbered(repository, resnet18_10, tmp_path):
    torch.save(resnet18_10, tmp_path / "mine.pt")
    import_weights(repository, tmp_path / "mine.pt", variant="resnet18")
    assert assert_consistent(repository, 10, top_k(repository)) == [f"class_{i}" for i in range(10)]


def test_a_model_with_other_classes_than_the_config_fails_to_load_with_the_fix(tmp_path, resnet18_10):
    torch.save(resnet18_10, tmp_path / "w.pt")
    with pytest.raises(ValueError, match="has 10 classes .* configured for 1000: .*weights import"):
        Classifier("resnet18", tmp_path / "w.pt", num_classes=1000)


def save(tmp_path, name, obj):
    path = tmp_path / name
    if isinstance(obj, bytes):
        path.write_bytes(obj)
    else:
        torch.save(obj, path)
    return path


ERRORS = {
    "labels-count": (
        lambda t, sd: dict(
            path=save(t, "w.pt", sd), labels=save(t, "l.txt", "".join(f"c{i}\n" for i in range(12)).encode())
        ),
        "fc has 10 outputs but the labels file has 12 lines",
    ),
    "top-k-over-classes": (
        lambda t, sd: dict(path=save(t, "w.pt", sd), top_k=11),
        "top_k is 11 but the model has only 10 classes: pass --top-k",
    ),
    "another-resnet": (
        lambda t, sd: dict(path=save(t, "w.pt", torchvision.models.resnet34(num_classes=10).state_dict())),
        "the state dict is a resnet34, not a resnet18: pass --variant resnet34",
    ),
    "not-a-resnet": (
        lambda t, sd: dict(path=save(t, "w.pt", torchvision.models.mobilenet_v3_small(num_classes=10).state_dict())),
        "not a torchvision ResNet state dict: it has no fc.weight",
    ),
    "not-a-checkpoint": (
        lambda t, sd: dict(path=save(t, "w.pt", b"\xff\xd8\xff\xe0 a JPEG, not a checkpoint")),
        "is not a PyTorch checkpoint",
    ),
    "missing-labels-file": (
        lambda t, sd: dict(path=save(t, "w.pt", sd), labels=t / "no_such_labels.txt"),
        "no_such_labels.txt does not exist: pass the path of your class names",
    ),
    "blank-label-line": (
        lambda t, sd: dict(path=save(t, "w.pt", sd), labels=save(t, "l.txt", b"a\n\nc\n")),
        "line 2 is blank; write one class name per line",
    ),
}


@pytest.mark.parametrize("make, message", ERRORS.values(), ids=ERRORS.keys())
def test_import_errors_name_the_fix_and_change_nothing(repository, resnet18_10, tmp_path, make, message):
    before = {p: p.read_bytes() for p in repository.rglob("*") if p.is_file()}
    args = make(tmp_path, resnet18_10)
    cli = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", "weights", "import", str(args["path"])]
    cli += ["--variant", "resnet18", "--model-repository", str(repository)]
    cli += ["--labels", str(args["labels"])] if "labels" in args else []
    cli += ["--top-k", str(args["top_k"])] if "top_k" in args else []
    result = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1 and "Errno" not in result.stderr, "one line, in words"
    assert {p: p.read_bytes() for p in repository.rglob("*") if p.is_file()} == before


def test_import_says_what_it_imported_and_where(repository, resnet18_10, tmp_path):
    torch.save(resnet18_10, tmp_path / "mine.pt")
    cli = [sys.executable, "-m", "{{ cookiecutter.package_name }}.cli", "weights", "import", str(tmp_path / "mine.pt")]
    cli += ["--variant", "resnet18", "--model-repository", str(repository)]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=300, check=True).stdout
    weights = repository / "resnet" / "1" / "weights.pt"
    assert out.startswith(f"imported resnet18 weights from {tmp_path / 'mine.pt'} (10 classes, top-"), out
    assert f": {weights}, labels {labels_path(repository)}; (re)start `serve`" in out


def test_a_checkpoint_with_python_objects_asks_to_be_trusted_explicitly(tmp_path, resnet18_10):
    path = tmp_path / "ckpt.pt"  # a pickled object of any class: torch.load(weights_only=True) refuses it
    torch.save({"state_dict": resnet18_10, "args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(WeightsError, match="holds Python objects besides tensors.*weights_only=False"):
        load_state_dict(path)


def test_a_canary_version_shares_the_config_and_labels(repository, resnet18_10, tmp_path):
    torch.save(resnet18_10, tmp_path / "a.pt")
    (tmp_path / "labels.txt").write_text("".join(f"mine {i}\n" for i in range(10)))
    import_weights(repository, tmp_path / "a.pt", tmp_path / "labels.txt", variant="resnet18")
    torch.save(random_state("resnet18", seed=5, num_classes=10), tmp_path / "b.pt")
    done = import_weights(repository, tmp_path / "b.pt", version=2)
    assert done.weights == repository / "resnet" / "2" / "weights.pt"
    assert read_labels(labels_path(repository)) == [f"mine {i}" for i in range(10)], "version 2 keeps the labels"
    assert (repository / "resnet" / "2" / "model.py").read_text() == (
        repository / "resnet" / "1" / "model.py"
    ).read_text()
    torch.save(torchvision.models.resnet18(num_classes=7).state_dict(), tmp_path / "c.pt")
    with pytest.raises(WeightsError, match="every resnet version shares config.pbtxt and labels.txt"):
        import_weights(repository, tmp_path / "c.pt", version=3)


def test_import_changes_only_the_values_it_must_and_keeps_every_comment(repository, tmp_path):
    """`weights import` with its own classes and top-k, then the rewrites the tests and benchmarks make
    (set_parameter, set_instance_counts): each config keeps its layout and every comment, only the values that
    depend on them change, so docs/customizing.md's later recipes still apply to the files."""
    from {{ cookiecutter.package_name }}.model_repository import set_instance_counts, set_parameter

    configs = sorted(repository.glob("*/config.pbtxt"))
    before = {path: path.read_text().splitlines() for path in configs}
    torch.save(torchvision.models.resnet18(num_classes=3).state_dict(), tmp_path / "three.pt")
    import_weights(repository, tmp_path / "three.pt", variant="resnet18", top_k=3)
    set_parameter(repository, "pipeline", "preprocess", "in_process")
    set_instance_counts(repository, {"pipeline": 3})
    assert_consistent(repository, 3, 3)
    for path in configs:
        after = path.read_text().splitlines()
        assert len(after) == len(before[path]), f"{path}: the layout is kept"
        changed = [(old, new) for old, new in zip(before[path], after) if old != new]
        for old, new in changed:
            assert "#" not in old and re.sub(r"\d+|resnet\w+|bls|in_process", "", old) == re.sub(
                r"\d+|resnet\w+|bls|in_process", "", new
            ), f"{path}: only a value changes: {old!r} -> {new!r}"
    assert load_config(repository / "pipeline").parameters["preprocess"].string_value == "in_process"
    assert load_config(repository / "pipeline").instance_group[0].count == 3


def test_a_change_of_another_kind_is_written_through_protobuf_and_still_parses(repository):
    """save_config edits values in place; a change it cannot edit so (here a new output) rewrites the file
    through protobuf's text format, its leading comment kept, and the file reads back as the config."""
    from {{ cookiecutter.package_name }}.model_repository import save_config

    config = load_config(repository / "postprocess")
    extra = config.output.add()
    extra.CopyFrom(config.output[0])
    extra.name = "EXTRA"
    assert save_config(repository / "postprocess", config)
    assert load_config(repository / "postprocess") == config
    text = (repository / "postprocess" / "config.pbtxt").read_text()
    assert text.startswith("#") and 'name: "EXTRA"' in text
    assert not save_config(repository / "postprocess", config), "an unchanged config is not written"


def test_set_parameter_names_a_missing_parameter(repository):
    from {{ cookiecutter.package_name }}.model_repository import set_parameter

    with pytest.raises(ValueError, match="no parameter 'nonesuch'"):
        set_parameter(repository, "pipeline", "nonesuch", "x")
