"""Flat-shard geometry: which elements of each original parameter every rank holds (pure functions)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from accelerate_txn.fsdp.geometry import GeometryMismatch, Piece, boxes, flat_members


def test_boxes_cover_exactly_the_flat_range_in_order_with_at_most_2n_minus_1_boxes() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        stop = rng.randint(start, numel)
        tensor = torch.arange(numel).reshape(shape)
        found = boxes(shape, start, stop)
        pieces = []
        for offsets, sizes, flat_start in found:
            piece = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
            assert piece[0].item() == flat_start  # contiguous, starting where it says
            assert torch.equal(piece, torch.arange(flat_start, flat_start + piece.numel()))
            pieces.append(piece)
        joined = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
        assert torch.equal(joined, torch.arange(start, stop)), (shape, start, stop, found)
        assert len(found) <= 2 * len(shape) - 1


def test_boxes_of_a_scalar_and_of_an_empty_range() -> None:
    assert boxes((), 0, 1) == [((), (), 0)]
    assert boxes((4, 4), 5, 5) == []


def _info(piece: Piece | None) -> SimpleNamespace:
    if piece is None:
        return SimpleNamespace(in_shard=False, offset_in_shard=None, numel_in_shard=None,
                               intra_param_start_idx=None, intra_param_end_idx=None)
    return SimpleNamespace(in_shard=True, offset_in_shard=piece.shard_offset, numel_in_shard=piece.numel,
                           intra_param_start_idx=piece.start, intra_param_end_idx=piece.stop - 1)


def _head(rank: int, pieces: list[Piece | None]) -> SimpleNamespace:
    # Linear(16, 5) on 2 ranks, as FSDP lays it out: weight (80), bias (5), 1 alignment element; 43 per rank.
    tensor = torch.empty(43)
    return SimpleNamespace(numel=tensor.numel, _shapes=[torch.Size([5, 16]), torch.Size([5])],
                           _numels_with_padding=(80, 5, 1), _is_padding_mask=[False, False, True],
                           _shard_param_infos=[_info(p) for p in pieces])


def test_flat_members_reproduce_fsdp_shards_including_alignment_padding() -> None:
    rank0 = flat_members(_head(0, [Piece(0, 43, 0), None]), ["head.weight", "head.bias"], 2, 0)
    assert rank0[0].pieces == {0: Piece(0, 43, 0), 1: Piece(43, 80, 0)}
    assert rank0[1].pieces == {1: Piece(0, 5, 37)}
    rank1 = flat_members(_head(1, [Piece(43, 80, 0), Piece(0, 5, 37)]), ["head.weight", "head.bias"], 2, 1)
    assert [m.pieces for m in rank1] == [m.pieces for m in rank0]  # every rank computes every rank's pieces


def test_flat_members_refuse_a_layout_fsdp_records_differently() -> None:
    with pytest.raises(GeometryMismatch, match=r"head\.weight: computed"):
        flat_members(_head(0, [Piece(0, 40, 0), None]), ["head.weight", "head.bias"], 2, 0)
    with pytest.raises(GeometryMismatch, match=r"1 names, 2 shapes"):
        flat_members(_head(0, [Piece(0, 43, 0), None]), ["head.weight"], 2, 0)
