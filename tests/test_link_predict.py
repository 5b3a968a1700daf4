"""``gnnpar evaluate`` and ``gnnpar predict --pairs`` on link runs.

A tiny mini-batch link run (one process): ``evaluate`` of its best checkpoint gives the run's
final evaluation (the ``end`` record of metrics.jsonl) exactly; ``predict --pairs`` gives,
for a ``.npy`` of either layout and a text file alike, the decoder's scores of the pairs
recomputed here from the consolidated checkpoint (the plain ``LinkModel``: block encoder,
full-neighbour embeddings, then the decoder), and with ``--sigmoid`` their sigmoid. A full-graph
link run predicts the same scores on two ranks as on one, and evaluates to its final scores
there; a run on edge labels predicts each pair's class logits. A bad pairs file, a pickled
array, an id out of range, and ``--pairs`` on a node run are each one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gnnpar import checkpoint
from gnnpar.cli import main
from gnnpar.cli.train import check_pair_ids, read_pairs
from gnnpar.errors import UserError
from gnnpar.train.metrics import read_metrics
from tests.cli_world import run_commands

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_NODES = 61
SBM = f"num_nodes={NUM_NODES},num_classes=3,feat_dim=5,avg_degree=6"
DATA = ["--dataset", "sbm", "--dataset-options", SBM]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _train(out: Path, *extra: str) -> Path:
    argv = ["train", "link", *DATA, "--hidden", "6", "--epochs", "2", "--quiet"]
    assert main([*argv, "--root", str(out.parent / "data"), "--out", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A mini-batch link run (``mini``) and a full-graph one (``full``: gcn, 1 block)."""
    base = tmp_path_factory.mktemp("runs")
    _train(base / "mini")
    _train(base / "full", "--mode", "full", "--model", "gcn", "--blocks", "1")
    return base


def _pairs() -> np.ndarray:
    """(P, 2) pairs: every node against a shifted one, and a few repeats."""
    src = np.arange(NUM_NODES, dtype=np.int64)
    pairs = np.stack([src, (src * 7 + 3) % NUM_NODES], 1)
    return np.concatenate([pairs, pairs[:5]])


def _end(run: Path) -> dict:
    end = read_metrics(run / "metrics.jsonl")[-1]
    assert end["event"] == "end"
    return {k: v for k, v in end.items() if k not in ("time", "event", "best_step")}


def _plain_scores(run: Path, pairs: np.ndarray) -> np.ndarray:
    """The decoder's scores of ``pairs`` (P, 2) from the consolidated best checkpoint: the
    plain ``LinkModel`` (block encoder and decoder, as the task builds them) with
    full-neighbour embeddings of the run's message-passing graph."""
    from gnnpar.models.link.decoders import make_decoder
    from gnnpar.models.link.encoders import LinkModel
    from gnnpar.models.link.task import LinkConfig, load_link_graph
    from gnnpar.models.minibatch.model import BlockGNN
    from gnnpar.sampling import layerwise_inference
    from gnnpar.train.config import read_run_config

    name, cfg = read_run_config(run, {"link": LinkConfig})
    graph = load_link_graph(cfg)
    in_dim = int(graph.feat.shape[1])
    encoder = BlockGNN(in_dim, cfg.hidden, cfg.hidden, cfg.layers, cfg.dropout, cfg.model,
                       cfg.heads)  # fmt: skip
    model = LinkModel(encoder, make_decoder(cfg.decoder, cfg.hidden, cfg.hidden,
                                            cfg.decoder_layers))  # fmt: skip
    model.load_state_dict(checkpoint.consolidate(run / "checkpoints" / "best"))
    with torch.no_grad():
        h = layerwise_inference(model, graph, features=graph.feat.float())
        src, dst = torch.from_numpy(pairs).T
        return model.decoder(h[src], h[dst]).numpy()


def test_evaluate_gives_the_runs_final_evaluation(runs, tmp_path, capsys):
    run = runs / "mini"
    end = _end(run)
    out = tmp_path / "eval.json"
    assert main(["evaluate", str(run), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["metrics"] == end
    metric = doc["metric"]
    assert metric.startswith("test_") and doc["value"] == end[metric]
    assert doc["step"] == read_metrics(run / "metrics.jsonl")[-1]["best_step"]
    # the line: every test score of the split, its metric first
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{metric}={end[metric]:.4f} ")
    for key in ("test_mrr", "test_rocauc", "test_hits@10"):
        assert f"{key}={end[key]:.4f}" in line
    assert main(["evaluate", str(run), "--split", "train"]) == 2
    assert capsys.readouterr().err.strip().endswith("scored on its val and test edges only")


def test_predict_scores_pairs_as_the_plain_model(runs, tmp_path):
    run = runs / "mini"
    pairs = _pairs()
    want = _plain_scores(run, pairs)
    np.save(tmp_path / "rows.npy", pairs)  # (P, 2)
    np.save(tmp_path / "cols.npy", pairs.T.astype(np.int32))  # (2, P), another int dtype
    text = "# src dst\n" + "".join(f"{s} {d}\n" for s, d in pairs) + "\n"
    (tmp_path / "pairs.txt").write_text(text)
    # the three files hold the same pairs
    read = [read_pairs(tmp_path / n) for n in ("rows.npy", "cols.npy", "pairs.txt")]
    assert all(r.dtype == torch.int64 and r.tolist() == pairs.T.tolist() for r in read)
    for name in ("rows.npy", "pairs.txt"):
        out = tmp_path / f"out-{name}"
        assert main(["predict", str(run), "--pairs", str(tmp_path / name), "--out", str(out)]) == 0
        got = np.load(out / "scores.npy", allow_pickle=False)
        assert got.dtype == np.float32 and got.shape == (len(pairs),)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    about = json.loads((tmp_path / "out-rows.npy" / "scores.json").read_text())
    assert about["values"].startswith("logits") and about["shape"] == [len(pairs)]
    out = tmp_path / "out-rows.npy"
    argv = ["predict", str(run), "--pairs", str(tmp_path / "rows.npy"), "--out", str(out)]
    assert main([*argv, "--sigmoid"]) == 2  # scores.npy exists
    assert main([*argv, "--sigmoid", "--overwrite"]) == 0
    got = np.load(out / "scores.npy", allow_pickle=False)
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-want.astype(np.float64))), atol=1e-6)
    assert json.loads((out / "scores.json").read_text())["values"].startswith("probabilities")


def test_full_graph_predict_on_two_ranks_equals_one(runs, tmp_path):
    run = runs / "full"
    pairs = _pairs()
    np.save(tmp_path / "pairs.npy", pairs.T)
    argv = ["predict", str(run), "--pairs", str(tmp_path / "pairs.npy"), "--out"]
    assert main([*argv, str(tmp_path / "one")]) == 0
    two_eval = tmp_path / "eval-two.json"
    codes = run_commands(2, [
        [*argv, str(tmp_path / "two"), "--nprocs", "2"],
        ["evaluate", str(run), "--nprocs", "2", "--grid", "x=2", "--json", str(two_eval)],
    ])  # fmt: skip
    assert codes == [[0, 0]] * 2
    one, two = (np.load(tmp_path / p / "scores.npy", allow_pickle=False) for p in ("one", "two"))
    assert one.shape == (len(pairs),)
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-5)
    end = _end(run)
    got = json.loads(two_eval.read_text())["metrics"]
    assert got.keys() == end.keys()
    for key, value in end.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _write(path: Path, content) -> Path:
    if isinstance(content, str):
        path.write_text(content)
    else:
        np.save(path, content, allow_pickle=True)
    return path


def test_bad_pairs_files_are_one_line(runs, tmp_path, capsys):
    run = runs / "mini"
    out = str(tmp_path / "out")
    # through the command: refused before the model is built (a pickle: never unpickled),
    # or once the graph's size is known (an id out of range)
    commands = {
        "pickled.npy": (np.array([[0, 1], [2, "x"]], dtype=object), "no pickles are read"),
        "range.npy": (np.array([[0, 1], [5, NUM_NODES]]), f"node id {NUM_NODES} (pair 1) is out "
                      f"of range: the graph has {NUM_NODES} nodes, ids 0 to {NUM_NODES - 1}"),
        "words.txt": ("0 1\n2 three\n", "line 2: expected 'src dst' (two integer node ids), "
                      "got '2 three'"),
    }  # fmt: skip
    for name, (content, message) in commands.items():
        path = _write(tmp_path / name, content)
        assert main(["predict", str(run), "--pairs", str(path), "--out", out]) == 2, name
        err = _one_line_error(capsys)
        assert f"pairs file {path}" in err and message in err, (name, err)
    assert main(["predict", str(run), "--out", out]) == 2
    assert "give --pairs FILE" in _one_line_error(capsys)
    assert not Path(out).exists()
    # the reader's other refusals, each naming the file
    cases = {
        "float.npy": (np.zeros((2, 3)), "holds float64, not integer node ids"),
        "shape.npy": (np.zeros((3, 3), dtype=np.int64), "has shape (3, 3): give (2, P) or (P, 2)"),
        "flat.npy": (np.arange(4), "has shape (4,)"),
        "empty.txt": ("# nothing\n\n", "holds no pairs"),
        "three.txt": ("0 1 2\n", "line 1: expected 'src dst'"),
        "binary.bin": (None, "is not text"),
    }  # fmt: skip
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if content is None:
            path.write_bytes(b"\xff\xfe\x00")
        else:
            _write(path, content)
        with pytest.raises(UserError) as err:
            read_pairs(path)
        assert str(err.value).startswith(f"pairs file {path} ") and message in str(err.value)
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="does not exist"):
        read_pairs(tmp_path / "missing.npy")
    with pytest.raises(UserError, match="node id -3 \\(pair 1\\) is out of range"):
        check_pair_ids(read_pairs(_write(tmp_path / "neg.txt", "0 1\n-3 2\n")), 61, "neg.txt")
    # (2, 2) is read as (2, P): sources in the first row
    square = read_pairs(_write(tmp_path / "square.npy", np.array([[0, 1], [2, 3]])))
    assert square.tolist() == [[0, 1], [2, 3]]


def test_a_node_run_refuses_pairs(tmp_path, capsys):
    run = tmp_path / "gcn"
    argv = ["train", "gcn", *DATA, "--hidden", "4", "--epochs", "1", "--blocks", "1", "--quiet"]
    assert main([*argv, "--root", str(tmp_path / "data"), "--out", str(run)]) == 0
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("0 1\n")
    out = str(tmp_path / "out")
    assert main(["predict", str(run), "--pairs", str(pairs), "--out", out]) == 2
    assert _one_line_error(capsys).endswith(
        f"--pairs is for link runs; {run} is a gcn run (predict writes every node's class)"
    )
    assert main(["predict", str(run), "--sigmoid", "--out", out]) == 2
    assert "--sigmoid is for link runs" in _one_line_error(capsys)
    assert not Path(out).exists()


def test_edge_classification_predicts_each_classs_logit(tmp_path, capsys):
    """A run on edge labels: scores.npy holds each pair's class logits (P × C), the
    argmax of which scores the run's accuracy; --sigmoid is refused in one line."""
    from gnnpar.data import load

    graph = load("sbm", root=str(tmp_path / "data"), num_nodes=NUM_NODES, num_classes=3,
                 feat_dim=5, avg_degree=6.0)  # fmt: skip
    src, dst = graph.edges()
    np.save(tmp_path / "same.npy", (graph.label[src] == graph.label[dst]).long().numpy())
    run = _train(tmp_path / "classes", "--edge-labels", str(tmp_path / "same.npy"),
                 "--decoder", "mlp")  # fmt: skip
    pairs = _write(tmp_path / "pairs.npy", _pairs())
    out = tmp_path / "out"
    argv = ["predict", str(run), "--pairs", str(pairs), "--out", str(out)]
    assert main([*argv, "--sigmoid"]) == 2
    assert "--sigmoid is for link prediction" in _one_line_error(capsys)
    assert main(argv) == 0
    got = np.load(out / "scores.npy", allow_pickle=False)
    assert got.shape == (len(_pairs()), 2) and got.dtype == np.float32
    assert json.loads((out / "scores.json").read_text())["values"].startswith("logits")
