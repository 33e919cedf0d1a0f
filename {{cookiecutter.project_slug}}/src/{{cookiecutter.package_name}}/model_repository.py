"""Read and rewrite the model repository's config.pbtxt files: the single source of the variant, weights, classes
and top-k. Rewrites go through Triton's ModelConfig protobuf (text_format), never through string edits."""

from __future__ import annotations

import re
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

LABELS_FILE = "labels.txt"  # resnet's LOGITS label_filename, in the resnet model directory
TOP_K_OUTPUTS = ("SCORES", "CLASS_IDS", "LABELS")


def load_config(model_dir: Path | str) -> model_config_pb2.ModelConfig:
    """Parse `<model_dir>/config.pbtxt` as Triton's ModelConfig protobuf (raises on any unknown field)."""
    text = (Path(model_dir) / "config.pbtxt").read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def save_config(model_dir: Path | str, config: model_config_pb2.ModelConfig) -> bool:
    """Write `config` as `<model_dir>/config.pbtxt` if it differs from the file; True if it was written.

    The file's leading comment lines are kept; comments inside, and fields left at their default, are not
    (protobuf's text format drops both).
    """
    path = Path(model_dir) / "config.pbtxt"
    if load_config(model_dir) == config:
        return False
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(header) + text_format.MessageToString(config, use_short_repeated_primitives=True))
    tmp.replace(path)
    return True


def parameters(model_dir: Path | str) -> dict[str, str]:
    return {key: value.string_value for key, value in load_config(model_dir).parameters.items()}


def resnet_weights(repository: Path | str) -> tuple[str, Path]:
    """(variant, weights path) as the resnet model's config declares them."""
    resnet = Path(repository) / "resnet"
    params = parameters(resnet)
    return params["variant"], resnet / "1" / params["weights_file"]


def labels_path(repository: Path | str) -> Path:
    """The class names: resnet's LOGITS `label_filename`, in the resnet model directory."""
    resnet = Path(repository) / "resnet"
    logits = next(out for out in load_config(resnet).output if out.name == "LOGITS")
    return resnet / (logits.label_filename or LABELS_FILE)


def num_classes(repository: Path | str) -> int:
    logits = next(out for out in load_config(Path(repository) / "resnet").output if out.name == "LOGITS")
    return logits.dims[0]


def top_k(repository: Path | str) -> int:
    config = load_config(Path(repository) / "postprocess")
    return next(out.dims[0] for out in config.output if out.name == "SCORES")


def set_instance_counts(repository: Path | str, counts: dict[str, int]) -> None:
    """Rewrite the instance_group count of some models in place, comments kept: `{"preprocess": 4}`."""
    for model, count in counts.items():
        path = Path(repository) / model / "config.pbtxt"
        text, found = re.subn(r"(instance_group \[ \{ count: )\d+", rf"\g<1>{count}", path.read_text())
        if found:
            path.write_text(text)
            continue
        config = load_config(path.parent)  # a config rewritten through protobuf (`weights import`)
        if not config.instance_group:
            raise ValueError(f"{path}: no instance_group to rewrite")
        for group in config.instance_group:
            group.count = count
        save_config(path.parent, config)


def python_models(repository: Path | str) -> list[str]:
    """The models of the repository that run on the Python backend."""
    return sorted(p.parent.parent.name for p in Path(repository).glob("*/1/model.py"))


def _entry_models(repository: Path) -> list[Path]:
    return [repository / name for name in ("pipeline", "ensemble", "classify_pixels") if (repository / name).is_dir()]


def set_classes(repository: Path | str, classes: int, variant: str | None = None, k: int | None = None) -> None:
    """Rewrite every config field that depends on the class count (and the variant and top-k, when given):
    resnet's LOGITS dims and label_filename, postprocess's LOGITS dims, the top-k outputs everywhere."""
    repository = Path(repository)
    resnet = load_config(repository / "resnet")
    logits = next(out for out in resnet.output if out.name == "LOGITS")
    logits.dims[:] = [classes]
    logits.label_filename = LABELS_FILE  # postprocess's labels_file parameter names the same file
    if variant is not None:
        resnet.parameters["variant"].string_value = variant
    save_config(repository / "resnet", resnet)

    post = load_config(repository / "postprocess")
    next(inp for inp in post.input if inp.name == "LOGITS").dims[:] = [classes]
    save_config(repository / "postprocess", post)
    if k is not None:
        for model_dir in [repository / "postprocess", *_entry_models(repository)]:
            config = load_config(model_dir)
            for out in config.output:
                if out.name in TOP_K_OUTPUTS:
                    out.dims[:] = [k]
            save_config(model_dir, config)
