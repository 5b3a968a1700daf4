"""Link prediction beside DGL 1.1.3: the ``link`` task's mini-batch pipeline against DGL's
``dgl.dataloading.as_edge_prediction_sampler`` on the same graph, split and model.

**Graph.** gnnpar's R-MAT generator (``gnnpar.data.load("rmat", scale=16, feat_dim=128)``:
65,536 nodes, undirected and coalesced, 128 random features; ``--quick``: scale 12), one
random edge split (:func:`~gnnpar.graph.edge_split.split_edges`, ``--val`` / ``--test`` of the
undirected pairs, ``per-source`` negatives: 100 corrupted destinations per positive, so MRR
is OGB's per-source MRR as in ogbl-citation2). Both pipelines train on the split's
message-passing graph (training edges only, both directions); DGL gets it as
``dgl.graph((src, dst))`` in our CSR order, so DGL's edge ids are our CSR positions.

**Model**, the same on both sides: GraphSAGE-mean, 2 layers, 128 → 128 → 128, ReLU between,
no dropout, dot-product decoder, binary cross-entropy over each positive and its negative,
Adam (lr 0.005). Ours is :class:`~gnnpar.models.minibatch.model.BlockGNN` in a
:class:`~gnnpar.models.link.encoders.LinkModel` with a
:class:`~gnnpar.models.link.decoders.DotDecoder`; DGL's is two ``dgl.nn.SAGEConv(.., "mean")``
holding **our initial weights** (``fc_neigh.weight`` = our ``lin_neigh.weight``,
``fc_self.weight`` = ``lin_root.weight``, ``fc_self.bias`` = ``lin_neigh.bias``: the same
function; the full-graph embeddings of the two initial models are compared and printed).

**Batches**: 1,024 training positives (each undirected pair once), one uniform negative
destination per positive, fan-outs 10,10, the batch's target edges and their reverses left
out of its message passing. Ours: the objects the task builds (``_setup_minibatch``):
:class:`~gnnpar.sampling.edge.EdgeSampler` over a :class:`~gnnpar.sampling.NeighborSampler`
and a uniform :class:`~gnnpar.sampling.negative.NegativeSampler`, ``exclude="reverse"``, fed
by a :class:`~gnnpar.sampling.NodeLoader` (prefetch 1, the task's default: sampling in a
background thread; and prefetch 0), and the task's step (its ``score_batch`` and ``_loss``).
Ours draws the neighbours and then drops the excluded edges (a node next to a target edge
gets one neighbour fewer where it was drawn); DGL samples from the edges that remain.
DGL: ``as_edge_prediction_sampler(NeighborSampler([10, 10]), exclude="reverse_id",
reverse_eids=..., negative_sampler=negative_sampler.Uniform(1))`` in a
``dgl.dataloading.DataLoader`` (shuffled, ``num_workers=0``), features gathered by
``index_select``. One torch thread and ``OMP_NUM_THREADS=1`` for both.

**Timing.** Ours (prefetch 1) and DGL each train ``--epochs`` epochs from the same initial
weights; the run is cut into ``--rounds`` rounds taken in turn (ours, DGL, ours, DGL, ...),
and each round ends with a window of ``--window`` batches of a second copy of our
pipeline with prefetch 0 (the same batches in the same order: the losses of its steps are
checked against the prefetched run's). Two epochs by default: one epoch is 835 batches,
about two minutes a side on 2 shared cores. A step is the loader's next batch, forward,
backward and the Adam step; throughput is positive edges per second of wall time (and per
CPU second of the process, all threads, which leaves out the time other jobs hold the cores).
Reported: the median over rounds with the spread (min-max), the epoch times (the sums of the
steps of each epoch), and where the time goes (sampling, feature gathering, model).

**Accuracy.** After training, every node's embedding with full neighbourhoods on the message
graph (ours: :func:`~gnnpar.sampling.layerwise_inference`; DGL: its ``SAGEConv`` layers on
the whole DGL graph), then MRR, Hits@10, Hits@50 and ROC-AUC of the validation and test
positives against their per-source negatives, both by
:func:`gnnpar.train.metrics.link_scores`.

PyG's ``LinkNeighborLoader`` needs pyg-lib or torch-sparse, which cannot be installed here, so
PyG is not compared.

Run::

    python benchmarks/link_prediction.py            # about 11 minutes on 2 shared cores
    python benchmarks/link_prediction.py --quick    # scale 12, 1 round (under a minute)

Writes ``benchmarks/out/link_prediction.json`` and ``link_prediction.png``, and prints the
tables.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and dgl are imported

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from gnnpar.graph.edge_split import edge_keys, split_edges  # noqa: E402
from gnnpar.models.link.decoders import DotDecoder, bce_sum  # noqa: E402
from gnnpar.models.link.encoders import LinkModel  # noqa: E402
from gnnpar.models.minibatch.model import BlockGNN  # noqa: E402
from gnnpar.sampling import (  # noqa: E402
    NeighborSampler,
    NodeLoader,
    compiled,
    derive_key,
    full_blocks,
    layerwise_inference,
)
from gnnpar.sampling.edge import EdgeSampler, graph_keys  # noqa: E402
from gnnpar.sampling.negative import NegativeSampler  # noqa: E402
from gnnpar.train.metrics import link_scores  # noqa: E402
from gnnpar.train.optim import adam  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
FEAT = HIDDEN = 128
BATCH, FANOUTS, NEGATIVES, LR = 1024, [10, 10], 1, 0.005
METRICS = ["mrr", "hits@10", "hits@50", "rocauc"]
PYG_NOTE = (
    "PyG's LinkNeighborLoader needs pyg-lib or torch-sparse, which cannot be installed here, "
    "so PyG is not compared."
)
_LOW31 = (1 << 31) - 1


def _dgl():
    warnings.filterwarnings("ignore")
    import dgl

    return dgl


# ------------------------------------------------------------------------------ data
def build_graph(scale: int, val: float, test: float, negatives: int, seed: int) -> dict:
    """The R-MAT graph, its split and the message graph, with DGL's view of the latter."""
    import gnnpar.data

    dgl = _dgl()
    t = time.perf_counter()
    whole = gnnpar.data.load("rmat", scale=scale, feat_dim=FEAT, seed=seed)
    if not whole.is_symmetric():
        raise SystemExit("the R-MAT graph is not symmetric")
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    message = split_edges(whole, val, test, seed=seed, negatives="per-source",
                          num_negatives=negatives)  # fmt: skip
    t_split = time.perf_counter() - t
    split = message.edge_split
    keys = graph_keys(message)  # sorted: CSR position i is edge id i (coalesced)
    src, dst = message.edges()
    n = message.num_nodes
    reverse = torch.searchsorted(keys, edge_keys(dst, src, n))
    train_eids = torch.searchsorted(keys, edge_keys(split.train[0], split.train[1], n))
    if not bool((keys[reverse] == edge_keys(dst, src, n)).all()):
        raise SystemExit("the message graph is not symmetric")
    if not bool((keys[train_eids] == edge_keys(split.train[0], split.train[1], n)).all()):
        raise SystemExit("a training pair is not an edge of the message graph")
    dgl_graph = dgl.graph((src, dst), num_nodes=n)
    return {
        "whole": whole, "message": message, "split": split, "keys": keys,
        "dgl_graph": dgl_graph, "reverse_eids": reverse, "train_eids": train_eids,
        "seconds": {"load": t_load, "split": t_split},
    }  # fmt: skip


# ------------------------------------------------------------------------------ models
def our_model(seed: int) -> LinkModel:
    """The task's minibatch model: BlockGNN (sage, no dropout) + dot decoder."""
    torch.manual_seed(seed)
    return LinkModel(BlockGNN(FEAT, HIDDEN, HIDDEN, 2, 0.0, "sage"), DotDecoder())


class DGLSage(torch.nn.Module):
    """Two DGL ``SAGEConv`` (mean) layers with a ReLU between."""

    def __init__(self) -> None:
        super().__init__()
        from dgl.nn import SAGEConv

        self.layers = torch.nn.ModuleList(
            [SAGEConv(FEAT, HIDDEN, "mean"), SAGEConv(HIDDEN, HIDDEN, "mean")]
        )

    def forward(self, graphs: list[Any], x: torch.Tensor) -> torch.Tensor:
        """Outputs of the last graph's destinations (blocks, or the whole graph twice)."""
        h = x
        for i, (layer, g) in enumerate(zip(self.layers, graphs, strict=True)):
            h = layer(g, h)
            if i < len(self.layers) - 1:
                h = torch.relu(h)
        return h

    @torch.no_grad()
    def copy_from(self, ours: LinkModel) -> None:
        """Our weights into DGL's layout: ``fc_neigh`` = ``lin_neigh`` (its bias goes to
        ``fc_self.bias``, DGL's only bias), ``fc_self`` = ``lin_root``."""
        for mine, theirs in zip(ours.encoder.layers, self.layers, strict=True):
            theirs.fc_neigh.weight.copy_(mine.lin_neigh.weight)
            theirs.fc_self.weight.copy_(mine.lin_root.weight)
            theirs.fc_self.bias.copy_(mine.lin_neigh.bias)


# ------------------------------------------------------------------------------ pipelines
class Recorder:
    """Per-step times of one pipeline, summed per round and per epoch."""

    def __init__(self) -> None:
        self.rounds: list[dict] = []
        self.epoch_s: dict[int, float] = {}
        self.losses: list[float] = []

    def start(self) -> None:
        """Open a round."""
        self.cur = {"edges": 0, "batches": 0, "wall_s": 0.0, "cpu_s": 0.0, "next_s": 0.0,
                    "sample_s": 0.0, "gather_s": 0.0, "model_s": 0.0, "loss": 0.0}  # fmt: skip
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def step(self, epoch: int, edges: int, seconds: float, loss: float, **parts: float) -> None:
        """One step's edges, wall time, loss and parts of its time."""
        c = self.cur
        c["edges"] += edges
        c["batches"] += 1
        c["loss"] += loss
        for k, v in parts.items():
            c[k] += v
        self.epoch_s[epoch] = self.epoch_s.get(epoch, 0.0) + seconds
        self.losses.append(loss)

    def stop(self) -> None:
        """Close the round: its throughput per wall and per CPU second."""
        c = self.cur
        c["wall_s"] = time.perf_counter() - self._wall
        c["cpu_s"] = time.process_time() - self._cpu
        c["edges_per_s"] = c["edges"] / c["wall_s"]
        c["edges_per_cpu_s"] = c["edges"] / max(c["cpu_s"], 1e-9)
        c["loss"] /= max(c["batches"], 1)
        self.rounds.append(c)


class Ours:
    """The ``link`` task's minibatch pipeline (``LinkTask._setup_minibatch`` and its
    ``train_step``, one rank): EdgeSampler + NodeLoader (the model's ``prepare`` building
    the blocks' operators where they are sampled), BlockGNN + dot decoder."""

    def __init__(self, data: dict, seed: int, prefetch: int) -> None:
        g, split = data["message"], data["split"]
        self.seed = seed
        self.net = our_model(seed)
        self.opt = adam(self.net.parameters(), lr=LR)  # the task's
        negatives = NegativeSampler(g.num_nodes, "uniform", NEGATIVES, seed=seed)
        sampler = NeighborSampler(g, FANOUTS, replace=False, seed=seed)
        edges = EdgeSampler(sampler, split.train, negatives, data["keys"], "reverse")
        ids = torch.arange(split.train.shape[1], dtype=torch.int64)
        self.loader = NodeLoader(
            edges, ids, BATCH, seed=seed, features=g.feat, prefetch=prefetch, keys=ids,
            all_keys=ids, num_nodes=ids.numel(), prepare=self.net.prepare,
        )  # fmt: skip
        self.batches_per_epoch = len(self.loader)
        self.prefetch = prefetch
        self.record = Recorder()
        self._stream = self._forever()

    def _forever(self) -> Iterator[Any]:
        while True:
            yield from self.loader

    def run(self, steps: int) -> None:
        """``steps`` training steps (the task's loop body), recorded as one round."""
        net, opt, rec = self.net, self.opt, self.record
        net.train()
        rec.start()
        for _ in range(steps):
            t0 = time.perf_counter()
            batch = next(self._stream)
            t1 = time.perf_counter()
            seed = derive_key(self.seed, batch.epoch, batch.index) & _LOW31
            h = net(batch.blocks, batch.x, dropout_seed=seed)  # LinkTask.score_batch
            src, dst = batch.pairs
            h_src = h.index_select(0, src)
            pos = net.decoder(h_src, h.index_select(0, dst))
            neg = net.decoder(h_src[:, None, :], h[batch.neg])
            loss = bce_sum(pos.float(), neg.float()) / (1 + neg.shape[1])  # LinkTask._loss
            (loss / batch.global_size).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            parts = {"next_s": t1 - t0, "model_s": t2 - t1}
            if self.prefetch == 0:
                parts["sample_s"] = batch.stats["sample_s"]
                parts["gather_s"] = batch.stats["gather_s"]
            rec.step(batch.epoch, pos.numel(), t2 - t0, float(loss) / pos.numel(), **parts)
        rec.stop()

    def close(self) -> None:
        """Stop the prefetch thread."""
        self._stream.close()

    @torch.no_grad()
    def embeddings(self, data: dict) -> torch.Tensor:
        """Every node's embedding with full neighbourhoods (as ``LinkTask.embeddings``)."""
        g = data["message"]
        return layerwise_inference(self.net, g, features=g.feat, blocks=full_blocks(g))


class DGLPipeline:
    """DGL's link-prediction pipeline: ``as_edge_prediction_sampler`` in a DataLoader."""

    def __init__(self, data: dict, seed: int, init: LinkModel) -> None:
        dgl = _dgl()
        self.graph, self.feat = data["dgl_graph"], data["message"].feat
        self.net = DGLSage()
        self.net.copy_from(init)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=LR, foreach=True)  # as ours
        sampler = dgl.dataloading.as_edge_prediction_sampler(
            dgl.dataloading.NeighborSampler(FANOUTS), exclude="reverse_id",
            reverse_eids=data["reverse_eids"],
            negative_sampler=dgl.dataloading.negative_sampler.Uniform(NEGATIVES),
        )  # fmt: skip
        dgl.seed(seed)
        torch.manual_seed(seed)
        self.loader = dgl.dataloading.DataLoader(
            self.graph, data["train_eids"], sampler, batch_size=BATCH, shuffle=True,
            drop_last=False, num_workers=0,
        )  # fmt: skip
        self.batches_per_epoch = len(self.loader)
        self.record = Recorder()
        self._stream = self._forever()

    def _forever(self) -> Iterator[tuple[int, Any]]:
        epoch = 0
        while True:
            for item in self.loader:
                yield epoch, item
            epoch += 1

    def run(self, steps: int) -> None:
        """``steps`` training steps, recorded as one round."""
        net, opt, rec = self.net, self.opt, self.record
        net.train()
        rec.start()
        for _ in range(steps):
            t0 = time.perf_counter()
            epoch, (input_nodes, pair_graph, neg_graph, blocks) = next(self._stream)
            t1 = time.perf_counter()
            x = self.feat.index_select(0, input_nodes)
            t2 = time.perf_counter()
            h = net(blocks, x)
            u, v = pair_graph.edges()
            nu, nv = neg_graph.edges()
            h_src = h.index_select(0, u)
            pos = (h_src * h.index_select(0, v)).sum(-1)
            neg = (h.index_select(0, nu) * h.index_select(0, nv)).sum(-1).view(pos.numel(), -1)
            loss = bce_sum(pos, neg) / (1 + neg.shape[1])
            (loss / pos.numel()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            rec.step(epoch, pos.numel(), t3 - t0, float(loss) / pos.numel(),
                     next_s=t1 - t0, sample_s=t1 - t0, gather_s=t2 - t1,
                     model_s=t3 - t2)  # fmt: skip
        rec.stop()

    @torch.no_grad()
    def embeddings(self, data: dict) -> torch.Tensor:
        """Every node's embedding: DGL's layers on the whole message graph."""
        self.net.eval()
        try:
            return self.net([self.graph, self.graph], self.feat)
        finally:
            self.net.train()


def warm_up(data: dict, seed: int) -> None:
    """A few batches of each pipeline on throw-away copies (numba compiles our sampler's
    kernels, DGL builds its graph formats)."""
    for make in (
        lambda: Ours(data, seed + 1, 0),
        lambda: DGLPipeline(data, seed + 1, our_model(seed + 1)),
    ):
        p = make()
        p.run(3)
        if isinstance(p, Ours):
            p.close()


# ------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def link_eval(h: torch.Tensor, split: Any, chunk: int = 2048) -> dict:
    """MRR, Hits@K and ROC-AUC of the split's validation and test positives against their
    per-source negatives, scored by the dot decoder on the embeddings ``h``."""
    dec = DotDecoder()
    out = {}
    for which in ("val", "test"):
        pairs, negs = getattr(split, which), getattr(split, f"{which}_neg")
        if pairs.shape[1] == 0:
            continue
        src, dst = pairs
        pos = dec(h[src], h[dst])
        neg = torch.cat([dec(h[src[lo : lo + chunk]][:, None, :], h[negs[lo : lo + chunk]])
                         for lo in range(0, src.numel(), chunk)])  # fmt: skip
        out[which] = link_scores(pos.double(), neg.double(), split.protocol, METRICS)
    return out


# ------------------------------------------------------------------------------ report
def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(rec: Recorder, batches_per_epoch: int, whole_epochs: bool = True) -> dict:
    """Medians over rounds, epoch times (measured where the pipeline ran whole epochs,
    else projected from its batches' time) and the split of a step's time."""
    rounds = rec.rounds
    total = {
        k: sum(r[k] for r in rounds)
        for k in ("edges", "batches", "wall_s", "next_s", "sample_s", "gather_s", "model_s")
    }
    per_batch = {k: total[k] / max(total["batches"], 1) * 1e3
                 for k in ("next_s", "sample_s", "gather_s", "model_s")}  # fmt: skip
    rate = _spread([r["edges_per_s"] for r in rounds])
    return {
        "edges_per_s": rate,
        "edges_per_cpu_s": _spread([r["edges_per_cpu_s"] for r in rounds]),
        "epoch_s_measured": [rec.epoch_s[e] for e in sorted(rec.epoch_s)] if whole_epochs else None,
        "epoch_s_projected": batches_per_epoch * total["wall_s"] / max(total["batches"], 1),
        "ms_per_batch": {k.replace("_s", ""): v for k, v in per_batch.items()},
        "batches": total["batches"],
        "rounds": rounds,
    }


def markdown(result: dict) -> str:
    """The tables."""
    s, names = result["speed"], {"ours": "gnnpar, prefetch 1 (the task's default)",
                                 "ours_prefetch0": "gnnpar, prefetch 0",
                                 "dgl": "DGL 1.1.3, num_workers 0"}  # fmt: skip
    dgl = s["dgl"]["edges_per_s"]["median"]
    lines = [
        "| pipeline | edges/s (median, min-max) | vs DGL | edges/CPU-s | epoch s "
        "| ms/batch: next / sample / gather / model |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for key in ("ours", "ours_prefetch0", "dgl"):
        r = s[key]
        e, c, ms = r["edges_per_s"], r["edges_per_cpu_s"]["median"], r["ms_per_batch"]
        if key == "ours_prefetch0":
            epoch = f"{r['epoch_s_projected']:.1f} (projected)"
        else:
            epoch = " / ".join(f"{x:.1f}" for x in r["epoch_s_measured"])
        sample = "-" if key == "ours" else f"{ms['sample']:.1f}"
        gather = "-" if key == "ours" else f"{ms['gather']:.1f}"
        lines.append(
            f"| {names[key]} | {e['median']:,.0f} ({e['min']:,.0f}-{e['max']:,.0f}) | "
            f"{e['median'] / dgl:.2f}x | {c:,.0f} | {epoch} | {ms['next']:.1f} / {sample} / "
            f"{gather} / {ms['model']:.1f} |"
        )
    ratio = s["ratio"]
    lines.append(
        f"\nratio gnnpar/DGL (medians): {ratio['ours']:.2f}x with prefetch (per round: median "
        f"{ratio['ours_per_round_median']:.2f}x, {ratio['ours_range'][0]:.2f}-"
        f"{ratio['ours_range'][1]:.2f}), "
        f"{ratio['ours_prefetch0']:.2f}x without; per CPU second {ratio['ours_cpu']:.2f}x and "
        f"{ratio['ours_prefetch0_cpu']:.2f}x; goal {result['goal']['ratio']}x; load average "
        f"{result['load_average'][0][0]:.1f} at the start, {result['load_average'][1][0]:.1f} at "
        "the end"
    )
    a = result["accuracy"]
    lines += ["", f"| after {result['epochs']} epochs | " + " | ".join(
        f"{w} {m}" for w in ("test", "val") for m in ("MRR", "Hits@10", "Hits@50", "ROC-AUC"))
        + " |", "|---|" + "---:|" * 8]  # fmt: skip
    for key, label in (("ours", "gnnpar"), ("dgl", "DGL 1.1.3")):
        cells = [f"{a[key][w][m]:.4f}" for w in ("test", "val") for m in METRICS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append(
        f"\ntest MRR gnnpar - DGL: {a['mrr_gap_points']:+.2f} points (goal within 1); initial "
        f"full-graph embeddings max |gnnpar - DGL| = {a['initial_embedding_max_diff']:.2e}; "
        f"prefetch 0 vs 1 losses equal over {s['prefetch_check']['steps']} steps: "
        f"{s['prefetch_check']['equal']}"
    )
    lines.append(f"\n{PYG_NOTE}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Throughput (median, min-max bars) and test metrics, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["speed"]
    keys = ("ours", "ours_prefetch0", "dgl")
    labels = ("gnnpar\nprefetch 1", "gnnpar\nprefetch 0", "DGL 1.1.3")
    colors = ("#4c72b0", "#8fa8d0", "#dd8452")
    med = [s[k]["edges_per_s"]["median"] for k in keys]
    err = [[m - s[k]["edges_per_s"]["min"] for k, m in zip(keys, med, strict=True)],
           [s[k]["edges_per_s"]["max"] - m for k, m in zip(keys, med, strict=True)]]  # fmt: skip
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(labels, med, yerr=err, color=colors, capsize=4)
    ax1.set_ylabel("positive edges / s (median, min-max)")
    ax1.set_title(f"training throughput, {result['graph']['name']}", fontsize=9)
    names = ["mrr", "hits@10", "hits@50", "rocauc"]
    width = 0.38
    for i, (key, label, color) in enumerate((("ours", "gnnpar", colors[0]),
                                             ("dgl", "DGL 1.1.3", colors[2]))):  # fmt: skip
        vals = [result["accuracy"][key]["test"][m] for m in names]
        ax2.bar([j + (i - 0.5) * width for j in range(len(names))], vals, width, label=label,
                color=color)  # fmt: skip
    ax2.set_xticks(range(len(names)), ["MRR", "Hits@10", "Hits@50", "ROC-AUC"])
    ax2.set_ylim(0, 1)
    ax2.set_title(f"test metrics after {result['epochs']} epochs (100 negatives per source)",
                  fontsize=9)  # fmt: skip
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="scale 12, 1 round, 1 epoch (smoke)")
    p.add_argument("--scale", type=int, default=None, help="R-MAT scale (default 16)")
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default 2)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5)")
    p.add_argument("--window", type=int, default=None,
                   help="batches of the prefetch-0 pipeline per round (default 60)")  # fmt: skip
    p.add_argument("--val", type=float, default=0.01, help="validation fraction of the edges")
    p.add_argument("--test", type=float, default=0.05, help="test fraction of the edges")
    p.add_argument("--eval-negatives", type=int, default=100, help="negatives per positive")
    p.add_argument("--threads", type=int, default=1, help="torch threads (both)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(OUT / "link_prediction.json"), help="JSON to write")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    args = p.parse_args(argv)
    scale = args.scale or (12 if args.quick else 16)
    epochs = args.epochs or (1 if args.quick else 2)
    rounds = args.rounds or (1 if args.quick else 5)
    window = args.window or (10 if args.quick else 60)
    torch.set_num_threads(args.threads)
    dgl = _dgl()
    start = time.perf_counter()
    load_start = os.getloadavg()
    print(f"R-MAT scale {scale}, {FEAT} features; split val {args.val} test {args.test}, "
          f"{args.eval_negatives} per-source negatives", flush=True)  # fmt: skip
    data = build_graph(scale, args.val, args.test, args.eval_negatives, args.seed)
    g, split = data["message"], data["split"]
    print(f"  {g.num_nodes:,} nodes, {data['whole'].num_edges:,} edges, message graph "
          f"{g.num_edges:,}; train/val/test pairs {split.train.shape[1]:,} / "
          f"{split.val.shape[1]:,} / {split.test.shape[1]:,} (load {data['seconds']['load']:.1f}"
          f" s, split {data['seconds']['split']:.1f} s)", flush=True)  # fmt: skip

    warm_up(data, args.seed)
    ours = Ours(data, args.seed, prefetch=1)
    ours0 = Ours(data, args.seed, prefetch=0)  # same init and batches, no prefetch thread
    theirs = DGLPipeline(data, args.seed, ours.net)
    h_ours, h_dgl = ours.embeddings(data), theirs.embeddings(data)
    init_diff = float((h_ours - h_dgl).abs().max())
    print(f"  initial full-graph embeddings: max |gnnpar - DGL| = {init_diff:.2e}", flush=True)
    if theirs.batches_per_epoch != ours.batches_per_epoch:
        raise SystemExit("the two loaders cut epochs into different numbers of batches")

    total = epochs * ours.batches_per_epoch
    per_round = math.ceil(total / rounds)
    print(f"training {epochs} epoch(s) of {ours.batches_per_epoch} batches each, in {rounds} "
          f"interleaved round(s) of {per_round} batches (+ {window} of prefetch 0)",
          flush=True)  # fmt: skip
    done = 0
    for r in range(rounds):
        steps = min(per_round, total - done)
        ours.run(steps)
        theirs.run(steps)
        ours0.run(window)
        done += steps
        o, d, o0 = (x.record.rounds[-1] for x in (ours, theirs, ours0))
        print(f"  round {r + 1}: gnnpar {o['edges_per_s']:,.0f} edges/s (loss {o['loss']:.4f}), "
              f"DGL {d['edges_per_s']:,.0f} (loss {d['loss']:.4f}), gnnpar prefetch 0 "
              f"{o0['edges_per_s']:,.0f}; load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    ours.close()
    ours0.close()
    n0 = len(ours0.record.losses)
    same = ours0.record.losses == ours.record.losses[:n0]

    speed = {
        "ours": summarise(ours.record, ours.batches_per_epoch),
        "ours_prefetch0": summarise(ours0.record, ours.batches_per_epoch, whole_epochs=False),
        "dgl": summarise(theirs.record, theirs.batches_per_epoch),
        "prefetch_check": {"steps": n0, "equal": same},
    }
    pipelines = ("ours", "ours_prefetch0", "dgl")
    rate = {k: [x["edges_per_s"] for x in speed[k]["rounds"]] for k in pipelines}
    cpu = {k: speed[k]["edges_per_cpu_s"]["median"] for k in rate}
    med = {k: speed[k]["edges_per_s"]["median"] for k in rate}
    per_round_ratio = [a / b for a, b in zip(rate["ours"], rate["dgl"], strict=True)]
    speed["ratio"] = {
        "ours": med["ours"] / med["dgl"],
        "ours_range": [min(per_round_ratio), max(per_round_ratio)],
        "ours_per_round_median": statistics.median(per_round_ratio),
        "ours_per_round": per_round_ratio,
        "ours_prefetch0": med["ours_prefetch0"] / med["dgl"],
        "ours_cpu": cpu["ours"] / cpu["dgl"],
        "ours_prefetch0_cpu": cpu["ours_prefetch0"] / cpu["dgl"],
    }

    print("evaluating (full-neighbour embeddings, per-source negatives)", flush=True)
    acc = {"ours": link_eval(ours.embeddings(data), split),
           "dgl": link_eval(theirs.embeddings(data), split)}  # fmt: skip
    acc["mrr_gap_points"] = 100 * (acc["ours"]["test"]["mrr"] - acc["dgl"]["test"]["mrr"])
    acc["initial_embedding_max_diff"] = init_diff

    result: dict[str, Any] = {
        "graph": {
            "name": f"rmat scale {scale}",
            "nodes": g.num_nodes,
            "edges": data["whole"].num_edges,
            "message_edges": g.num_edges,
            "train_pairs": int(split.train.shape[1]),
            "val_pairs": int(split.val.shape[1]),
            "test_pairs": int(split.test.shape[1]),
            "features": FEAT,
            "split": {
                "val": args.val,
                "test": args.test,
                "negatives": "per-source",
                "num_negatives": args.eval_negatives,
                "seed": args.seed,
            },
            "seconds": data["seconds"],
        },  # fmt: skip
        "model": f"GraphSAGE-mean {FEAT}-{HIDDEN}-{HIDDEN}, dot decoder, BCE, Adam lr {LR}",
        "batch": {
            "positives": BATCH,
            "negatives_per_positive": NEGATIVES,
            "fanouts": FANOUTS,
            "exclude": "the target edges and their reverses",
        },
        "epochs": epochs,
        "rounds": rounds,
        "batches_per_round": per_round,
        "prefetch0_window": window,
        "threads": args.threads,
        "sampler_backend": "numba" if compiled.available() else "torch",
        "speed": speed,
        "accuracy": acc,
        "goal": {"ratio": 1.5, "mrr_points": 1.0},
        "pyg": PYG_NOTE,
        "versions": {
            "torch": torch.__version__,
            "dgl": dgl.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
        "load_average": [load_start, os.getloadavg()],
        "command": "python benchmarks/link_prediction.py" + (" --quick" if args.quick else ""),
    }
    result["seconds"] = time.perf_counter() - start
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print()
    print(markdown(result))
    written = [str(out)]
    if not args.no_plot:
        png = out.with_suffix(".png")
        plot(result, png)
        written.append(str(png))
    print(f"\nwrote {' and '.join(written)} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
