"""Ownership of one weights version over N trainer ranks (ftstate.core.ownership): pure, no torch."""

from __future__ import annotations

import pytest

from ftstate import OwnershipError, Shard
from ftstate.core.ownership import Ownership, Piece, plan_ownership, slice_length


def whole(name: str, rank: int, shape: tuple[int, ...] = (4, 3), dtype: str = "float32") -> Piece:
    return Piece(name, rank, dtype, shape)


def sliced(name: str, rank: int, shape: tuple[int, ...], dim: int, index: int, count: int,
           dtype: str = "float32") -> Piece:
    return Piece(name, rank, dtype, shape, dim, index, count)


class TestTheUnionIsTheVersion:
    def test_gather_style_rank_zero_owns_everything(self):
        own = plan_ownership([whole("a", 0), whole("b", 0)], ranks=3)
        assert [t.name for t in own.tensors] == ["a", "b"]
        assert own.senders() == (0,)

    def test_pipeline_style_each_rank_its_own_layers(self):
        own = plan_ownership([whole("layer0", 0), whole("layer1", 1), whole("layer2", 2)], ranks=3)
        assert {t.name: t.ranks for t in own.tensors} == {"layer0": (0,), "layer1": (1,), "layer2": (2,)}
        assert own.senders() == (0, 1, 2)

    def test_dim0_slices_with_an_uneven_last_slice_add_up_to_the_full_shape(self):
        # 10 rows over 3 ranks: 4, 4, 2
        own = plan_ownership([sliced("w", r, (n, 5), 0, r, 3) for r, n in enumerate((4, 4, 2))], ranks=3)
        (t,) = own.tensors
        assert (t.shape, t.dim) == ((10, 5), 0)
        assert [(p.rank, p.start, p.length) for p in t.parts] == [(0, 0, 4), (1, 4, 4), (2, 8, 2)]

    def test_dim1_slices_may_come_from_ranks_in_any_order(self):
        own = plan_ownership([sliced("w", 1, (3, 2), 1, 1, 2), sliced("w", 0, (3, 3), 1, 0, 2)], ranks=2)
        (t,) = own.tensors
        assert (t.shape, [p.rank for p in t.parts]) == ((3, 5), [0, 1])

    def test_the_record_round_trips(self):
        own = plan_ownership([whole("a", 1), sliced("w", 0, (3, 2), 1, 0, 1)], ranks=2)
        assert Ownership.from_record(own.record()) == own


class TestBadOwnershipIsATypedErrorNamingTensorAndRanks:
    def test_a_tensor_owned_whole_by_two_ranks(self):
        with pytest.raises(OwnershipError, match=r"tensor 'a' \(trainer ranks 0, 2\): owned twice") as err:
            plan_ownership([whole("a", 0), whole("a", 2)], ranks=3)
        assert (err.value.tensor, err.value.ranks) == ("a", (0, 2))

    def test_whole_on_one_rank_and_sliced_on_another(self):
        with pytest.raises(OwnershipError, match=r"owned twice \(whole by ranks 0 and sliced by ranks 1\)"):
            plan_ownership([whole("a", 0, (4, 3)), sliced("a", 1, (2, 3), 0, 1, 2)], ranks=2)

    def test_overlap_the_same_slice_twice(self):
        with pytest.raises(OwnershipError, match=r"slice 0 of 2 along dim 0 is owned twice \(ranks 0 and 1\): overlap"):
            plan_ownership([sliced("w", 0, (2, 3), 0, 0, 2), sliced("w", 1, (2, 3), 0, 0, 2)], ranks=2)

    def test_gap_a_slice_nobody_owns(self):
        with pytest.raises(OwnershipError, match=r"tensor 'w' \(trainer ranks 0, 2\): slices \[1\] of 3 .*gap"):
            plan_ownership([sliced("w", 0, (2, 3), 0, 0, 3), sliced("w", 2, (2, 3), 0, 2, 3)], ranks=3)

    def test_mismatched_other_dims(self):
        with pytest.raises(OwnershipError, match=r"disagree on the other dims: rank 0 has \[2, 3\], rank 1 has \[2, 4\]"):
            plan_ownership([sliced("w", 0, (2, 3), 0, 0, 2), sliced("w", 1, (2, 4), 0, 1, 2)], ranks=2)

    def test_mismatched_dtypes(self):
        with pytest.raises(OwnershipError, match="disagree on dtype: rank 0 says float32, rank 1 says bfloat16"):
            plan_ownership([sliced("w", 0, (2, 3), 0, 0, 2), sliced("w", 1, (2, 3), 0, 1, 2, "bfloat16")], ranks=2)

    def test_mismatched_counts_or_dims(self):
        with pytest.raises(OwnershipError, match="disagree on count"):
            plan_ownership([sliced("w", 0, (2, 3), 0, 0, 2), sliced("w", 1, (2, 3), 0, 1, 3)], ranks=2)
        with pytest.raises(OwnershipError, match="disagree on dim"):
            plan_ownership([sliced("w", 0, (2, 3), 0, 0, 2), sliced("w", 1, (2, 3), 1, 1, 2)], ranks=2)

    def test_slice_lengths_must_follow_the_chunk_rule(self):
        # 2 + 4 rows over 2 slices: slice 0 must be ceil(6/2) = 3 long
        with pytest.raises(OwnershipError, match=r"slice 0 of 2 along dim 0 has length 2, expected 3"):
            plan_ownership([sliced("w", 0, (2, 3), 0, 0, 2), sliced("w", 1, (4, 3), 0, 1, 2)], ranks=2)

    def test_an_empty_slice_is_refused(self):
        # 4 rows over 4 slices of ceil(4/4)=1 is fine; 3 rows over 4 cannot fill the last one
        with pytest.raises(OwnershipError, match="expected"):
            plan_ownership([sliced("w", r, (n, 1), 0, r, 4) for r, n in enumerate((1, 1, 1, 0))], ranks=4)

    def test_nothing_owned_at_all(self):
        with pytest.raises(OwnershipError, match="no trainer rank returned any tensor"):
            plan_ownership([], ranks=2)

    def test_a_rank_outside_the_trainer_ranks(self):
        with pytest.raises(OwnershipError, match="rank 2 is not a trainer rank"):
            plan_ownership([whole("a", 2)], ranks=2)


class TestShard:
    def test_fields_are_checked(self):
        with pytest.raises(ValueError, match=r"Shard.index must be in \[0, 2\), got 2"):
            Shard(None, 0, 2, 2)
        with pytest.raises(ValueError, match=r"Shard\.count must be >= 1"):
            Shard(None, 0, 0, 0)
        with pytest.raises(TypeError, match=r"Shard\.dim must be an int"):
            Shard(None, True, 0, 1)

    def test_slice_length_is_torch_chunk(self):
        assert [slice_length(10, i, 3) for i in range(3)] == [4, 4, 2]
        assert [slice_length(5, i, 2) for i in range(2)] == [3, 2]
