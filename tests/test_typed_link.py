"""Link prediction on a relation of a typed graph: the split holds the relation's pairs out of
message passing with their reverses, negatives come from the relation's end types, edge batches
never pass a message along their targets, and ``gnnpar train link --model rgcn --relation``
resumes exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from gnnpar import checkpoint
from gnnpar.cli import main
from gnnpar.errors import UserError
from gnnpar.graph.edge_split import edge_keys, split_edges
from gnnpar.sampling import NeighborSampler
from gnnpar.sampling.edge import EdgeSampler, sorted_edge_keys
from gnnpar.sampling.negative import NegativeSampler

pytestmark = pytest.mark.usefixtures("one_thread")

MAG = {"num_papers": 300, "num_authors": 150, "num_institutions": 8, "num_fields": 12}


@pytest.fixture(scope="module")
def mag():
    import gnnpar.data

    return gnnpar.data.load("mag-synth", **MAG)


def _keys_of(graph, rel: int) -> torch.Tensor:
    src, dst = graph.edges()
    sel = graph.types.edge_type == rel
    return edge_keys(src[sel], dst[sel], graph.num_nodes)


def _span(types, name: str) -> tuple[int, int]:
    k = types.type_index(name)
    return types.offsets[k], types.offsets[k + 1]


@pytest.mark.parametrize(("relation", "negatives"), [("writes", "per-source"), ("cites", "pairs")])
def test_a_relation_split_holds_out_its_pairs_and_their_reverses(mag, relation, negatives):
    message = split_edges(mag, 0.1, 0.1, seed=3, negatives=negatives, num_negatives=4,
                          relation=relation)  # fmt: skip
    split, t, n = message.edge_split, mag.types, mag.num_nodes
    r = t.relation_index(relation)
    rev = t.relation_index("rev_writes") if relation == "writes" else r
    held = torch.cat([split.val, split.test], 1)
    forward, backward = edge_keys(held[0], held[1], n), edge_keys(held[1], held[0], n)
    assert not torch.isin(forward, _keys_of(message, r)).any()
    assert not torch.isin(backward, _keys_of(message, rev)).any()
    assert torch.isin(edge_keys(split.train[0], split.train[1], n), _keys_of(mag, r)).all()
    for other in range(t.num_relations):  # the other relations are untouched
        if other not in (r, rev):
            assert torch.equal(_keys_of(message, other), _keys_of(mag, other))
    lo, hi = _span(t, t.relations[r][2])
    negs = split.val_neg if negatives == "per-source" else split.val_neg[1]
    assert bool(((negs >= lo) & (negs < hi)).all())
    assert split.how["relation"] == "___".join(t.relations[r])


@pytest.mark.parametrize("relation", ["writes", "cites"])
def test_edge_batches_pass_no_message_along_their_targets(mag, relation):
    # cites: the CSR (rows by relation) and key order differ where its edges lie
    message = split_edges(mag, 0.1, 0.1, seed=0, relation=relation)
    t, n = message.types, message.num_nodes
    src, dst = message.edges()
    train = message.edge_split.train
    sampler = NeighborSampler(message, [-1, -1])  # every edge a target could leak through
    lo, hi = _span(t, "paper")
    negatives = NegativeSampler(n, "uniform", 2, dst_range=(lo, hi))
    edges = EdgeSampler(sampler, train, negatives, sorted_edge_keys(message), "reverse")
    ids = torch.arange(0, train.shape[1], 7)
    batch = edges.sample(ids, key=5)
    targets = torch.cat([edge_keys(train[0, ids], train[1, ids], n),
                         edge_keys(train[1, ids], train[0, ids], n)])  # fmt: skip
    for block in batch.blocks:
        passed = edge_keys(src[block.edge_ids], dst[block.edge_ids], n)
        assert not torch.isin(passed, targets).any()
    assert bool(((batch.seeds[batch.neg.reshape(-1)] >= lo) & (
        batch.seeds[batch.neg.reshape(-1)] < hi)).all())  # fmt: skip


def test_relation_errors_are_one_line(mag):
    with pytest.raises(UserError, match="name the relation to predict"):
        split_edges(mag, 0.1, 0.1)
    with pytest.raises(UserError, match="does not run from paper to author"):
        split_edges(mag, 0.1, 0.1, relation="writes", reverse_relation="cites")


def _argv(out: Path, epochs: int, *extra: str) -> list[str]:
    options = ",".join(f"{k}={v}" for k, v in MAG.items())
    return ["train", "link", "--model", "rgcn", "--relation", "cites", "--decoder", "distmult",
            "--dataset", "mag-synth", "--dataset-options", options, "--root",
            str(out.parent / "data"), "--epochs", str(epochs), "--hidden", "8", "--batch-size",
            "256", "--fanouts", "3,3", "--out", str(out), "--quiet", "--prefetch", "0",
            "--dtype", "float64", "--eval-every", "0", *extra]  # fmt: skip


#: The example R-GCN (PyG's RGCNConv; its factory takes num_relations) as a user's encoder.
USER_RGCN = ("--model", f"{Path(__file__).resolve().parent.parent}/examples/pyg_models.py:rgcn",
             "--model-options", "hidden=8,dropout=0.0")  # fmt: skip


@pytest.mark.parametrize("encoder", [(), USER_RGCN], ids=["rgcn", "user-rgcn"])
def test_typed_link_prediction_resumes_to_the_straight_run(tmp_path, monkeypatch, encoder):
    """Edge batches of the relation resume exactly, with the built-in R-GCN or a user's
    (called on each batch's subgraph with every edge's relation)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    saved, resumed, straight = tmp_path / "saved", tmp_path / "resumed", tmp_path / "straight"
    assert main(_argv(saved, 1, *encoder)) == 0
    shutil.copytree(saved, resumed)
    assert main(_argv(resumed, 2, "--resume", *encoder)) == 0
    assert main(_argv(straight, 2, *encoder)) == 0
    a, b = checkpoint.consolidate(resumed), checkpoint.consolidate(straight)
    assert list(a) == list(b) and any("comp" in k or "weight" in k for k in a)
    for k, v in b.items():
        assert float((a[k] - v).abs().max()) <= 1e-12 * max(float(v.abs().max()), 1e-300), k


def test_partitioned_typed_edge_batches_equal_the_local_run(tmp_path):
    """Typed edge batches over 2 parts (balanced per type; neighbours drawn per relation by
    the parts' owners, target pairs dropped there in every relation) train exactly the
    parameters of the one-process run."""
    from tests.cli_world import run_commands

    extra = ["--prefetch", "1", "--dropout", "0.2", "--num-negatives", "2"]
    run_commands(2, [[*_argv(tmp_path / "a", 2, *extra), "--nprocs", "2", "--sampling",
                      "partitioned"]])  # fmt: skip
    run_commands(1, [_argv(tmp_path / "b", 2, *extra)])
    a, b = checkpoint.consolidate(tmp_path / "a"), checkpoint.consolidate(tmp_path / "b")
    assert list(a) == list(b)
    for k, v in b.items():
        assert float((a[k] - v).abs().max()) <= 1e-9 * max(float(v.abs().max()), 1e-300), k


def _full_argv(out: Path, epochs: int, *extra: str) -> list[str]:
    options = ",".join(f"{k}={v}" for k, v in MAG.items())
    return ["train", "link", "--mode", "full", "--model", "rgcn", "--relation", "cites",
            "--decoder", "distmult", "--dataset", "mag-synth", "--dataset-options", options,
            "--root", str(out.parent / "data"), "--epochs", str(epochs), "--hidden", "8",
            "--out", str(out), "--quiet", "--dtype", "float64", "--eval-every", "2",
            "--featureless", "learn", *extra]  # fmt: skip


def test_full_graph_typed_link_prediction_resumes_on_another_grid(tmp_path, monkeypatch):
    """``--mode full --model rgcn``: PyG RGCNConv layers on the grid over each relation's
    mean adjacency of the message graph, DistMult on the relation's pairs with negatives of
    its destination type, the featureless rows learnt. 2 epochs on x=2 resumed on y=2 to 4
    equal 4 epochs on one rank, the learnt table too."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    grid, straight = tmp_path / "grid", tmp_path / "straight"
    assert main(_full_argv(grid, 2, "--nprocs", "2", "--grid", "x=2")) == 0
    assert main(_full_argv(grid, 4, "--nprocs", "2", "--grid", "y=2", "--resume")) == 0
    assert main(_full_argv(straight, 4)) == 0
    a, b = checkpoint.consolidate(grid), checkpoint.consolidate(straight)
    assert list(a) == list(b) and any(k.endswith("convs.0.weight") for k in a)
    a.update(checkpoint.consolidate_inputs(grid))
    b.update(checkpoint.consolidate_inputs(straight))
    assert "inputs.embedding" in b
    for k, v in b.items():
        assert float((a[k] - v).abs().max()) <= 1e-12 * max(float(v.abs().max()), 1e-300), k


def test_full_mode_on_a_typed_graph_needs_an_rgcn(tmp_path, capsys):
    argv = _full_argv(tmp_path / "run", 1)
    argv[argv.index("rgcn")] = "sage"
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("needs an R-GCN encoder (rgcn, or a factory taking num_relations); "
                            "sage reads one untyped adjacency"), err  # fmt: skip


def test_learnt_featureless_rows_are_for_mode_full(tmp_path, capsys):
    """Edge batches learn their own tables (the minibatch rgcn's and hgt's): learnt rows in
    mode minibatch are one line."""
    assert main(_argv(tmp_path / "run", 1, "--featureless", "learn")) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config key 'featureless': learn is for mode full" in err[0], err
