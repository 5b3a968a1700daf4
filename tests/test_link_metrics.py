"""Link-prediction scores against OGB's evaluator formulas: hand-computed numbers, and a
brute-force reference (loops over every positive and negative) on scores full of ties."""

from __future__ import annotations

import pytest
import torch

from gnnpar.errors import UserError
from gnnpar.train.metrics import (
    UndefinedScoreError,
    hits_at_k,
    hits_from_ranks,
    link_scores,
    mrr,
    ranks_against_shared,
    ranks_per_source,
)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ---------------------------------------------------------------------------- references


def brute_rank(p: float, negs) -> float:
    """OGB's rank: 1 + the mean of the optimistic and the pessimistic count."""
    above = sum(1 for n in negs if n > p)
    at_least = sum(1 for n in negs if n >= p)
    return 0.5 * (above + at_least) + 1


def brute_hits_shared(pos, neg, k: int) -> float:
    """OGB's collab/ppa hits@K: strictly above the k-th highest negative."""
    if len(neg) < k:
        return 1.0
    kth = sorted(neg, reverse=True)[k - 1]
    return sum(1 for p in pos if p > kth) / len(pos)


def brute_auc(pos, neg) -> float:
    """Mann-Whitney by pairs: a win counts 1, a tie one half."""
    total = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return total / (len(pos) * len(neg))


def tied_scores(shape, seed: int) -> torch.Tensor:
    """Scores from a handful of values, so that ties are common."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, shape, generator=g).float() / 5


# ---------------------------------------------------------------------------- hand numbers


def test_hand_computed_ranks_and_mrr():
    # one tie (counts one half) and one higher: rank 1 + (1 + 2) / 2 = 2.5
    assert ranks_per_source(t([0.5]), t([[0.5, 0.9, 0.1]])).tolist() == [2.5]
    assert mrr(t([0.5]), t([[0.5, 0.9, 0.1]])) == pytest.approx(0.4)
    # rank 1.5 (one tie) and rank 3 (one above, two ties): mrr (2/3 + 1/3) / 2 = 0.5
    pos, neg = t([0.3, 0.8]), t([[0.1, 0.2, 0.3], [0.9, 0.8, 0.8]])
    assert ranks_per_source(pos, neg).tolist() == [1.5, 3.0]
    assert mrr(pos, neg) == pytest.approx(0.5)
    # no negatives: every positive ranks first
    assert mrr(t([0.1, 0.2]), torch.zeros(2, 0)) == 1.0


def test_hand_computed_shared_ranks_and_hits():
    assert ranks_against_shared(t([0.5]), t([0.5, 0.9, 0.1])).tolist() == [2.5]
    pos, neg = t([0.9, 0.5, 0.3]), t([0.8, 0.5, 0.1, 0.4])
    assert ranks_against_shared(pos, neg).tolist() == [1.0, 2.5, 4.0]
    assert hits_at_k(pos, neg, 1) == pytest.approx(1 / 3)  # above 0.8
    assert hits_at_k(pos, neg, 2) == pytest.approx(1 / 3)  # above 0.5: a tie is no hit
    assert hits_at_k(pos, neg, 3) == pytest.approx(2 / 3)  # above 0.4
    assert hits_at_k(pos, neg, 5) == 1.0  # fewer negatives than K: OGB's 1.0
    assert hits_from_ranks(torch.tensor([1.0, 1.5, 3.0, 10.0]), 3) == 0.75
    assert hits_from_ranks(torch.tensor([1.0, 1.5, 3.0, 10.0]), 1) == 0.25


def test_hand_computed_link_scores():
    pos, neg = t([0.9, 0.5, 0.3]), t([0.8, 0.5, 0.1, 0.4])
    got = link_scores(pos, neg, "pairs", ["mrr", "hits@2", "rocauc"])
    assert got["mrr"] == pytest.approx((1 / 1 + 1 / 2.5 + 1 / 4) / 3)
    assert got["hits@2"] == pytest.approx(1 / 3)
    # pairs won: 0.9 beats 4; 0.5 beats 2, ties 1; 0.3 beats 1 -> 7.5 of 12
    assert got["rocauc"] == pytest.approx(7.5 / 12)
    got = link_scores(t([0.5]), t([[0.5, 0.9, 0.1]]), "per-source", ["mrr", "hits@3", "hits@2"])
    assert got == pytest.approx({"mrr": 0.4, "hits@3": 1.0, "hits@2": 0.0})


# ---------------------------------------------------------------------------- brute force


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_source_against_brute_force(seed):
    pos, neg = tied_scores((40,), seed), tied_scores((40, 7), seed + 100)
    ranks = [brute_rank(float(pos[i]), neg[i].tolist()) for i in range(40)]
    assert ranks_per_source(pos, neg).tolist() == ranks
    assert mrr(pos, neg) == pytest.approx(sum(1 / r for r in ranks) / 40)
    got = link_scores(pos, neg, "per-source", ["mrr", "rocauc", "hits@1", "hits@3", "hits@10"])
    assert got["mrr"] == pytest.approx(sum(1 / r for r in ranks) / 40)
    for k in (1, 3, 10):
        assert got[f"hits@{k}"] == pytest.approx(sum(r <= k for r in ranks) / 40)
    assert got["rocauc"] == pytest.approx(brute_auc(pos.tolist(), neg.reshape(-1).tolist()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_against_brute_force(seed):
    pos, neg = tied_scores((30,), seed), tied_scores((55,), seed + 100)
    ranks = [brute_rank(p, neg.tolist()) for p in pos.tolist()]
    assert ranks_against_shared(pos, neg).tolist() == ranks
    got = link_scores(pos, neg, "pairs", ["mrr", "rocauc", "hits@1", "hits@20", "hits@100"])
    assert got["mrr"] == pytest.approx(sum(1 / r for r in ranks) / 30)
    for k in (1, 20, 100):
        assert got[f"hits@{k}"] == pytest.approx(brute_hits_shared(pos.tolist(), neg.tolist(), k))
    assert got["rocauc"] == pytest.approx(brute_auc(pos.tolist(), neg.tolist()))


def test_shared_ranks_equal_per_source_ranks_against_the_same_row():
    pos, neg = tied_scores((25,), 7), tied_scores((300,), 8)
    wide = neg[None, :].expand(25, -1)
    assert torch.equal(ranks_against_shared(pos, neg), ranks_per_source(pos, wide))


# ---------------------------------------------------------------------------- errors


def test_undefined_scores():
    empty = torch.zeros(0)
    with pytest.raises(UndefinedScoreError):
        mrr(empty, torch.zeros(0, 3))
    with pytest.raises(UndefinedScoreError):
        hits_at_k(empty, t([0.1]), 1)
    with pytest.raises(UndefinedScoreError):
        ranks_against_shared(empty, t([0.1]))
    with pytest.raises(UndefinedScoreError):
        hits_from_ranks(empty, 3)
    for metric in ("mrr", "rocauc", "hits@5"):
        with pytest.raises(UndefinedScoreError):
            link_scores(empty, t([0.1, 0.2]), "pairs", [metric])
    with pytest.raises(UndefinedScoreError, match="no negative"):
        link_scores(t([0.3]), torch.zeros(0), "pairs", ["rocauc"])


def test_bad_arguments():
    with pytest.raises(UserError, match="protocol"):
        link_scores(t([0.3]), t([0.1]), "triples", ["mrr"])
    with pytest.raises(UserError, match="hits@K"):
        link_scores(t([0.3]), t([0.1]), "pairs", ["hits@0"])
    with pytest.raises(ValueError, match="1-D"):
        link_scores(t([0.3]), t([[0.1]]), "pairs", ["mrr"])
    with pytest.raises(ValueError, match="E x K"):
        link_scores(t([0.3]), t([0.1]), "per-source", ["mrr"])
    with pytest.raises(ValueError, match="E x K"):
        mrr(t([0.3, 0.4]), t([[0.1]]))
