"""Write what the resnet model loads: weights.pt, the class names in labels.txt, and the config fields that
depend on them. From torchvision's pretrained weights, deterministic random ones, or your own checkpoint."""

from __future__ import annotations

import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision

from . import model_repository as repo
from .stages import imagenet_labels, read_labels

VARIANTS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
# Keys under which training loops nest the model's state dict in a checkpoint.
CHECKPOINT_KEYS = ("state_dict", "model", "model_state_dict", "net")


class WeightsError(ValueError):
    """A weights or labels file that cannot be served as is; the message says how to fix it."""


def pretrained_state(variant: str) -> dict[str, torch.Tensor]:
    """torchvision's default ImageNet weights for `variant` (downloads them: needs internet)."""
    return torchvision.models.get_model_weights(variant).DEFAULT.get_state_dict(progress=True)


def random_state(variant: str, seed: int = 0, num_classes: int = 1000) -> dict[str, torch.Tensor]:
    """Deterministic random weights: the same for the same seed, so everything runs offline."""
    torch.manual_seed(seed)
    return torchvision.models.get_model(variant, weights=None, num_classes=num_classes).state_dict()


def write_random(variant: str, path: Path, seed: int = 0, num_classes: int = 1000) -> Path:
    """Only the weights file: deterministic random weights."""
    return _save(random_state(variant, seed, num_classes), path)


def write_random_versions(repository: Path | str, seed: int = 0, only_missing: bool = False) -> list[Path]:
    """Deterministic random weights (version v: seed + v - 1) for every resnet version, at the configured variant
    and class count (the versions share the config); only_missing: only where there are none. The paths written."""
    variant, classes = repo.resnet_weights(repository)[0], repo.num_classes(repository)
    return [
        write_random(variant, path, seed + int(path.parent.name) - 1, classes)
        for path in repo.resnet_weight_files(repository)
        if not (only_missing and path.is_file())
    ]


def load_state_dict(path: Path | str) -> dict[str, torch.Tensor]:
    """A torchvision-style state dict from a state-dict file or a training checkpoint.

    Checkpoints nest it under "state_dict", "model", ...; DataParallel/DDP prefix every key with "module.",
    torch.compile with "_orig_mod.", Lightning with the attribute's name: all are unwrapped.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path} does not exist: pass the path of your .pt/.pth file")
    not_a_checkpoint = WeightsError(
        f"{path} is not a PyTorch checkpoint: pass a file written by torch.save(model.state_dict(), path)"
    )
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04" and magic[:1] != b"\x80":  # torch.save writes a zip archive (a pickle before 1.6)
        raise not_a_checkpoint
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc):
            raise not_a_checkpoint from None
        raise WeightsError(
            f"{path} holds Python objects besides tensors, which torch loads only from a trusted source: if you "
            "trust it, save its state dict alone, torch.save(torch.load(path, weights_only=False)['state_dict'], "
            "'weights-only.pt'), and import that"
        ) from None
    except Exception:
        raise not_a_checkpoint from None
    for key in CHECKPOINT_KEYS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(
            f"{path} holds no state dict (a dict of tensors, or a checkpoint with one under "
            f"{', '.join(map(repr, CHECKPOINT_KEYS))}): save it with torch.save(model.state_dict(), "
            "path)"
        )
    fc = [key for key in state if key == "fc.weight" or key.endswith(".fc.weight")]
    prefix = min(fc, key=len)[: -len("fc.weight")] if fc else ""
    if prefix and all(key.startswith(prefix) for key in state):
        state = {key[len(prefix) :]: value for key, value in state.items()}
    return state


def _shapes(variant: str, classes: int) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):  # the architecture's shapes, no memory, no time
        model = torchvision.models.get_model(variant, weights=None, num_classes=classes)
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def check_state_dict(state: dict[str, torch.Tensor], variant: str) -> int:
    """The class count of a state dict that fits torchvision's `variant`; a WeightsError naming the fix if not."""
    if "fc.weight" not in state or state["fc.weight"].dim() != 2:
        raise WeightsError(
            "not a torchvision ResNet state dict: it has no fc.weight (the final classifier layer); "
            "export the ResNet itself, torch.save(resnet.state_dict(), path)"
        )
    classes = state["fc.weight"].shape[0]
    got = {key: tuple(value.shape) for key, value in state.items()}
    if got == _shapes(variant, classes):
        return classes
    fits = [v for v in VARIANTS if v != variant and got == _shapes(v, classes)]
    if fits:
        raise WeightsError(f"the state dict is a {fits[0]}, not a {variant}: pass --variant {fits[0]}")
    expected = _shapes(variant, classes)
    missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    wrong = sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k])
    details = "; ".join(
        f"{what}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''} ({len(keys)})"
        for what, keys in (("missing", missing), ("unexpected", unexpected), ("other shapes", wrong))
        if keys
    )
    raise WeightsError(
        f"the state dict fits no torchvision ResNet ({', '.join(VARIANTS)}); against {variant}: "
        f"{details}. Export a torchvision ResNet (torchvision.models.{variant}(num_classes=N)) "
        "fine-tuned with its own fc layer"
    )


def default_labels(classes: int) -> list[str]:
    """ImageNet's names for 1000 classes, else class_0 ... class_{n-1}."""
    return imagenet_labels() if classes == 1000 else [f"class_{i}" for i in range(classes)]


@dataclass
class Installed:
    variant: str
    classes: int
    top_k: int
    weights: Path
    labels: Path


def install(
    repository: Path | str,
    state: dict[str, torch.Tensor],
    variant: str,
    labels: list[str] | None = None,
    top_k: int | None = None,
    version: int = 1,
) -> Installed:
    """Check everything first, then write weights.pt, labels.txt and the config fields that depend on them.

    `version` > 1 adds or replaces another version of the resnet model (its model.py copied from version 1), for
    an A/B test or a canary: every version shares the model's config and labels.
    """
    repository = Path(repository)
    classes = check_state_dict(state, variant)
    configured_variant = repo.resnet_weights(repository)[0]
    if version != 1 and (variant, classes) != (configured_variant, repo.num_classes(repository)):
        raise WeightsError(
            f"every resnet version shares config.pbtxt and labels.txt ({configured_variant}, "
            f"{repo.num_classes(repository)} classes), this is a {variant} with {classes}: import it "
            "as version 1 to replace the model, or export your other version with the same architecture"
        )
    if labels is None:  # another version shares the model's labels; a new model gets the default ones
        labels = read_labels(repo.labels_path(repository)) if version != 1 else default_labels(classes)
    if len(labels) != classes:
        raise WeightsError(
            f"fc has {classes} outputs but the labels file has {len(labels)} lines: "
            f"give one label per class, line i naming class i ({classes} lines)"
        )
    k = repo.top_k(repository) if top_k is None else top_k
    if not 1 <= k <= classes:
        raise WeightsError(
            f"top_k is {k} but the model has only {classes} classes: pass --top-k {min(classes, 5)} "
            f"(any number from 1 to {classes})"
        )
    _, weights = repo.resnet_weights(repository)
    if version != 1:
        model_py = weights.parent.parent / str(version) / "model.py"
        if not model_py.is_file():
            model_py.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(weights.parent / "model.py", model_py)
        weights = model_py.parent / weights.name
    _save(state, weights)
    labels_file = repository / "resnet" / repo.LABELS_FILE
    tmp = labels_file.with_suffix(".tmp")
    tmp.write_text("".join(label + "\n" for label in labels), encoding="utf-8")
    tmp.replace(labels_file)
    repo.set_classes(repository, classes, variant=variant, k=None if top_k is None else k)
    return Installed(variant, classes, k, weights, labels_file)


def import_weights(
    repository: Path | str,
    path: Path | str,
    labels_file: Path | str | None = None,
    variant: str | None = None,
    top_k: int | None = None,
    version: int = 1,
) -> Installed:
    """`weights import`: your checkpoint (and labels) into the model repository."""
    variant = variant or repo.resnet_weights(repository)[0]
    labels = None
    if labels_file is not None:
        if not Path(labels_file).is_file():
            raise WeightsError(
                f"the labels file {labels_file} does not exist: pass the path of your class names, one per line "
                "(line i naming class i), or leave --labels out for class_0, class_1, ..."
            )
        try:
            labels = read_labels(labels_file)
        except OSError as exc:
            raise WeightsError(f"cannot read the labels file {labels_file}: {exc.strerror}") from None
        except ValueError as exc:
            raise WeightsError(str(exc)) from None
    return install(repository, load_state_dict(path), variant, labels, top_k, version)


def _save(state: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # the server never sees a half-written file
    return path
