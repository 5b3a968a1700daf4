"""Typed graphs through the trainer (``gnnpar train sage --model rgcn|hgt``): the planted
signal of the mag-like graph is learnt (R-GCN far above a feature-only MLP on the same
split), runs resume exactly (on another number of data ranks, float64 <= 1e-12), and the
ogbn-mag layout trains by catalogue name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from gnnpar import checkpoint
from gnnpar.cli import main
from gnnpar.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

MAG = "num_papers=600,num_authors=300,num_institutions=12,num_fields=24,feat_dim=16"
REL = 1e-12


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _argv(out: Path, epochs: int, *extra: str) -> list[str]:
    return ["train", "sage", "--model", "rgcn", "--dataset", "mag-synth", "--dataset-options",
            MAG, "--root", str(out.parent / "data"), "--epochs", str(epochs), "--hidden", "16",
            "--batch-size", "64", "--fanouts", "4,cites:2/*:3", "--out", str(out), "--quiet",
            "--prefetch", "0", *extra]  # fmt: skip


def _end(run: Path) -> dict:
    return next(r for r in read_metrics(run / "metrics.jsonl") if r.get("event") == "end")


def _feature_only_mlp(seed: int = 0) -> float:
    """Test accuracy of a 2-layer MLP on the papers' own features (the same split)."""
    import gnnpar.data

    options = {k: int(v) for k, v in (kv.split("=") for kv in MAG.split(","))}
    g = gnnpar.data.load("mag-synth", **options)
    t = g.types
    k = t.type_index("paper")
    lo, hi = t.offsets[k], t.offsets[k + 1]
    x, y = g.feat[lo:hi, : t.feat_dims[k]], g.label[lo:hi]
    train, test = g.train_mask[lo:hi], g.test_mask[lo:hi]
    torch.manual_seed(seed)
    mlp = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 16), torch.nn.ReLU(),
                              torch.nn.Linear(16, g.num_classes))  # fmt: skip
    opt = torch.optim.Adam(mlp.parameters(), lr=0.01, weight_decay=5e-4)
    for _ in range(200):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(mlp(x[train]), y[train]).backward()
        opt.step()
    return float((mlp(x[test]).argmax(1) == y[test]).float().mean())


def _same(a: Path, b: Path) -> float:
    sa, sb = checkpoint.consolidate(a), checkpoint.consolidate(b)
    assert list(sa) == list(sb)
    return max(float((sa[k] - v).abs().max()) / max(float(v.abs().max()), 1e-300)
               for k, v in sb.items())  # fmt: skip


def test_rgcn_learns_what_the_papers_features_alone_cannot(tmp_path):
    assert main(_argv(tmp_path / "rgcn", 6, "--lr", "0.02")) == 0
    rgcn, mlp = _end(tmp_path / "rgcn")["test_acc"], _feature_only_mlp()
    print(f"mag-synth test accuracy: R-GCN {rgcn:.3f}, feature-only MLP {mlp:.3f}")
    assert rgcn > mlp + 0.2, (rgcn, mlp)


@pytest.mark.parametrize("model", ["rgcn", "hgt"])
def test_a_typed_run_resumes_to_the_straight_run(tmp_path, model):
    import shutil

    extra = ("--model", model, "--dtype", "float64", "--eval-every", "0", "--bases", "0")
    saved, resumed, straight = tmp_path / "saved", tmp_path / "resumed", tmp_path / "straight"
    assert main(_argv(saved, 1, *extra)) == 0
    shutil.copytree(saved, resumed)
    assert main(_argv(resumed, 2, *extra, "--resume")) == 0
    assert main(_argv(straight, 2, *extra)) == 0
    assert _same(resumed, straight) <= REL


def test_a_typed_model_on_an_untyped_graph_is_one_line(tmp_path, capsys):
    argv = [
        "train",
        "sage",
        "--model",
        "rgcn",
        "--dataset",
        "sbm",
        "--dataset-options",
        "num_nodes=40",
        "--root",
        str(tmp_path / "data"),
        "--out",
        str(tmp_path / "r"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rgcn needs a typed graph" in err[0]


def test_the_ogbn_mag_layout_trains_by_catalogue_name(tmp_path):
    from tests.typed_fixtures import write_ogbn_mag

    write_ogbn_mag(tmp_path / "data" / "ogbn-mag")
    argv = ["train", "sage", "--model", "hgt", "--dataset", "ogbn-mag", "--root",
            str(tmp_path / "data"), "--epochs", "1", "--hidden", "8", "--batch-size", "8",
            "--out", str(tmp_path / "run"), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    assert "test_acc" in _end(tmp_path / "run")


def test_a_typed_run_saved_on_two_zero3_ranks_resumes_on_one(tmp_path):
    import shutil

    from tests.cli_world import run_commands

    extra = ("--dtype", "float64", "--eval-every", "0")
    saved, resumed, straight = tmp_path / "saved", tmp_path / "resumed", tmp_path / "straight"
    assert main(_argv(straight, 2, *extra)) == 0  # one rank (it also makes the dataset)
    # saved with ZeRO-3 (its classifier a unit of its own: evaluation calls it layer-wise)
    codes = run_commands(2, [[*_argv(saved, 1, *extra), "--nprocs", "2", "--zero-stage", "3"]])
    assert codes == [[0], [0]]
    shutil.copytree(saved, resumed)
    assert main(_argv(resumed, 2, *extra, "--resume")) == 0
    assert _same(resumed, straight) <= REL


def test_typed_predictions_cover_the_target_type_only(tmp_path):
    import numpy as np

    run = tmp_path / "run"
    assert main(_argv(run, 1, "--eval-every", "0")) == 0
    assert main(["predict", str(run), "--out", str(tmp_path / "pred")]) == 0
    pred = np.load(tmp_path / "pred" / "predictions.npy")
    papers = int(MAG.split(",")[0].split("=")[1])
    assert (pred >= 0).sum() == papers and pred[-papers:].min() >= 0  # papers come last


def test_a_users_rgat_trains_mini_batch_on_zero3_parts_resumes_and_predicts(tmp_path):
    """The example's RGAT (PyG's ``RGATConv``, a factory taking ``num_relations``) trains
    mini-batch through ``gnnpar train sage``, called as ``model(x, edge_index, edge_type)``
    on each sampled subgraph, on two ZeRO-3 ranks (a part each, sampled at the parts'
    owners): one epoch resumed to two equals two straight (a user's model is not
    bit-identical across rank counts, docs/models.md); the consolidated checkpoint loads
    into the user's class with strict=True, and ``gnnpar predict`` (full-neighbour
    inference over the parts' relations) is the plain model's argmax on the papers."""
    import numpy as np

    import gnnpar.data
    from tests.cli_world import run_commands

    zoo = Path(__file__).resolve().parent.parent / "examples" / "pyg_models.py"
    small = "num_papers=90,num_authors=40,num_institutions=5,num_fields=8,num_classes=4,feat_dim=6"

    def argv(out: Path, epochs: int, *extra: str) -> list[str]:
        return ["train", "sage", "--model", f"{zoo}:rgat", "--model-options",
                "hidden=3,heads=2,dropout=0.0", "--dataset", "mag-synth", "--dataset-options",
                small, "--root", str(tmp_path / "data"), "--epochs", str(epochs),
                "--batch-size", "16", "--fanouts", "4,3", "--out", str(out), "--quiet",
                "--prefetch", "0", "--dtype", "float64", "--eval-every", "0", "--nprocs", "2",
                "--zero-stage", "3", *extra]  # fmt: skip

    saved, resumed, straight = tmp_path / "saved", tmp_path / "resumed", tmp_path / "straight"
    steps = [argv(straight, 2), argv(saved, 1), ("copy", saved, resumed),
             argv(resumed, 2, "--resume"),
             ["predict", str(resumed), "--out", str(tmp_path / "pred")]]  # fmt: skip
    assert run_commands(2, steps) == [[0, 0, 0, 0]] * 2
    # PyG's RGATConv leaves l2 as torch.empty made it (its reset discards a torch.full) and
    # never reads it without mod: its bytes are whatever the allocator held
    sa, sb = checkpoint.consolidate(resumed), checkpoint.consolidate(straight)
    assert list(sa) == list(sb)
    for key, want in sb.items():
        if not key.endswith(".l2"):
            err = float((sa[key] - want).abs().max())
            assert err <= REL * max(float(want.abs().max()), 1e-300), key

    g = gnnpar.data.load("mag-synth", **{k: int(v) for k, v in
                                         (kv.split("=") for kv in small.split(","))})  # fmt: skip
    spec = importlib.util.spec_from_file_location("pyg_models", zoo)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.rgat(6, g.num_classes, g.types.num_relations, hidden=3, heads=2).double()
    model.load_state_dict(sa, strict=True)
    model.eval()
    with torch.no_grad():
        plain = model(g.feat.double(), torch.stack(g.edges()), g.types.edge_type).argmax(1)
    predicted = torch.from_numpy(np.load(tmp_path / "pred" / "predictions.npy")).long()
    papers = g.label >= 0
    assert torch.equal(predicted[papers], plain[papers])
    assert (predicted[~papers] == -1).all()
