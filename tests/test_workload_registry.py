"""Adding a workload is one folder and one registration: a two-layer MLP on a graph's node
features, written by this test as a package of its own outside gnnpar and registered by an
entry point of the group ``gnnpar.train_specs`` (the way an installed distribution does),
trains through ``gnnpar train`` on two data ranks, resumes on one, and is listed in
``gnnpar train --help``; its planner (a cost model of its own) is ``gnnpar plan mlp`` — no
file of gnnpar touched."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from gnnpar.cli import main
from gnnpar.train.config import ConfigError
from gnnpar.train.spec import ENTRY_POINT_GROUP, TrainSpec, get, specs

#: The whole workload: its config, its task on the grid the trainer builds, its spec.
WORKLOAD = '''
"""A two-layer MLP on a graph's node features, data parallel (a workload outside gnnpar)."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar.plan.command import PlanCommand
from gnnpar.plan.memory import sharded_state
from gnnpar.shard import shard
from gnnpar.train.config import TrainerConfig, option, resolve
from gnnpar.train.loop import BaseTask, load_trainable
from gnnpar.train.spec import TrainSpec, given_grid


@dataclasses.dataclass
class MLPConfig(TrainerConfig):
    dataset: str = option("sbm", "dataset name or path")
    root: str | None = option(None, "dataset root folder")
    dataset_options: str | None = option(None, "dataset options as k=v,k=v")
    grid: str | None = option(None, "grid shape (data only)")
    epochs: int = option(6, "epochs")
    hidden: int = option(16, "hidden width")
    lr: float = option(0.05, "learning rate")

    def check(self) -> None:
        self.check_trainer()


class MLPTask(BaseTask):
    unit = "epoch"
    selection = ("val_acc", "max")

    def __init__(self, cfg, grid, plan, progress):
        self.cfg, self.grid, self.grid_choice = cfg, grid, plan.choice
        graph = load_trainable(cfg)
        self.x, self.y = graph.feat.float(), graph.label
        self.masks = {k: graph.ndata[f"{k}_mask"] for k in ("train", "val", "test")}
        torch.manual_seed(cfg.seed)
        plain = nn.Sequential(
            nn.Linear(self.x.shape[1], cfg.hidden), nn.ReLU(),
            nn.Linear(cfg.hidden, graph.num_classes),
        )
        self.model = shard(plain, grid, stage=0)
        self.num_steps = cfg.epochs

    def _make_optimizer(self):
        return torch.optim.Adam(self.model.parameters(), lr=self.cfg.lr)

    def train_step(self, step):
        # each data rank takes its half of the training nodes; the buckets average
        train = self.masks["train"].nonzero().flatten()
        mine = train[self.grid.rank("data") :: self.grid.size("data")]
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(self.x[mine]), self.y[mine])
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss.detach())}

    @torch.no_grad()
    def evaluate(self, step):
        pred = self.model(self.x).argmax(-1)
        return {
            f"{k}_acc": float((pred[m] == self.y[m]).float().mean())
            for k, m in self.masks.items()
        }

    def extra_state(self):
        return {}

    def load_extra_state(self, state):
        pass

    def describe(self):
        return {"task": "mlp", "hidden": self.cfg.hidden}


def plan_memory(args):
    """The MLP's parameters, gradients and Adam state per data rank (ZeRO-1), for 1 and
    ``--gpus`` data ranks: its cost model, on sbm's 32 features and 4 classes."""
    hidden = resolve(MLPConfig, args, None).hidden
    n = 32 * hidden + hidden + hidden * 4 + 4
    for d in (1, args.gpus):
        print(f"data={d}: {sum(sharded_state(n, 4, 1, d, n).values()):.0f} bytes")
    return 0


PLANNER = PlanCommand(
    help="the MLP's state per data rank",
    description="Bytes of the MLP's parameters, gradients and optimizer state per data rank.",
    options=("hidden",),
    run=plan_memory,
    add_arguments=lambda p: p.add_argument("--gpus", type=int, default=2),
)


SPEC = TrainSpec(
    name="mlp",
    help="a two-layer MLP on the node features (a workload registered from outside)",
    config=MLPConfig,
    task=MLPTask,
    plan=lambda cfg, world, progress: given_grid(cfg),
    axes=(),
    parallelize=shard,
    planner=PLANNER,
)
'''


@pytest.fixture
def registered(tmp_path, monkeypatch) -> Path:
    """The workload's folder and its entry point, on this process's path and on the path of
    the ranks it launches."""
    site = tmp_path / "site"
    (site / "mlp_workload").mkdir(parents=True)
    (site / "mlp_workload" / "__init__.py").write_text(textwrap.dedent(WORKLOAD))
    info = site / "mlp_workload-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mlp-workload\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nmlp = mlp_workload:SPEC\n")
    monkeypatch.syspath_prepend(str(site))
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    return site


def _ends(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") in ("end", "resume", "start")]


def test_a_registered_workload_trains_resumes_on_another_grid_and_is_listed(
    registered, one_process, tmp_path, capsys
):
    assert "mlp" in specs() and isinstance(get("mlp"), TrainSpec)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    listing = " ".join(capsys.readouterr().out.split())
    assert "mlp a two-layer MLP on the node features" in listing
    out = tmp_path / "run"
    flags = ["--out", str(out), "--root", str(tmp_path / "data"), "--quiet"]
    assert main(["train", "mlp", "--nprocs", "2", "--epochs", "4", *flags]) == 0
    assert main(["train", "mlp", "--epochs", "8", "--resume", *flags]) == 0
    events = _ends(out)
    assert [e["event"] for e in events] == ["start", "end", "resume", "end"]
    assert events[0]["grid"]["data"] == 2 and events[2]["from_grid"]["data"] == 2
    assert events[2]["step"] == 4
    assert events[-1]["test_acc"] > 0.4  # chance is 0.25: sbm's features carry the class
    # the config's own grid option goes through the registry's checks before launch
    with pytest.raises(ConfigError, match="a pipe axis needs the gpt task"):
        from gnnpar.train.loop import check_world

        check_world(get("mlp"), get("mlp").config(grid="pipe=2"), 2)


def test_a_name_registered_twice_is_one_error_naming_both(registered):
    (registered / "twice.py").write_text("from gnnpar.models.fullgraph.spec import SPEC as GCN\n")
    info = registered / "mlp_workload-0.1.dist-info" / "entry_points.txt"
    info.write_text(f"[{ENTRY_POINT_GROUP}]\ngcn = twice:GCN\n")
    with pytest.raises(ValueError, match="task 'gcn' is registered twice: by gnnpar and by entry"):
        specs()


def test_the_planner_asks_each_spec_for_its_costs(registered, capsys):
    """``gnnpar plan NAME`` is every spec's planner, a registered one's included: the MLP's
    own cost model, ZeRO-1 with Adam in float32 on D data ranks: 4n parameters, 4n + 4n/D
    gradients (the full buffer and the reduced chunk), 8n/D moments and a 4n/D master chunk
    (n = 32·8 + 8 + 8·4 + 4 = 300 at hidden 8)."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    listing = " ".join(capsys.readouterr().out.split())
    assert "mlp the MLP's state per data rank" in listing
    commands = set(listing.split("{", 1)[1].split("}", 1)[0].split(","))
    assert commands == {n for n, s in specs().items() if s.planner is not None} | {"machines"}
    assert main(["plan", "mlp", "--hidden", "8", "--gpus", "2"]) == 0
    n = 300
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"data=1: {8 * n + 16 * n} bytes", f"data=2: {8 * n + 16 * n // 2} bytes"]
