"""Train / validation / test node splits, as boolean masks, deterministic by seed."""

from __future__ import annotations

import numpy as np
import torch

from gnnpar.errors import UserError

__all__ = ["per_class_split", "random_split", "scaled_split_sizes"]


def _masks(num_nodes: int, train: np.ndarray, val: np.ndarray, test: np.ndarray) -> dict:
    out = {}
    for key, ids in (("train_mask", train), ("val_mask", val), ("test_mask", test)):
        mask = torch.zeros(num_nodes, dtype=torch.bool)
        mask[torch.from_numpy(np.asarray(ids, dtype=np.int64))] = True
        out[key] = mask
    return out


def scaled_split_sizes(
    num_nodes: int, num_classes: int, train_per_class: int, num_val: int, num_test: int
) -> tuple[int, int, int]:
    """Planetoid-style sizes, shrunk when the graph is too small to hold them.

    When ``num_classes * train_per_class + num_val + num_test`` exceeds ``num_nodes``, the
    training set becomes about 10% of the nodes (at least one per class) and the rest is
    split one third validation, two thirds test.
    """
    if num_classes * train_per_class + num_val + num_test <= num_nodes:
        return train_per_class, num_val, num_test
    per_class = min(train_per_class, max(1, round(0.1 * num_nodes / max(num_classes, 1))))
    rest = max(num_nodes - per_class * num_classes, 0)
    val = min(num_val, rest // 3)
    return per_class, val, min(num_test, rest - val)


def per_class_split(
    labels: torch.Tensor,
    num_classes: int,
    train_per_class: int = 20,
    num_val: int = 500,
    num_test: int = 1000,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Planetoid-style split: ``train_per_class`` random nodes of every class for training,
    then ``num_val`` and ``num_test`` random nodes from the rest (sizes scaled down by
    :func:`scaled_split_sizes` for small graphs). Returns ``train_mask``, ``val_mask``,
    ``test_mask``."""
    y = labels.numpy()
    n = y.shape[0]
    per_class, num_val, num_test = scaled_split_sizes(
        n, num_classes, train_per_class, num_val, num_test
    )
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    # Group the shuffled nodes by class; rank each node inside its class.
    order = np.argsort(y[perm], kind="stable")
    grouped = y[perm][order]
    starts = np.searchsorted(grouped, grouped, side="left")
    rank = np.arange(n) - starts
    train = perm[order[rank < per_class]]
    is_train = np.zeros(n, dtype=bool)
    is_train[train] = True
    rest = perm[~is_train[perm]]
    return _masks(n, train, rest[:num_val], rest[num_val : num_val + num_test])


def random_split(
    num_nodes: int, train_frac: float = 0.6, val_frac: float = 0.2, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random split by fractions; the nodes left over after train and val form the test set."""
    if not (0 <= train_frac <= 1 and 0 <= val_frac <= 1 and train_frac + val_frac <= 1):
        raise UserError(
            f"train_frac ({train_frac}) and val_frac ({val_frac}) must lie in [0, 1] and sum "
            "to at most 1"
        )
    perm = np.random.default_rng(seed).permutation(num_nodes)
    n_train = int(round(train_frac * num_nodes))
    n_val = min(int(round(val_frac * num_nodes)), num_nodes - n_train)
    return _masks(
        num_nodes, perm[:n_train], perm[n_train : n_train + n_val], perm[n_train + n_val :]
    )
