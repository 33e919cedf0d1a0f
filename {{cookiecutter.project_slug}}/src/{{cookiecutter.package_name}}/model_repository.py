"""Read the model repository's config.pbtxt files: the single source of the variant, weights and top-k."""

from __future__ import annotations

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
