"""A trainer rank's part of a committed version, cut out of the full state a rollout holds
(ftstate.transport.shards.part_of / part_form): what a replaced rank gets back."""

from __future__ import annotations

import pytest
import torch

from ftstate import Shard
from ftstate.core.errors import ManifestError
from ftstate.core.ownership import plan_ownership
from ftstate.transport import state_checksum
from ftstate.transport.shards import assemble, part_form, part_of, split_state


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(10, 6, generator=g),                    # dim-0: 4, 4, 2 over 3
            "proj": torch.randn(5, 7, generator=g).to(torch.bfloat16),  # dim-1: 3, 3, 1 over 3
            "bias": torch.arange(4)}                                    # rank 1 owns it whole


def rank_state(full: dict[str, torch.Tensor], r: int, n: int = 3) -> dict[str, object]:
    out: dict[str, object] = {"emb": Shard(full["emb"].chunk(n, 0)[r], 0, r, n),
                              "proj": Shard(full["proj"].chunk(n, 1)[r], 1, r, n)}
    if r == 1:
        out["bias"] = full["bias"]
    return out


def ownership_and_parts(full):
    parts, pieces = {}, []
    for r in range(3):
        parts[r], ps = split_state(rank_state(full, r), rank=r, member=f"trainer-{r}", device_type="cpu")
        pieces += ps
    return plan_ownership(pieces, ranks=3), parts


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_ranks_part_cut_from_the_full_state_is_what_it_sent_bit_for_bit(rank):
    full = full_state()
    own, sent = ownership_and_parts(full)
    held = assemble(own, sent)  # what every rollout holds after the sync
    part = part_of(own, held, rank)
    assert set(part) == set(sent[rank])
    assert state_checksum(part) == state_checksum(sent[rank])
    assert all(t.is_contiguous() for t in part.values())  # a dim-1 slice travels as its own bytes


def test_the_part_comes_back_in_the_form_the_rank_returned_it():
    full = full_state()
    own, sent = ownership_and_parts(full)
    form = part_form(own, part_of(own, assemble(own, sent), 2), 2)
    assert set(form) == {"emb", "proj"}
    assert (form["proj"].dim, form["proj"].index, form["proj"].count) == (1, 2, 3)
    assert torch.equal(form["proj"].tensor, full["proj"].chunk(3, 1)[2])
    assert part_form(own, part_of(own, assemble(own, sent), 1), 1)["bias"].tolist() == [0, 1, 2, 3]


def test_a_rollout_holding_another_shape_says_which_tensor():
    full = full_state()
    own, sent = ownership_and_parts(full)
    held = dict(assemble(own, sent))
    held["emb"] = held["emb"][:9]
    with pytest.raises(ManifestError, match=r"tensor 'emb': this rollout holds \[9, 6\].*says \[10, 6\]"):
        part_of(own, held, 0)
