"""Negative sampling for link prediction: the distributions (chi-square at a fixed seed, and
a wrong distribution rejected by the same test), the documented random-number contract
(a reference written with the counters), exclusion of true edges and the source, hard-negative
candidates, the same negatives on 1, 2 and 4 ranks, and one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from gnnpar.errors import UserError
from gnnpar.sampling import NegativeSampler, load_candidates, per_source
from gnnpar.sampling.rng import derive_key, random_bits, uniform_below
from gnnpar.testing import run_distributed

KEY = 77


def csr(n: int, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coalesced CSR (rows = destinations, sources sorted within a row) of distinct edges."""
    keys = torch.unique(dst * n + src)
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(keys // n, minlength=n), 0)
    return indptr, keys % n


def random_graph(n: int, p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    adj = torch.rand(n, n, generator=g) < p
    src, dst = torch.nonzero(adj, as_tuple=True)
    return csr(n, src, dst)


def edge_set(indptr: torch.Tensor, indices: torch.Tensor) -> set[tuple[int, int]]:
    n = indptr.numel() - 1
    rows = torch.repeat_interleave(torch.arange(n), indptr.diff())
    return set(zip(indices.tolist(), rows.tolist(), strict=True))  # (src, dst)


def count_hits(src: torch.Tensor, neg: torch.Tensor, edges: set[tuple[int, int]]) -> int:
    """How many negatives are their source or an edge source -> negative."""
    pairs = zip(src.tolist(), neg.tolist(), strict=True)
    return sum(s == d or (s, d) in edges for s, row in pairs for d in row)


def positives(n: int, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sources of ``count`` positives and their global ids (not 0..count-1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(n, (count,), generator=g), torch.arange(count) * 3 + 11


# ---------------------------------------------------------------------------- distributions


def test_uniform_is_uniform():
    n = 50
    src, ids = positives(n, 25_000, 0)
    neg = NegativeSampler(n, "uniform", 4, seed=3).sample(src, ids, KEY)
    assert neg.shape == (25_000, 4) and neg.dtype == torch.int64
    observed = torch.bincount(neg.reshape(-1), minlength=n).numpy()
    assert chisquare(observed, np.full(n, neg.numel() / n)).pvalue > 1e-3


def test_degree_is_unigram_to_the_three_quarters():
    n = 100
    degrees = (1000.0 / torch.arange(1, n + 1)).round().long()  # 1000 ... 10: skewed
    degrees[40] = 0  # never drawn
    src, ids = positives(n, 20_000, 1)
    neg = NegativeSampler(n, "degree", 5, degrees=degrees, seed=3).sample(src, ids, KEY)
    observed = torch.bincount(neg.reshape(-1), minlength=n).numpy()
    assert observed[40] == 0
    keep = degrees.numpy() > 0

    def expected(power: float) -> np.ndarray:
        w = degrees.double().numpy()[keep] ** power
        return w / w.sum() * neg.numel()

    assert chisquare(observed[keep], expected(0.75)).pvalue > 1e-3
    # the same test rejects the plain degree distribution: it can fail
    assert chisquare(observed[keep], expected(1.0)).pvalue < 1e-10


# ---------------------------------------------------------------------------- the contract


def reference(n, k, src, ids, key, seed, rounds, edges) -> torch.Tensor:
    """The module docstring's contract, one negative at a time: round r of negative j of
    positive i is counter j of derive_key(seed, key, r) for id ids[i]; redrawn while it is
    the source or an edge source -> negative."""
    out = torch.empty(len(src), k, dtype=torch.int64)
    for i in range(len(src)):
        s = int(src[i])
        for j in range(k):
            for r in range(rounds + 1):
                bits = random_bits(derive_key(seed, key, r), ids[i : i + 1], k)[j]
                d = int(uniform_below(bits, n))
                if d != s and (s, d) not in edges:
                    break
            out[i, j] = d
    return out


def test_exclusion_follows_the_documented_rounds():
    n, k = 30, 3
    indptr, indices = random_graph(n, 0.5, 4)
    edges = edge_set(indptr, indices)
    src, ids = positives(n, 60, 5)
    for rounds in (0, 1, 2, 8):
        sampler = NegativeSampler(n, "uniform", k, exclude=(indptr, indices), seed=9,
                                  rounds=rounds)  # fmt: skip
        neg = sampler.sample(src, ids, KEY)
        assert torch.equal(neg, reference(n, k, src, ids, KEY, 9, rounds, edges))
        hits = count_hits(src, neg, edges)
        assert sampler.last_hits == hits
        if rounds == 0:
            assert hits > 0  # half the pairs are edges
        if rounds == 8:
            assert hits == 0


def test_exclusion_removes_every_edge_and_the_source():
    n = 200
    indptr, indices = random_graph(n, 0.1, 6)
    edges = edge_set(indptr, indices)
    src, ids = positives(n, 3000, 7)
    for method, extra in (("uniform", {}), ("degree", {"degrees": indptr.diff()})):
        sampler = NegativeSampler(n, method, 4, exclude=(indptr, indices), **extra)
        neg = sampler.sample(src, ids, KEY)
        assert sampler.last_hits == 0
        assert not (neg == src[:, None]).any()
        assert count_hits(src, neg, edges) == 0


def test_unsorted_csr_excludes_the_same():
    n = 40
    indptr, indices = random_graph(n, 0.3, 8)
    shuffled = indices.clone()
    for v in range(n):  # reverse every row: not coalesced any more
        a, b = int(indptr[v]), int(indptr[v + 1])
        shuffled[a:b] = indices[a:b].flip(0)
    src, ids = positives(n, 500, 9)
    a = NegativeSampler(n, "uniform", 2, exclude=(indptr, indices)).sample(src, ids, KEY)
    b = NegativeSampler(n, "uniform", 2, exclude=(indptr, shuffled)).sample(src, ids, KEY)
    assert torch.equal(a, b)


def test_near_complete_graph_reports_what_remains():
    n = 12
    # every edge except s -> s + 1: one valid negative per source, 11 in 12 draws hit
    s, d = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    keep = d != (s + 1) % n
    indptr, indices = csr(n, s[keep], d[keep])
    src, ids = positives(n, 400, 10)
    sampler = NegativeSampler(n, "uniform", 2, exclude=(indptr, indices), rounds=3)
    neg = sampler.sample(src, ids, KEY)
    right = neg == ((src + 1) % n)[:, None]
    assert sampler.last_hits == int((~right).sum())
    assert 0.5 * neg.numel() < sampler.last_hits < 0.85 * neg.numel()  # (11/12)**4 = 0.71
    many = NegativeSampler(n, "uniform", 2, exclude=(indptr, indices), rounds=600)
    neg = many.sample(src, ids, KEY)
    assert many.last_hits == 0 and torch.equal(neg, ((src + 1) % n)[:, None].expand(-1, 2))


def test_negatives_depend_on_the_positive_not_the_batch():
    n = 1000
    indptr, indices = random_graph(n, 0.01, 11)
    src, ids = positives(n, 2000, 12)
    for method, extra in (
        ("uniform", {}),
        ("degree", {"degrees": indptr.diff()}),
        ("candidates", {"candidates": torch.randint(-1, n, (n, 6))}),
    ):
        sampler = NegativeSampler(n, method, 3, exclude=(indptr, indices), **extra)
        whole = sampler.sample(src, ids, KEY)
        part = torch.randperm(2000, generator=torch.Generator().manual_seed(1))[:300]
        assert torch.equal(sampler.sample(src[part], ids[part], KEY), whole[part])
        assert not torch.equal(sampler.sample(src, ids, KEY + 1), whole)
        other = NegativeSampler(n, method, 3, exclude=(indptr, indices), seed=1, **extra)
        assert not torch.equal(other.sample(src, ids, KEY), whole)
        assert sampler.sample(src[:0], ids[:0], KEY).shape == (0, 3)


# ---------------------------------------------------------------------------- candidates


def test_candidates_draw_among_valid_entries_or_fall_back_to_uniform():
    n, c = 30, 5
    g = torch.Generator().manual_seed(13)
    table = torch.randint(0, n, (n, c), generator=g)
    table[torch.rand(n, c, generator=g) < 0.4] = -1  # padding anywhere in a row
    table[3] = -1  # no candidates at all
    table[4] = torch.tensor([-1, 7, -1, -1, 9])
    src = torch.arange(n).repeat_interleave(400)
    ids = torch.arange(src.numel()) + 5
    sampler = NegativeSampler(n, "candidates", 2, candidates=table, seed=2)
    neg = sampler.sample(src, ids, KEY)
    for v in range(n):
        drawn = set(neg[src == v].reshape(-1).tolist())
        valid = set(table[v][table[v] >= 0].tolist())
        if valid:
            assert drawn == valid  # only valid ones, each of them (800 draws)
    four = neg[src == 4].reshape(-1)
    assert 300 < int((four == 7).sum()) < 500  # uniform among the two
    fallback = src == 3
    uniform = NegativeSampler(n, "uniform", 2, seed=2).sample(src[fallback], ids[fallback], KEY)
    assert torch.equal(neg[fallback], uniform)
    empty = NegativeSampler(n, "candidates", 2, candidates=torch.zeros(n, 0, dtype=torch.long))
    assert torch.equal(empty.sample(src, ids, KEY), NegativeSampler(n, k=2).sample(src, ids, KEY))


def test_candidates_with_exclusion_skip_true_edges():
    n = 10
    table = torch.tensor([[1, 2, 3, -1]] * n)
    indptr, indices = csr(n, torch.tensor([0, 5]), torch.tensor([1, 2]))  # 0 -> 1, 5 -> 2
    src = torch.tensor([0] * 50 + [5] * 50)
    neg = NegativeSampler(n, "candidates", 3, candidates=table, exclude=(indptr, indices))
    got = neg.sample(src, torch.arange(100), KEY)
    assert neg.last_hits == 0
    assert set(got[:50].reshape(-1).tolist()) == {2, 3}
    assert set(got[50:].reshape(-1).tolist()) == {1, 3}


def test_per_source_rows():
    table = torch.arange(20).reshape(5, 4)
    assert torch.equal(per_source(table, torch.tensor([4, 0, 4])), table[[4, 0, 4]])
    with pytest.raises(ValueError, match="rows"):
        per_source(table, torch.tensor([5]))


# ---------------------------------------------------------------------------- ranks


SIZES = (1, 2, 4)


def _world(n: int, methods: dict) -> dict:
    """Each rank draws its round-robin share of the ids for worlds of 1, 2 and 4 (ranks
    beyond the size draw nothing); the shares are all-gathered."""
    import gnnpar
    from gnnpar import comm

    grid = gnnpar.init()
    r = grid.rank("data")
    src, ids = positives(n, 997, 14)
    out = {}
    for name, kwargs in methods.items():
        sampler = NegativeSampler(n, **kwargs)
        for size in SIZES:
            mine = torch.arange(r, len(ids), size) if r < size else torch.arange(0)
            neg = sampler.sample(src[mine], ids[mine], KEY)
            sizes = comm.gather_sizes(len(mine), grid, "data")
            out[name, size] = comm.all_gather(neg, grid, "data", sizes=sizes).numpy()
    return out


def test_same_negatives_on_1_2_and_4_ranks():
    n = 300
    indptr, indices = random_graph(n, 0.05, 15)
    g = torch.Generator().manual_seed(16)
    methods = {
        "uniform": {"method": "uniform", "k": 3, "exclude": (indptr, indices)},
        "degree": {"method": "degree", "k": 2, "degrees": indptr.diff(), "seed": 4},
        "candidates": {"method": "candidates", "k": 2,
                       "candidates": torch.randint(-1, n, (n, 4), generator=g)},
    }  # fmt: skip
    results = run_distributed(_world, 4, n, methods, timeout=120)
    src, ids = positives(n, 997, 14)
    for name, kwargs in methods.items():
        single = NegativeSampler(n, **kwargs).sample(src, ids, KEY)
        for size in SIZES:
            order = torch.cat([torch.arange(r, len(ids), size) for r in range(size)])
            for rank_result in results:
                assert np.array_equal(rank_result[name, size], single[order].numpy()), (name, size)


# ---------------------------------------------------------------------------- errors


BAD = [
    ({"num_nodes": 0}, "num_nodes"),
    ({"num_nodes": 2**31}, "num_nodes"),
    ({"method": "popular"}, "method 'popular'"),
    ({"k": 0}, "k must"),
    ({"rounds": -1}, "rounds"),
    ({"method": "degree"}, "needs degrees"),
    ({"method": "degree", "degrees": torch.ones(9)}, r"degrees must be \(10,\)"),
    ({"method": "degree", "degrees": -torch.ones(10)}, "non-negative"),
    ({"method": "degree", "degrees": torch.zeros(10)}, "every degree is 0"),
    ({"degrees": torch.ones(10)}, "degrees are for method 'degree'"),
    ({"method": "candidates"}, "needs a candidates table"),
    ({"method": "candidates", "candidates": torch.zeros(10, 2)}, "int64"),
    ({"method": "candidates", "candidates": torch.full((10, 2), 10)}, "outside"),
    ({"method": "candidates", "candidates": torch.full((10, 2), -2)}, "outside"),
    ({"exclude": torch.zeros(3)}, "pair"),
    ({"exclude": (torch.zeros(4, dtype=torch.long), torch.zeros(0, dtype=torch.long))}, "CSR"),
    ({"exclude": (torch.zeros(11, dtype=torch.long), torch.zeros(0))}, "CSR"),
    ({"exclude": (torch.tensor([0] * 10 + [1]), torch.tensor([10]))}, "indices"),
    ({"exclude": (torch.tensor([0, 2] + [1] * 9), torch.tensor([1]))}, "CSR|decrease"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD)
def test_bad_constructor_input_is_one_line(kwargs, match):
    kwargs = {"num_nodes": 10, **kwargs}
    with pytest.raises(UserError, match=match) as err:
        NegativeSampler(**kwargs)
    assert "\n" not in str(err.value)


def test_load_candidates(tmp_path):
    good = tmp_path / "good.npy"
    table = np.array([[1, -1, 2], [-1, -1, -1], [0, 1, 2]], dtype=np.int32)
    np.save(good, table)
    got = load_candidates(good, num_nodes=3)
    assert got.dtype == torch.int64 and torch.equal(got, torch.from_numpy(table).long())
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"not an array")
    cases = {
        "float.npy": (np.zeros((3, 2)), None, "dtype float64"),
        "flat.npy": (np.zeros(3, dtype=np.int64), None, "shape"),
        "rows.npy": (np.zeros((4, 2), dtype=np.int64), 3, "4 rows"),
        "big.npy": (np.array([[0, 3]] * 3), 3, "candidate id 3"),
        "low.npy": (np.array([[0, -2]] * 3), None, "candidate id -2"),
        "objects.npy": (np.array([[1, "x"]], dtype=object), None, "readable"),
    }
    for name, (arr, n, match) in cases.items():
        np.save(tmp_path / name, arr, allow_pickle=True)
        with pytest.raises(UserError, match=match) as err:
            load_candidates(tmp_path / name, num_nodes=n)
        assert name in str(err.value) and "\n" not in str(err.value)
    for path, match in ((garbage, "readable"), (tmp_path / "none.npy", "no such")):
        with pytest.raises(UserError, match=match) as err:
            load_candidates(path)
        assert path.name in str(err.value) and "\n" not in str(err.value)
