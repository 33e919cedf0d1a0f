"""What `serve` sized, on disk: the record of the counts it started (for `health`), and the sized configs Triton
reads instead of config.pbtxt (`<model>/configs/sized-<gRPC port>.pbtxt`, --model-config-name)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from .paths import cache_dir

if TYPE_CHECKING:
    from .sizing import DevicePlan


# ------------------------------------------------------------------ what `health` reads


def record_path(grpc_port: int) -> Path:
    return cache_dir() / f"plan-{grpc_port}.json"


def config_name(grpc_port: int) -> str:
    """The name of the sized configs of the server on this gRPC port (write_configs): one per server."""
    return f"sized-{grpc_port}"


def record(grpc_port: int, plans: list[DevicePlan]) -> None:
    path = record_path(grpc_port)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"serve_pid": os.getpid(), "lines": [p.line() for p in plans]}))


def forget(grpc_port: int) -> None:
    record_path(grpc_port).unlink(missing_ok=True)


def summary(grpc_port: int) -> str | None:
    """The plan of the `serve` still running on this port, as it printed it; None when there is none."""
    from .machine import alive

    try:
        data = json.loads(record_path(grpc_port).read_text())
    except (OSError, ValueError):
        return None
    if not alive(int(data.get("serve_pid", 0))):
        return None
    return "\n".join(f"instances: {line}" for line in data.get("lines", []))


# ------------------------------------------------------------------ the sized configs Triton reads


SIZED_HEADER = (
    "# Written by `{{ cookiecutter.project_slug }} serve` from ../config.pbtxt, with the instance count it sized for "
    "this machine\n# (sizing.py); Triton reads it instead of config.pbtxt (--model-config-name). Edit config.pbtxt: "
    "serve writes\n# this again within a second, and removes it when it stops.\n"
)


def sized_path(repository: Path | str, model: str, name: str) -> Path:
    return Path(repository) / model / "configs" / f"{name}.pbtxt"


def render(repository: Path | str, model: str, count: int) -> str:
    """config.pbtxt of `model` with `count` instances in its instance_group, in protobuf's text format."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from .model_repository import load_config

    config = load_config(Path(repository) / model)
    if not config.instance_group:
        config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_AUTO)
    for group in config.instance_group:
        group.count = count
    return SIZED_HEADER + text_format.MessageToString(config, use_short_repeated_primitives=True)


def write_configs(repository: Path | str, counts: dict[str, int], name: str) -> list[Path]:
    """`<model>/configs/<name>.pbtxt` for every model of `counts`: config.pbtxt with its sized count. The files the
    user edits (config.pbtxt and everything committed) stay as they are. A model with several instance groups is
    left to its config."""
    from .model_repository import load_config

    written = []
    for model, count in counts.items():
        if len(load_config(Path(repository) / model).instance_group) > 1:
            continue
        path = sized_path(repository, model, name)
        try:
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(render(repository, model, count))
            tmp.replace(path)
        except OSError as exc:
            raise OSError(
                f"cannot write the sized instance count of {model} to {path} ({exc.strerror or exc}): make "
                f"{path.parent} writable for this user, or pin {model}'s count as its config has it "
                "(--instances MODEL=N for every model that differs)"
            ) from exc
        written.append(path)
    return written


def remove_configs(repository: Path | str, name: str) -> None:
    for path in Path(repository).glob(f"*/configs/{name}.pbtxt"):
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()  # only when nothing else is in configs/
        except OSError:
            pass


def sync_configs(repository: Path | str, name: str) -> list[str]:
    """Write again each sized config whose config.pbtxt changed since (its count kept), so that a load after an edit
    of config.pbtxt (a hot reload: docs/customizing.md, recipe 4) loads the edit. Returns the models rewritten."""
    changed = []
    for path in Path(repository).glob(f"*/configs/{name}.pbtxt"):
        model_dir = path.parent.parent
        try:
            if (model_dir / "config.pbtxt").stat().st_mtime_ns <= path.stat().st_mtime_ns:
                continue
            count = int(re.search(r"\bcount: (\d+)", path.read_text()).group(1))
            write_configs(Path(repository), {model_dir.name: count}, name)
        except (OSError, AttributeError, ValueError):  # removed meanwhile, or a config that does not parse yet
            continue
        changed.append(model_dir.name)
    return changed
