"""Distributed mini-batch training beside DistDGL (DGL 1.1.3's ``dgl.distributed``).

The same graph and model on 2 partitions and 2 trainers, in one run:

- **ours**: the ``sage`` task of ``gnnpar train sage --nprocs 2 --parts 2`` (its
  :class:`~gnnpar.models.minibatch.task.MiniBatchTask`, one epoch per ``train_step``, in a 2-rank
  world): each rank owns one METIS part (``partitioners``), samples across parts and fetches
  remote features with all-to-alls, gradients all-reduced by :mod:`gnnpar.shard`.
- **DistDGL**: ``dgl.distributed.partition_graph`` (METIS, 2 parts, training nodes and edges
  balanced, as DGL's distributed example does), one graph server and one trainer per part,
  started as DGL's ``tools/launch.py`` starts them (its ``DGL_*`` environment variables), each
  trainer with ``dgl.dataloading.DistNodeDataLoader`` (sampling in the trainer,
  ``DGL_NUM_SAMPLER=0``), ``dgl.nn.SAGEConv`` and torch's ``DistributedDataParallel``.

Graph: gnnpar's R-MAT generator (``--dataset rmat``; scale 15 and 128 features by default,
``--quick`` scale 12 and 32), 60% training nodes. Model: GraphSAGE-mean, 2 layers, hidden 64,
dropout 0.5 on every layer's input, Adam (lr 0.01, weight decay 5e-4); fan-outs 10,10; a
global batch of 1,024 seeds (512 per trainer for DGL). One thread per process.

Bytes moved, two ways:

- **loopback**: each system runs in a network namespace of its own (``unshare -rn``), so the
  ``lo`` counters of ``/proc/net/dev`` count its processes' traffic only; the bytes sent over
  ``lo`` around each epoch (after a barrier on both sides) include TCP/IP headers and
  acknowledgements. Ours runs with ``GNNPAR_SHM=0`` here, so that its collectives go over
  gloo's TCP like DGL's RPC (by default a same-host group uses shared memory instead).
- **counted**: ours as :mod:`gnnpar.comm` counts them (gradient all-reduce of every rank,
  sampling and feature all-to-alls); DGL 1.1.3 exposes no byte counter for its RPC.

One host stands in for DistDGL's two machines: the two ``(server, trainer)`` pairs each get a
mount namespace with a private ``/dev/shm`` (DGL names its shared-memory segments by graph
name only: two servers of one graph on one host overwrite each other's, and the first local
pull of a trainer fails, ``Check failed: l_id < local_data_shape[0]``), and each trainer is
told its machine id (DGL derives it from the first local address found in the IP list, which
on one host is always the first line's). Both need user namespaces (``unshare -r``); where they
are refused the script says so and compares nothing.

Each run trains ``--epochs`` epochs (default 4, ``--quick`` 3), the first a warm-up; ours
and DistDGL's runs alternate ``--rounds`` times (default 2, ``--quick`` 1: the machine is
shared) and the median over every kept epoch is reported, with each round's ratio. Writes
``benchmarks/out/distdgl.json`` and prints the table.

Run::

    python benchmarks/distdgl.py            # a few minutes on 2 cores
    python benchmarks/distdgl.py --quick    # a small graph
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and dgl are imported

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "out"
GRAPH_NAME = "bench"
PARTS = 2


# ------------------------------------------------------------------------------ helpers
def lo_sent() -> int:
    """Bytes sent over the loopback interface of this network namespace so far."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])  # rx: 8 fields, then tx bytes
    raise RuntimeError("/proc/net/dev lists no loopback interface")


def free_port() -> int:
    """A TCP port free on the loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PRIVATE_SHM = "mount -t tmpfs tmpfs /dev/shm"


def namespaces_refused() -> str | None:
    """Why this user cannot run a network namespace of their own with, inside it, mount
    namespaces with a private ``/dev/shm``; None when they can."""
    if shutil.which("unshare") is None:
        return "no `unshare` command"
    probe = subprocess.run(
        ["unshare", "-rn", "sh", "-c", f"ip link set lo up && unshare -m sh -c '{_PRIVATE_SHM}'"],
        capture_output=True, text=True,
    )  # fmt: skip
    if probe.returncode:
        return f"`unshare -rn` / `unshare -m` refused: {probe.stderr.strip() or probe.returncode}"
    return None


def in_netns(argv: list[str]) -> list[str]:
    """``argv`` run in a fresh network namespace with its loopback up."""
    inner = " ".join(f"'{a}'" for a in argv)
    return ["unshare", "-rn", "sh", "-c", f"ip link set lo up && exec {inner}"]


def self_argv(role: str, spec: Path, *extra: str) -> list[str]:
    """This script, in one of its internal roles."""
    return [sys.executable, str(Path(__file__).resolve()), "--role", role, "--spec", str(spec),
            *extra]  # fmt: skip


def dataset_options(spec: dict[str, Any]) -> str:
    return f"scale={spec['scale']},feat_dim={spec['feat_dim']}"


def load_graph(spec: dict[str, Any]) -> Any:
    """The R-MAT graph both systems train on, as ``gnnpar train`` loads it."""
    from gnnpar.data import load

    return load("rmat", root=spec["data"], scale=spec["scale"], feat_dim=spec["feat_dim"])


# ------------------------------------------------------------------------------ ours
def _gnnpar_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of the ``sage`` task; per epoch: seconds, counted and loopback bytes."""
    import torch.distributed as dist

    from gnnpar import comm
    from gnnpar.models.minibatch.task import MiniBatchConfig
    from gnnpar.train.spec import build_task

    torch.set_num_threads(1)
    cfg = MiniBatchConfig(
        dataset="rmat", root=spec["data"], dataset_options=dataset_options(spec), parts=PARTS,
        fanouts=",".join(map(str, spec["fanouts"])), batch_size=spec["batch_size"],
        hidden=spec["hidden"], layers=len(spec["fanouts"]), dropout=0.5, lr=0.01,
        weight_decay=5e-4, epochs=spec["epochs"], eval_every=0, seed=0,
        out=str(Path(spec["work"]) / "ours"),
    )  # fmt: skip
    cfg.check()
    task = build_task("sage", cfg)
    epochs = []
    for epoch in range(spec["epochs"]):
        dist.barrier()
        sent, t0 = lo_sent(), time.perf_counter()
        with comm.record(task.grid) as traffic:
            record = task.train_step(epoch)
        dist.barrier()
        seconds, lo = time.perf_counter() - t0, lo_sent() - sent
        grads = torch.tensor([float(traffic.bytes())], dtype=torch.float64)
        dist.all_reduce(grads)  # every rank's trainer traffic (gradients, epoch statistics)
        counted = float(grads) + record["sample_bytes"] + record["feature_bytes"]
        epochs.append({"seconds": seconds, "lo_bytes": lo, "counted_bytes": counted,
                       "steps": record["batches"], "loss": record["loss"],
                       "gradient_bytes": float(grads), "sample_bytes": record["sample_bytes"],
                       "feature_bytes": record["feature_bytes"]})  # fmt: skip
    return {"epochs": epochs, "seeds": task.num_seeds}


def run_ours(spec_path: Path) -> int:
    """(In its namespace) the 2-rank world of ours; writes the result next to the spec."""
    from gnnpar.testing import run_distributed

    spec = json.loads(spec_path.read_text())
    results = run_distributed(_gnnpar_rank, PARTS, spec, timeout=3600)
    Path(spec["work"], "ours.json").write_text(json.dumps(results[0]))
    return 0


# ------------------------------------------------------------------------------ DistDGL
def _dgl() -> Any:
    warnings.filterwarnings("ignore")
    import dgl

    return dgl


def partition_dgl(graph: Any, spec: dict[str, Any]) -> float:
    """Write DGL's partition of ``graph`` (METIS, 2 parts); returns its seconds."""
    dgl = _dgl()
    src, dst = graph.edges()
    g = dgl.graph((src, dst), num_nodes=graph.num_nodes)
    g.ndata["feat"] = graph.feat
    g.ndata["label"] = graph.label.to(torch.int64)
    g.ndata["train_mask"] = graph.train_mask.to(torch.int32)
    t0 = time.perf_counter()
    dgl.distributed.partition_graph(
        g, GRAPH_NAME, PARTS, str(Path(spec["work"]) / "dgl-parts"), part_method="metis",
        balance_ntypes=g.ndata["train_mask"], balance_edges=True,
    )  # fmt: skip
    return time.perf_counter() - t0


def _dgl_env(spec: dict[str, Any], machine: int, role: str) -> dict[str, str]:
    """The environment DGL's launcher gives a server or a trainer of ``machine``."""
    env = {
        "DGL_DIST_MODE": "distributed",
        "DGL_ROLE": role,
        "DGL_NUM_SAMPLER": "0",
        "DGL_NUM_SERVER": "1",  # servers per machine
        "DGL_NUM_CLIENT": str(PARTS),  # trainers x (1 + samplers) x machines
        "DGL_IP_CONFIG": spec["ip_config"],
        "DGL_CONF_PATH": spec["part_config"],
        "DGL_GRAPH_FORMAT": "csc",
        "DGL_KEEP_ALIVE": "0",
        "DGL_GROUP_ID": "0",
        "OMP_NUM_THREADS": "1",
        "BENCH_MACHINE": str(machine),
    }
    if role == "server":
        env["DGL_SERVER_ID"] = str(machine)  # machine id x servers per machine + local index
    else:  # torch.distributed for DistributedDataParallel, one trainer per machine
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["master_port"]),
                   RANK=str(machine), WORLD_SIZE=str(PARTS), LOCAL_RANK="0")  # fmt: skip
    return env


def wait_all(procs: list[subprocess.Popen]) -> int:
    """Wait for every process; when one fails, stop the others (a DistDGL server or trainer
    whose peer died waits for it forever). Returns the first non-zero exit code, or 0."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped parent stops these
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [c for c in codes if c]
            if failed or all(c == 0 for c in codes):
                return failed[0] if failed else 0
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()


def run_dgl_cluster(spec_path: Path) -> int:
    """(In its network namespace) both machines, each in a mount namespace with a private
    ``/dev/shm``."""
    spec = json.loads(spec_path.read_text())
    ports = [free_port() for _ in range(PARTS)]
    Path(spec["ip_config"]).write_text("".join(f"127.0.0.1 {p}\n" for p in ports))
    spec["master_port"] = free_port()
    spec_path.write_text(json.dumps(spec))
    procs = []
    for m in range(PARTS):
        argv = self_argv("dgl-machine", spec_path, "--machine", str(m))
        inner = " ".join(f"'{a}'" for a in argv)
        argv = ["unshare", "-m", "sh", "-c", f"{_PRIVATE_SHM} && exec {inner}"]
        procs.append(subprocess.Popen(argv))
    return wait_all(procs)


def run_dgl_machine(spec_path: Path, machine: int) -> int:
    """One machine: its graph server and its trainer."""
    spec = json.loads(spec_path.read_text())
    procs = [
        subprocess.Popen(
            self_argv(f"dgl-{role}", spec_path), env={**os.environ, **_dgl_env(spec, machine, role)}
        )  # fmt: skip
        for role in ("server", "client")
    ]
    return wait_all(procs)


def run_dgl_server(spec_path: Path) -> int:
    """A DistDGL graph server: serves its partition until the trainers exit."""
    dgl = _dgl()
    dgl.distributed.initialize(json.loads(spec_path.read_text())["ip_config"])
    return 0  # not reached: a server exits in initialize


class _Sage(torch.nn.Module):
    """GraphSAGE-mean with DGL's layers, shaped as ours: dropout, layer, ReLU but last."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, layers: int):
        super().__init__()
        from dgl.nn import SAGEConv

        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        self.layers = torch.nn.ModuleList(
            SAGEConv(dims[i], dims[i + 1], "mean") for i in range(layers)
        )
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, blocks: list[Any], x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, (layer, block) in enumerate(zip(self.layers, blocks, strict=True)):
            h = layer(block, self.dropout(h))
            if i < len(self.layers) - 1:
                h = torch.relu(h)
        return h


def run_dgl_trainer(spec_path: Path) -> int:
    """A DistDGL trainer; trainer 0 writes per-epoch seconds and loopback bytes."""
    import torch.distributed as dist
    import torch.nn.functional as F

    dgl = _dgl()
    from dgl.distributed import rpc_client

    spec = json.loads(spec_path.read_text())
    machine = int(os.environ["BENCH_MACHINE"])
    # On one host every trainer would find the first IP line's address and so take machine
    # id 0; this trainer plays machine ``machine`` (the partition its server holds).
    rpc_client.get_local_machine_id = lambda namebook: machine
    torch.set_num_threads(1)
    dgl.distributed.initialize(spec["ip_config"])
    dist.init_process_group("gloo")
    g = dgl.distributed.DistGraph(GRAPH_NAME, part_config=spec["part_config"])
    train = dgl.distributed.node_split(g.ndata["train_mask"], g.get_partition_book())
    sampler = dgl.dataloading.NeighborSampler(spec["fanouts"][::-1])  # input layer first
    loader = dgl.dataloading.DistNodeDataLoader(
        g, train, sampler, batch_size=spec["batch_size"] // PARTS, shuffle=True, drop_last=False
    )
    torch.manual_seed(0)
    feat_dim, classes = g.ndata["feat"].shape[1], spec["classes"]
    model = torch.nn.parallel.DistributedDataParallel(
        _Sage(feat_dim, spec["hidden"], classes, len(spec["fanouts"]))
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    epochs = []
    for _ in range(spec["epochs"]):
        model.train()
        dist.barrier()
        sent, t0 = lo_sent(), time.perf_counter()
        steps, total = 0, 0.0
        for input_nodes, seeds, blocks in loader:
            x = g.ndata["feat"][input_nodes]
            y = g.ndata["label"][seeds].long()
            loss = F.cross_entropy(model(blocks, x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps, total = steps + 1, total + float(loss)
        dist.barrier()
        seconds, lo = time.perf_counter() - t0, lo_sent() - sent
        epochs.append({"seconds": seconds, "lo_bytes": lo, "steps": steps,
                       "loss": total / max(steps, 1)})  # fmt: skip
    if machine == 0:
        Path(spec["work"], "dgl.json").write_text(
            json.dumps({"epochs": epochs, "seeds_per_trainer": int(len(train))})
        )
    dist.barrier()
    return 0


# ------------------------------------------------------------------------------ main
def _kept(run: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's epochs after the warm-up."""
    return run["epochs"][1:] or run["epochs"]


def _summary(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every kept epoch of ``runs`` (one per round)."""
    rows = [e for run in runs for e in _kept(run)]
    out = {"system": name, "steps": rows[-1]["steps"], "runs": runs}
    for key in ("seconds", "lo_bytes", "counted_bytes"):
        if key in rows[0]:
            out[key] = statistics.median(r[key] for r in rows)
    return out


def _run(argv: list[str], what: str, result: Path) -> dict[str, Any]:
    """Run ``argv`` and return the JSON it wrote to ``result`` (taken away, so that a later
    run cannot leave a stale one)."""
    proc = subprocess.run(argv, cwd=ROOT, timeout=3600)
    if proc.returncode or not result.exists():
        raise RuntimeError(f"{what} failed (exit code {proc.returncode})")
    out = json.loads(result.read_text())
    result.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="R-MAT scale 12, 32 features, 3 epochs")
    p.add_argument("--scale", type=int, default=None, help="R-MAT scale (default 15)")
    p.add_argument("--feat-dim", type=int, default=None, help="features (default 128)")
    p.add_argument("--epochs", type=int, default=None, help="epochs of each (first: warm-up)")
    p.add_argument("--rounds", type=int, default=None, help="alternating runs of each")
    p.add_argument("--json", default=str(OUT / "distdgl.json"), help="JSON to write")
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)  # internal processes
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--machine", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        spec = Path(args.spec)
        roles = {"ours": run_ours, "dgl-cluster": run_dgl_cluster, "dgl-server": run_dgl_server,
                 "dgl-client": run_dgl_trainer}  # fmt: skip
        if args.role == "dgl-machine":
            return run_dgl_machine(spec, args.machine)
        return roles[args.role](spec)
    try:
        _dgl()
    except ImportError:
        print("DGL is not installed (the dev-llm-dgl extra installs dgl 1.1.3): nothing to compare")
        return 0
    scale = args.scale or (12 if args.quick else 15)
    feat_dim = args.feat_dim or (32 if args.quick else 128)
    epochs = args.epochs or (3 if args.quick else 4)
    rounds = args.rounds or (1 if args.quick else 2)
    refused = namespaces_refused()
    if refused:
        print(f"DistDGL cannot run two machines on this host: {refused} (see the docstring)")
        return 0
    with tempfile.TemporaryDirectory(prefix="distdgl-") as tmp:
        work = Path(tmp)
        spec: dict[str, Any] = {
            "work": str(work), "data": str(work / "data"), "scale": scale, "feat_dim": feat_dim,
            "fanouts": [10, 10], "batch_size": 1024, "hidden": 64, "epochs": epochs,
            "ip_config": str(work / "ip_config.txt"),
            "part_config": str(work / "dgl-parts" / f"{GRAPH_NAME}.json"),
        }  # fmt: skip
        graph = load_graph(spec)
        spec["classes"] = graph.num_classes
        print(f"R-MAT scale {scale}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, "
              f"{feat_dim} features, {int(graph.train_mask.sum()):,} training nodes; "
              f"{rounds} x {epochs} epochs each, 2 partitions, 2 trainers", flush=True)  # fmt: skip
        dgl_partition_s = partition_dgl(graph, spec)
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        load = [os.getloadavg()]
        os.environ["GNNPAR_SHM"] = "0"  # over gloo's TCP, like DGL's RPC (see the docstring)
        ours_runs, dgl_runs = [], []
        for _ in range(rounds):
            ours_argv = in_netns(self_argv("ours", spec_path))
            ours_runs.append(_run(ours_argv, "ours", work / "ours.json"))
            load.append(os.getloadavg())
            dgl_argv = in_netns(self_argv("dgl-cluster", spec_path))
            dgl_runs.append(_run(dgl_argv, "DistDGL", work / "dgl.json"))
            load.append(os.getloadavg())
        ours, dgl = _summary("ours", ours_runs), _summary("DistDGL 1.1.3", dgl_runs)
    result = {
        "graph": {
            "kind": "rmat",
            "scale": scale,
            "feat_dim": feat_dim,
            "nodes": graph.num_nodes,
            "edges": graph.num_edges,
        },
        "model": "GraphSAGE-mean, 2 layers, hidden 64, fan-outs 10,10, global batch 1024",
        "dgl_partition_seconds": dgl_partition_s,
        "rows": [ours, dgl],
        "time_ratio": ours["seconds"] / dgl["seconds"],
        "round_time_ratios": [
            statistics.median(e["seconds"] for e in _kept(o))
            / statistics.median(e["seconds"] for e in _kept(d))
            for o, d in zip(ours_runs, dgl_runs, strict=True)
        ],
        "lo_bytes_ratio": ours["lo_bytes"] / max(dgl["lo_bytes"], 1.0),
        "load_average": load,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    print(f"wrote {out}")
    return 0


def markdown(result: dict[str, Any]) -> str:
    """The result as a Markdown table with the ratios."""
    lines = ["| system | s / epoch (median) | steps | MB sent over lo / epoch | MB counted |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in result["rows"]:
        counted = f"{r['counted_bytes'] / 1e6:.2f}" if "counted_bytes" in r else "n/a"
        lines.append(f"| {r['system']} | {r['seconds']:.2f} | {r['steps']:.0f} | "
                     f"{r['lo_bytes'] / 1e6:.2f} | {counted} |")  # fmt: skip
    loads = ", ".join(f"{a[0]:.1f}" for a in result["load_average"])
    per_round = ", ".join(f"{x:.2f}x" for x in result["round_time_ratios"])
    lines.append(
        f"\nours / DistDGL: time {result['time_ratio']:.2f}x (per round {per_round}), "
        f"loopback bytes {result['lo_bytes_ratio']:.2f}x (each in its own network namespace); "
        f"load average {loads}; DGL's METIS partition took {result['dgl_partition_seconds']:.1f} s"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
