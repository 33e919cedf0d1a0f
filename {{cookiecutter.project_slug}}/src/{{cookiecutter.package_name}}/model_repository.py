"""Read the model repository's config.pbtxt files: the single source of the variant, weights and top-k."""

from __future__ import annotations

import re
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2


def load_config(model_dir: Path | str) -> model_config_pb2.ModelConfig:
    """Parse `<model_dir>/config.pbtxt` as Triton's ModelConfig protobuf (raises on any unknown field)."""
    text = (Path(model_dir) / "config.pbtxt").read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def parameters(model_dir: Path | str) -> dict[str, str]:
    return {key: value.string_value for key, value in load_config(model_dir).parameters.items()}


def resnet_weights(repository: Path | str) -> tuple[str, Path]:
    """(variant, weights path) as the resnet model's config declares them."""
    resnet = Path(repository) / "resnet"
    params = parameters(resnet)
    return params["variant"], resnet / "1" / params["weights_file"]


def top_k(repository: Path | str) -> int:
    config = load_config(Path(repository) / "postprocess")
    return next(out.dims[0] for out in config.output if out.name == "SCORES")


def set_instance_counts(repository: Path | str, counts: dict[str, int]) -> None:
    """Rewrite the instance_group count of some models in place, comments kept: `{"preprocess": 4}`."""
    for model, count in counts.items():
        path = Path(repository) / model / "config.pbtxt"
        text, found = re.subn(r"(instance_group \[ \{ count: )\d+", rf"\g<1>{count}", path.read_text())
        if not found:
            raise ValueError(f"{path}: no instance_group count to rewrite")
        path.write_text(text)


def python_models(repository: Path | str) -> list[str]:
    """The models of the repository that run on the Python backend."""
    return sorted(p.parent.parent.name for p in Path(repository).glob("*/1/model.py"))
