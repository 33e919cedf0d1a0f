"""The model repository: its names, the Triton type table, and its config.pbtxt files, read and rewritten.

The configs are the single source of the variant, weights, classes, top-k and max batch size. A rewrite changes
Triton's ModelConfig protobuf, then edits only the changed values in the file (comments and layout kept) and checks
that the file parses as the changed config (save_config). Imported inside the Python-backend stubs
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
# (shm.dev_shm_bytes) and in the CUDA memory pool (rules.cuda_pool_bytes); the watchdog reloads the callers of a
# model whose stub died (health.py). A BLS call to a model not listed here logs a warning that says so, once per
# stub (python_backend.Instance.infer, undeclared_call).
BLS_CALLS = {"pipeline": ("preprocess", "resnet", "postprocess")}


def bls_callers(models: list[str]) -> list[str]:
    """The BLS models that call any of `models`, none of `models` themselves: a reload of `models` takes them along
    (their instances may be waiting on the old stubs)."""
    return sorted({c for c, called in BLS_CALLS.items() for m in models if m in called} - set(models))


# The parameter through which the watchdog's reload (health.restart) tells a model's new stubs how often it has reloaded
# that model (counters.Counters publishes it): absent from the repository's configs.
RELOADS_PARAMETER = "watchdog_reloads"


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

    The values that change are edited where they stand, so the file keeps its layout and every comment: tensor
    dims and label files (by tensor name), instance counts and string parameters. A change of any other kind
    rewrites the file through protobuf's text format, which keeps the leading comment lines only.
    """
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    path = Path(model_dir) / "config.pbtxt"
    old = load_config(model_dir)
    if old == config:
        return False
    original = path.read_text()
    text = _edited(original, old, config)
    if text is None or text_format.Parse(text, model_config_pb2.ModelConfig()) != config:
        header = []
        for line in original.splitlines():
            if not line.startswith("#"):
                break
            header.append(line + "\n")
        text = "".join(header) + text_format.MessageToString(config, use_short_repeated_primitives=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def _edited(text: str, old: model_config_pb2.ModelConfig, new: model_config_pb2.ModelConfig) -> str | None:
    """`text` (which parses as `old`) with the values in which `new` differs edited in place; None if it differs
    in anything else (save_config then checks the result by parsing it)."""
    if [t.name for t in old.input] != [t.name for t in new.input]:
        return None
    if [t.name for t in old.output] != [t.name for t in new.output]:
        return None
    if len(old.instance_group) != len(new.instance_group) or set(old.parameters) != set(new.parameters):
        return None
    for field in ("input", "output"):
        for before, after in zip(getattr(old, field), getattr(new, field)):
            block = _block(text, field, lambda _, body, name=before.name: re.search(rf'\bname:\s*"{name}"', body))
            if block is None:
                return None
            start, end = block
            body = text[start:end]
            if list(before.dims) != list(after.dims):
                dims = "[ " + ", ".join(str(d) for d in after.dims) + " ]"
                body, found = re.subn(r"\bdims:\s*\[[^\]]*\]", f"dims: {dims}", body, count=1)
                if not found:
                    return None
            if field == "output" and before.label_filename != after.label_filename:
                label = f'label_filename: "{after.label_filename}"'
                body, found = re.subn(r'\blabel_filename:\s*"[^"]*"', label, body, count=1)
                if not found:
                    body = body[:-1].rstrip() + f", {label} }}"
            text = text[:start] + body + text[end:]
    for i, (before, after) in enumerate(zip(old.instance_group, new.instance_group)):
        if before.count != after.count:
            block = _block(text, "instance_group", lambda index, _, i=i: index == i)
            if block is None:
                return None
            start, end = block
            body, found = re.subn(r"\bcount:\s*\d+", f"count: {after.count}", text[start:end], count=1)
            if not found:
                return None
            text = text[:start] + body + text[end:]
    for key in old.parameters:
        if old.parameters[key] != new.parameters[key]:
            value = new.parameters[key].string_value.replace("\\", "\\\\").replace('"', '\\"')
            pattern = r'(\{\s*key:\s*"' + re.escape(key) + r'"\s*,?\s*value:\s*\{\s*string_value:\s*)"(?:[^"\\]|\\.)*"'
            text, found = re.subn(pattern, lambda m, value=value: f'{m.group(1)}"{value}"', text, count=1)
            if not found:
                return None
    return text


def _block(text: str, field: str, wanted) -> tuple[int, int] | None:
    """(start, end) of the first `{ ... }` element of the list `field: [ ... ]` for which wanted(index, element) is
    true, comments and quoted strings skipped."""
    opening = re.search(rf"(?m)^\s*{field}\s*:?\s*\[", text)
    if opening is None:
        return None
    depth, start, index, i = 0, None, 0, opening.end()
    while i < len(text):
        char = text[i]
        if char == "#":
            i = text.find("\n", i)
            if i < 0:
                return None
        elif char == '"':
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif char in "{[":
            depth += 1
            if depth == 1 and char == "{":
                start = i
        elif char in "}]":
            if depth == 0:
                return None  # the end of the list
            depth -= 1
            if depth == 0 and char == "}":
                if wanted(index, text[start : i + 1]):
                    return start, i + 1
                index += 1
        i += 1
    return None


def instances_on_gpu(config: model_config_pb2.ModelConfig, gpu: int = 0) -> int:
    """How many instances of the model run on GPU `gpu`: the `count` of every instance_group that is not KIND_CPU
    and lists no `gpus`, or lists this one (0 for an ensemble)."""
    from tritonclient.grpc import model_config_pb2

    if config.platform == "ensemble":
        return 0
    groups = config.instance_group or [model_config_pb2.ModelInstanceGroup()]
    cpu = model_config_pb2.ModelInstanceGroup.KIND_CPU
    return sum(g.count or 1 for g in groups if g.kind != cpu and (not g.gpus or gpu in g.gpus))


def loaded_versions(model_dir: Path | str, config: model_config_pb2.ModelConfig) -> int:
    """How many versions of the model Triton loads, each with its own instances: its version_policy (the newest
    one by default; recipe 3's `specific` pair loads two) over the version directories there are."""
    present = {int(p.name) for p in Path(model_dir).iterdir() if p.is_dir() and p.name.isdigit()}
    policy = config.version_policy.WhichOneof("policy_choice")
    if policy == "all":
        return max(1, len(present))
    if policy == "specific":
        return max(1, len(present & set(config.version_policy.specific.versions)))
    newest = config.version_policy.latest.num_versions if policy == "latest" else 1
    return max(1, min(newest or 1, len(present)))


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


def resnet_weight_files(repository: Path | str) -> list[Path]:
    """The weights file of every resnet version (its numbered directories that hold a model.py; recipe 3 adds a
    second), by version."""
    _, weights = resnet_weights(repository)
    model = weights.parent.parent
    versions = sorted(int(p.parent.name) for p in model.glob("*/model.py") if p.parent.name.isdigit())
    return [model / str(version) / weights.name for version in versions]


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
        config = load_config(Path(repository) / model)
        if not config.instance_group:
            raise ValueError(f"{Path(repository) / model / 'config.pbtxt'}: no instance_group to rewrite")
        for group in config.instance_group:
            group.count = count
        save_config(Path(repository) / model, config)


def set_parameter(repository: Path | str, model: str, key: str, value: str) -> None:
    """Rewrite one string parameter of a model's config in place, comments kept: `("pipeline", "preprocess",
    "in_process")`. Raises ValueError if the config has no such parameter."""
    config = load_config(Path(repository) / model)
    if key not in config.parameters:
        raise ValueError(f"{Path(repository) / model / 'config.pbtxt'}: no parameter {key!r} to rewrite")
    config.parameters[key].string_value = value
    save_config(Path(repository) / model, config)


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
