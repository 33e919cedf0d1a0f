"""An execute()'s requests as one batch, stage after stage, and their responses: each request answered with its
rows or its own error, the error's code kept for the client.

Only importable inside Triton's Python backend stub (it imports `triton_python_backend_utils`). `python_backend.py`
makes the BLS calls and re-exports what the model.py files use from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from .counters import COUNTERS
from .images import InvalidImage

# Triton 2.51 drops the error code of a BLS response (has_error() answers INTERNAL for everything), so an
# input error raised by one stage carries this prefix to keep INVALID_ARG on its way back to the client.
INVALID_INPUT = "invalid input: "


class StageError(Exception):
    """A BLS call that answered with an error; keeps Triton's error code for the client."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class Cancelled(Exception):
    """A request whose client has cancelled it (or whose gRPC call has gone): answered CANCELLED, not served on."""


class Expired(Exception):
    """A request past its deadline (the timeout its client gave it): answered UNAVAILABLE in Triton's own words for
    a request that waited past its timeout in a queue ("Request timeout expired"), not served on."""


def to_triton(name: str, tensor: torch.Tensor) -> pb_utils.Tensor:
    """Hand a torch tensor to Triton without a copy. Passing the tensor itself (not a capsule) makes
    pb_utils synchronize torch's current CUDA stream, so the data is complete when the next stage reads it.
    pb_utils synchronizes through a stream of the thread's current device: that must be the tensor's own."""
    tensor = tensor.contiguous()
    if tensor.is_cuda:
        with torch.cuda.device(tensor.device):
            return pb_utils.Tensor.from_dlpack(name, tensor)
    return pb_utils.Tensor.from_dlpack(name, tensor)


def is_input_error(exc: BaseException) -> bool:
    """The client's fault: a bad image (raised here or by a stage we called), never overload or a failure."""
    return isinstance(exc, InvalidImage) or (
        isinstance(exc, StageError) and exc.code == pb_utils.TritonError.INVALID_ARG
    )


def error_response(exc: Exception) -> pb_utils.InferenceResponse:
    """A per-request error: INVALID_ARG when the client sent something bad (counted), the stage's own code
    otherwise."""
    if is_input_error(exc):
        COUNTERS.count("invalid_requests")
    if isinstance(exc, Cancelled):
        COUNTERS.count("cancelled_requests")
        message, code = str(exc), pb_utils.TritonError.CANCELLED
    elif isinstance(exc, Expired):
        COUNTERS.count("expired_requests")
        message, code = str(exc), pb_utils.TritonError.UNAVAILABLE
    elif isinstance(exc, StageError):
        message, code = str(exc), exc.code
    elif isinstance(exc, InvalidImage):
        message, code = INVALID_INPUT + str(exc), pb_utils.TritonError.INVALID_ARG
    else:
        message, code = f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def join(parts: list) -> Any:
    """Every request's rows as one batch: torch tensors, numpy arrays, or dicts of them by name (one part: itself,
    no copy)."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], dict):
        return {name: join([part[name] for part in parts]) for name in parts[0]}
    return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts)


def _rows(data: Any, start: int, end: int) -> Any:
    if isinstance(data, dict):
        return {name: value[start:end] for name, value in data.items()}
    return data[start:end]


def _count(rows: Any) -> int:
    return len(next(iter(rows.values()))) if isinstance(rows, dict) else len(rows)


def _parts(data: Any, sizes: list[int | Exception]) -> list:
    """Per request: its rows of the joined `data` (views), or the exception it answers with."""
    parts, start = [], 0
    for size in sizes:
        if isinstance(size, Exception):
            parts.append(size)
        else:
            parts.append(_rows(data, start, start + size))
            start += size
    return parts


def split_responses(outputs: dict, sizes: list[int | Exception]) -> list[pb_utils.InferenceResponse]:
    """One response per request from the outputs of their joined batch ({name: torch tensor or numpy array}):
    request i gets the next sizes[i] rows of every output (torch tensors zero-copy), or its error when sizes[i] is
    an exception."""
    return [
        error_response(part)
        if isinstance(part, Exception)
        else pb_utils.InferenceResponse(
            [to_triton(n, t) if isinstance(t, torch.Tensor) else pb_utils.Tensor(n, t) for n, t in part.items()]
        )
        for part in _parts(outputs, sizes)
    ]


@dataclass
class Batch:
    """The requests of one execute() as one batch, stage after stage.

    `data`: the rows of every request still served, joined (a tensor, or {name: tensor or array}; None when none
    is); `sizes`: per request, its number of rows in `data`, or the exception it answers with.
    """

    data: Any
    sizes: list[int | Exception]

    @classmethod
    def of(cls, parts: list) -> Batch:
        """From each request's rows, or the exception it answers with."""
        rows = [part for part in parts if not isinstance(part, Exception)]
        sizes = [part if isinstance(part, Exception) else _count(part) for part in parts]
        return cls(join(rows) if rows else None, sizes)

    def then(self, stage, by: list | None = None) -> Batch:
        """The next stage, `stage(data)`, once for every request still served; if it raises, each of them answers
        with its error. With `by` (a key per request, e.g. the model version it asks for; an exception: that
        request answers with it), once per key, `stage(rows, key)` on the rows of that key's requests."""
        if by is not None:
            return self._then_by(stage, by)
        if self.data is None:
            return self
        try:
            return Batch(stage(self.data), self.sizes)
        except Exception as exc:
            return Batch(None, [size if isinstance(size, Exception) else exc for size in self.sizes])

    def each(self, check) -> Batch:
        """`check(rows)` on each request still served, alone (a gate: docs/customizing.md, recipe 2); a request
        whose check raises answers with that exception, the others go on (joined again only if one dropped out)."""
        errors = {}
        for i, part in enumerate(_parts(self.data, self.sizes)):
            if not isinstance(part, Exception):
                try:
                    check(part)
                except Exception as exc:
                    errors[i] = exc
        return self.drop(errors)

    def drop(self, errors: dict[int, Exception]) -> Batch:
        """Request i of `errors` answers with errors[i] and goes no further; the others go on (joined again)."""
        if not errors:
            return self
        parts = _parts(self.data, self.sizes)
        for i, exc in errors.items():
            if not isinstance(parts[i], Exception):
                parts[i] = exc
        return Batch.of(parts)

    def _then_by(self, stage, keys: list) -> Batch:
        parts = [
            key if isinstance(key, Exception) and not isinstance(part, Exception) else part
            for part, key in zip(_parts(self.data, self.sizes), keys)
        ]
        groups: dict[Any, list[int]] = {}
        for i, part in enumerate(parts):
            if not isinstance(part, Exception):
                groups.setdefault(keys[i], []).append(i)
        served = sum(not isinstance(size, Exception) for size in self.sizes)

        def serve(key, members: list[int]) -> Batch:  # every request still served in one group: no copy
            batch = Batch(self.data, [self.sizes[i] for i in members]) if len(members) == served else None
            return (batch or Batch.of([parts[i] for i in members])).then(lambda data: stage(data, key))

        done = [serve(key, members) for key, members in groups.items()]
        for members, batch in zip(groups.values(), done):
            for i, part in zip(members, _parts(batch.data, batch.sizes)):
                parts[i] = part
        return Batch.of(parts)


def batch_then_alone(stage, inputs: list[pb_utils.Tensor], check=None) -> Batch:
    """`stage(x)` once on every request's input joined (a host input, as encoded images are); if that fails
    with an input error, once on each request's input alone, so that the error reaches only the request that sent
    the bad input. Any other error (overload, a timeout) is no request's fault: every request answers with it.
    With `check`, a request whose input `check(input)` raises on answers with that exception, never joined."""
    if check is not None:
        refused = {i: exc for i, t in enumerate(inputs) if isinstance(exc := _result_or_error(check, t), Exception)}
        if refused:
            served = [tensor for i, tensor in enumerate(inputs) if i not in refused]
            rest = batch_then_alone(stage, served) if served else Batch(None, [])
            sizes = iter(rest.sizes)
            return Batch(rest.data, [refused[i] if i in refused else next(sizes) for i in range(len(inputs))])
    joined = inputs[0]
    if len(inputs) > 1:
        joined = pb_utils.Tensor(inputs[0].name(), np.concatenate([tensor.as_numpy() for tensor in inputs]))
    try:
        return Batch(stage(joined), [tensor.shape()[0] for tensor in inputs])
    except Exception as exc:
        if len(inputs) == 1 or not is_input_error(exc):
            return Batch(None, [exc] * len(inputs))
    return Batch.of([_result_or_error(stage, tensor) for tensor in inputs])


def _result_or_error(stage, tensor: pb_utils.Tensor) -> Any:
    try:
        return stage(tensor)
    except Exception as exc:
        return exc
