"""Write the ResNet weights file the resnet model loads: torchvision's pretrained weights, or random ones."""

from __future__ import annotations

from pathlib import Path

import torch
import torchvision


def export_pretrained(variant: str, path: Path) -> Path:
    """torchvision's default ImageNet weights for `variant` (downloads them: needs internet)."""
    weights = torchvision.models.get_model_weights(variant).DEFAULT
    return _save(weights.get_state_dict(progress=True), path)


def write_random(variant: str, path: Path, seed: int = 0) -> Path:
    """Deterministic random weights: the same file for the same seed, so everything runs offline."""
    torch.manual_seed(seed)
    model = torchvision.models.get_model(variant, weights=None, num_classes=1000)
    return _save(model.state_dict(), path)


def _save(state: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # the server never sees a half-written file
    return path
