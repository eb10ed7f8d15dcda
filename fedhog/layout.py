"""The flat layout of a model: every tensor's values one after the other, in the model's key order.

The order is the ``state_dict``'s, which is also the order of the
ArrayRecord the server sends (``ArrayRecord(model.state_dict())``). Client
results travel in this layout (:class:`~fedhog.protocol.ClientResult`), the
mechanism works on it, and the strategy turns the release back into an
ArrayRecord.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord


def flatten(tensors: Mapping[str, torch.Tensor], keys: Iterable[str] | None = None) -> torch.Tensor:
    """``tensors`` (in the order of ``keys``, default their own) as one flat tensor."""
    return torch.cat([tensors[key].reshape(-1) for key in (tensors if keys is None else keys)])


def flatten_record(record: ArrayRecord) -> torch.Tensor:
    """An ArrayRecord's arrays, in its order, as one flat tensor."""
    return flatten({key: torch.from_numpy(np.ascontiguousarray(array.numpy())) for key, array in record.items()})


def unflatten(flat: torch.Tensor, shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """A flat tensor as named tensors of ``shapes`` (in its order): views into ``flat``."""
    out, offset = {}, 0
    for key, shape in shapes.items():
        size = math.prod(shape)
        out[key] = flat[offset:offset + size].reshape(tuple(shape))
        offset += size
    return out


def unflatten_like(flat: torch.Tensor, like: ArrayRecord) -> ArrayRecord:
    """A flat tensor as an ArrayRecord keyed and shaped like ``like``."""
    return ArrayRecord(unflatten(flat, {key: tuple(array.shape) for key, array in like.items()}))
