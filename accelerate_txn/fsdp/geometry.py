"""Where each original parameter's elements live in FSDP1 flat-parameter shards, on every rank.

Pure geometry, no I/O and no collectives: from one FSDP unit's flat parameter (its unsharded layout, alignment
padding included, and the local shard size) we compute, for every rank, which flat range of every original
parameter it holds and where that range sits in its shard. A flat range of an N-d tensor is a union of at most
``2N - 1`` boxes (a partial leading row, a block of whole rows, a partial trailing row, recursively), each
contiguous in row-major order, so a rank can read exactly its own elements from a DCP checkpoint that stores
the parameter in its original shape, and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .internals import numels_with_padding, original_shapes, padding_mask, shard_param_infos


@dataclass(frozen=True)
class Piece:
    """Flat elements ``[start, stop)`` of one original parameter, held by one rank at ``shard_offset`` of its
    flat shard."""

    start: int
    stop: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Member:
    """One original parameter of a flat parameter."""

    fqn: str
    shape: tuple[int, ...]
    pieces: dict[int, Piece]  # rank -> its piece (ranks holding none are absent)


class GeometryMismatch(ValueError):
    """FSDP's own record of this rank's shard disagrees with the computed geometry."""


def flat_members(flat_param: Any, fqns: list[str], world_size: int, rank: int) -> list[Member]:
    """The original parameters of ``flat_param`` and every rank's piece of each.

    ``fqns`` are the original parameters' names in flat-parameter order. Raises :class:`GeometryMismatch` if
    the computation does not reproduce FSDP's ``_shard_param_infos`` for this rank (an unsupported layout,
    e.g. shared parameters): callers then fall back to a slower, layout-agnostic path.
    """
    shard = flat_param.numel()  # every rank's shard has this size (the last ones padded)
    shapes = [tuple(shape) for shape in original_shapes(flat_param)]
    infos = shard_param_infos(flat_param)
    if not (len(fqns) == len(shapes) == len(infos)):
        raise GeometryMismatch(f"{len(fqns)} names, {len(shapes)} shapes, {len(infos)} shard infos")
    members: list[Member] = []
    offset = 0
    index = 0
    for numel, padding in zip(numels_with_padding(flat_param), padding_mask(flat_param)):
        if padding:
            offset += numel
            continue
        if numel != math.prod(shapes[index]):
            raise GeometryMismatch(f"{fqns[index]}: {numel} elements for shape {shapes[index]}")
        pieces = {}
        for holder in range(world_size):
            low, high = max(offset, holder * shard), min(offset + numel, (holder + 1) * shard)
            if low < high:
                pieces[holder] = Piece(low - offset, high - offset, low - holder * shard)
        _check_own(fqns[index], pieces.get(rank), infos[index])
        members.append(Member(fqns[index], shapes[index], pieces))
        offset += numel
        index += 1
    if index != len(shapes):
        raise GeometryMismatch(f"{len(shapes) - index} parameters beyond the padded layout")
    return members


def _check_own(fqn: str, piece: Piece | None, info: Any) -> None:
    if piece is None:
        if info.in_shard:
            raise GeometryMismatch(f"{fqn}: FSDP says this rank holds part of it")
        return
    expected = (True, info.offset_in_shard, info.numel_in_shard, info.intra_param_start_idx, info.intra_param_end_idx)
    if expected != (True, piece.shard_offset, piece.numel, piece.start, piece.stop - 1):
        raise GeometryMismatch(f"{fqn}: computed {piece}, FSDP records {info}")


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Row-major flat range ``[start, stop)`` of a tensor of ``shape`` as boxes ``(offsets, sizes, flat_start)``,
    in flat order; each box is contiguous in the flattened tensor and starts at ``flat_start``."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    result: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    row, column = divmod(start, inner)
    last_row, last_column = divmod(stop, inner)
    if column and row == last_row:  # inside one row
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in boxes(shape[1:], column, last_column)]
    if column:  # partial leading row
        result += [((row, *o), (1, *s), row * inner + f) for o, s, f in boxes(shape[1:], column, inner)]
        row += 1
    if last_row > row:  # whole rows
        result.append(((row, *[0] * (len(shape) - 1)), (last_row - row, *shape[1:]), row * inner))
    if last_column:  # partial trailing row
        result += [((last_row, *o), (1, *s), last_row * inner + f) for o, s, f in boxes(shape[1:], 0, last_column)]
    return result
