"""The model repository: its names, the Triton type table, and its config.pbtxt files, read and rewritten.

The configs are the single source of the variant, weights, classes, top-k and max batch size. Rewrites go through
Triton's ModelConfig protobuf (text_format), never through string edits. Imported inside the Python-backend stubs
too (python_backend.py, for the type table): protobuf and tritonclient are imported only where a config is read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np
    import torch
    from tritonclient.grpc import model_config_pb2

LABELS_FILE = "labels.txt"  # resnet's LOGITS label_filename, in the resnet model directory
# The models clients call: `pipeline` (BLS), `ensemble` (the same steps, declared), `classify_pixels` (pixels in).
ENTRY_MODELS = ("pipeline", "ensemble", "classify_pixels")
PIXELS_MODEL = "classify_pixels"
# What the entry models (and postprocess) answer: the top-k of each image.
OUTPUTS = ("SCORES", "CLASS_IDS", "LABELS")
# The BLS models and the models they call: a BLS model's instance holds the tensors of its calls too, in /dev/shm
# (shm.dev_shm_bytes) and in the CUDA memory pool (server.cuda_pool_bytes); the watchdog reloads the callers of a
# model whose stub died (health.py). A BLS call to a model not listed here logs a warning that says so, once per
# stub (python_backend.Instance.infer, undeclared_call).
BLS_CALLS = {"pipeline": ("preprocess", "resnet", "postprocess")}


def bls_callers(models: list[str]) -> list[str]:
    """The BLS models that call any of `models`, none of `models` themselves: a reload of `models` takes them along
    (their instances may be waiting on the old stubs)."""
    return sorted({c for c, called in BLS_CALLS.items() for m in models if m in called} - set(models))


def undeclared_call(caller: str, called: str) -> str | None:
    """What is wrong when the BLS model `caller` calls `called` and BLS_CALLS does not say so (None when it does)."""
    if called in BLS_CALLS.get(caller, ()):
        return None
    return (
        f"{caller} calls {called}, which BLS_CALLS in model_repository.py does not list for {caller}: add it there, "
        f"or the CUDA memory pool and /dev/shm are sized without the tensors of that call, and the watchdog does not "
        f"reload {caller} when a stub of {called} dies"
    )


class TritonType(NamedTuple):
    bytes: int  # per element
    torch: str  # the torch dtype, by name
    numpy: str | None  # the numpy dtype, by name; None: numpy has none (BF16 travels as its raw 16-bit patterns)


# The Triton type table, once. Keys are the protocol's datatypes (FP32); a config.pbtxt writes them TYPE_FP32.
TRITON_TYPES = {
    "BOOL": TritonType(1, "bool", "bool"),
    "UINT8": TritonType(1, "uint8", "uint8"),
    "INT8": TritonType(1, "int8", "int8"),
    "UINT16": TritonType(2, "uint16", "uint16"),
    "INT16": TritonType(2, "int16", "int16"),
    "FP16": TritonType(2, "float16", "float16"),
    "BF16": TritonType(2, "bfloat16", None),
    "UINT32": TritonType(4, "uint32", "uint32"),
    "INT32": TritonType(4, "int32", "int32"),
    "FP32": TritonType(4, "float32", "float32"),
    "UINT64": TritonType(8, "uint64", "uint64"),
    "INT64": TritonType(8, "int64", "int64"),
    "FP64": TritonType(8, "float64", "float64"),
}


def bytes_per_element(datatype: str) -> int:
    """Bytes per element of a datatype, "FP32" or "TYPE_FP32" (KeyError for strings: they have no fixed size)."""
    return TRITON_TYPES[datatype.removeprefix("TYPE_")].bytes


def torch_dtype(datatype: str) -> torch.dtype:
    import torch

    return getattr(torch, TRITON_TYPES[datatype.removeprefix("TYPE_")].torch)


def numpy_dtype(datatype: str) -> np.dtype:
    import numpy as np

    name = TRITON_TYPES[datatype.removeprefix("TYPE_")].numpy
    if name is None:
        raise KeyError(datatype)
    return np.dtype(name)


def tensor_datatype(tensor) -> str:
    """The datatype of a config's input or output (a ModelInput/ModelOutput): "FP32", ..., "STRING"."""
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2.DataType.Name(tensor.data_type).removeprefix("TYPE_")


class ConfigError(ValueError):
    """A config.pbtxt that does not parse as Triton's ModelConfig: str() is `<file>:<line>:<column>: <why>`."""


def load_config(model_dir: Path | str) -> model_config_pb2.ModelConfig:
    """Parse `<model_dir>/config.pbtxt` as Triton's ModelConfig protobuf; ConfigError, naming the file and the line,
    on a syntax error or an unknown field."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    path = Path(model_dir) / "config.pbtxt"
    try:
        return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        where = f"{exc.GetLine()}:{exc.GetColumn()}" if exc.GetLine() is not None else ""
        why = str(exc).split(" : ", 1)[-1] if " : " in str(exc) else str(exc)
        raise ConfigError(f"{path}:{where}: {why}" if where else f"{path}: {why}") from None


def save_config(model_dir: Path | str, config: model_config_pb2.ModelConfig) -> bool:
    """Write `config` as `<model_dir>/config.pbtxt` if it differs from the file; True if it was written.

    The file's leading comment lines are kept; comments inside, and fields left at their default, are not
    (protobuf's text format drops both).
    """
    from google.protobuf import text_format

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


def instances_on_gpu(config: model_config_pb2.ModelConfig, gpu: int = 0) -> int:
    """How many instances of the model run on GPU `gpu`: the `count` of every instance_group that is not KIND_CPU
    and lists no `gpus`, or lists this one (0 for an ensemble)."""
    from tritonclient.grpc import model_config_pb2

    if config.platform == "ensemble":
        return 0
    groups = config.instance_group or [model_config_pb2.ModelInstanceGroup()]
    cpu = model_config_pb2.ModelInstanceGroup.KIND_CPU
    return sum(g.count or 1 for g in groups if g.kind != cpu and (not g.gpus or gpu in g.gpus))


def load_configs(repository: Path | str) -> dict[str, model_config_pb2.ModelConfig]:
    """{model name: its config} for every model of the repository."""
    return {path.parent.name: load_config(path.parent) for path in Path(repository).glob("*/config.pbtxt")}


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


def pixels_dtype(repository: Path | str) -> torch.dtype:
    """The torch dtype of preprocess's PIXELS output: the precision the ResNet runs in."""
    (pixels,) = [o for o in load_config(Path(repository) / "preprocess").output if o.name == "PIXELS"]
    return torch_dtype(tensor_datatype(pixels))


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


def set_parameter(repository: Path | str, model: str, key: str, value: str) -> None:
    """Rewrite one string parameter of a model's config in place, comments kept: `("pipeline", "preprocess",
    "in_process")`. Raises ValueError if the config has no such parameter."""
    path = Path(repository) / model / "config.pbtxt"
    pattern = r"(\{ key: \"" + re.escape(key) + r"\", value: \{ string_value: )\"[^\"]*\""
    text, found = re.subn(pattern, lambda m: f'{m.group(1)}"{value}"', path.read_text())
    if found:
        path.write_text(text)
        return
    config = load_config(path.parent)  # a config rewritten through protobuf (`weights import`)
    if key not in config.parameters:
        raise ValueError(f"{path}: no parameter {key!r} to rewrite")
    config.parameters[key].string_value = value
    save_config(path.parent, config)


def python_models(repository: Path | str) -> list[str]:
    """The models of the repository that run on the Python backend."""
    return sorted(p.parent.parent.name for p in Path(repository).glob("*/1/model.py"))


def _entry_models(repository: Path) -> list[Path]:
    return [repository / name for name in ENTRY_MODELS if (repository / name).is_dir()]


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
                if out.name in OUTPUTS:
                    out.dims[:] = [k]
            save_config(model_dir, config)
