"""Index-seeded dropout: the right rate, unbiased, a pure function of (seed, row, col)."""

import torch

from gnnpar.nn.dropout import hash_uniform, index_dropout


def test_rate_scale_and_determinism():
    x = torch.ones(500, 300, dtype=torch.float64)
    rows = torch.arange(1000, 1500)
    for p in (0.1, 0.5, 0.9):
        y = index_dropout(x, p, seed=7, row_ids=rows)
        assert abs((y == 0).double().mean().item() - p) < 0.01
        assert abs(y.mean().item() - 1.0) < 0.03  # inverted dropout keeps the mean
        assert torch.equal(y, index_dropout(x, p, seed=7, row_ids=rows))
    assert not torch.equal(index_dropout(x, 0.5, 7, rows), index_dropout(x, 0.5, 8, rows))


def test_mask_depends_only_on_global_ids():
    x = torch.ones(40, 30)
    full = index_dropout(x, 0.5, seed=3, row_ids=torch.arange(40))
    part = index_dropout(x[10:25, 7:19], 0.5, seed=3, row_ids=torch.arange(10, 25), col_start=7)
    assert torch.equal(part, full[10:25, 7:19])
    u = hash_uniform(3, torch.arange(40), torch.arange(30))
    assert torch.equal(u >= 0.5, full > 0)
    assert index_dropout(x, 0.5, None, torch.arange(40)) is x
    assert index_dropout(x, 0.5, 3, torch.arange(40), training=False) is x
