"""The planner on hand-computed cases: bytes per axis of a 2-layer GCN and of a GPT's 2-layer
MLP on a few shapes, intra- versus inter-node placement and its price, the bandwidth-table
fit, ranking and memory limits, the command line and its one-line errors. Every expected
number below is worked out by hand from the ring costs (AR 2(p-1)/p·V, AG/RS (p-1)/p·V)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gnnpar.cli import main
from gnnpar.fmt import format_count
from gnnpar.grid import factorizations
from gnnpar.models.fullgraph.cost import GCNProblem, gcn_collectives
from gnnpar.models.fullgraph.planning import choose_fullgraph_grid, rank_gcn
from gnnpar.models.gpt.cost import GPTProblem, gpt_collectives
from gnnpar.models.gpt.planning import rank_gpt, rank_gpt_stages
from gnnpar.plan import Link, Machine, PlanError, get_machine, load_bandwidth_table
from gnnpar.plan.comm_model import bytes_by_axis, comm_seconds, intra_node_axes
from gnnpar.plan.compute import measure_local_rates
from gnnpar.plan.inputs import parse_count
from gnnpar.plan.rank import shape_label
from tests.byte_formulas import plexus_bytes

# 12 nodes, widths 6 -> 4 -> 2, float32, biases: small enough to follow by hand
GCN = GCNProblem.from_widths(12, 40, [6, 4, 2], element_size=4)


def _shape(**kw):
    return {"data": 1, "x": 1, "y": 1, "z": 1, **kw}


def test_gcn_bytes_x2_by_hand():
    # layer 0 (outer x): AGG is 12 rows x 6 features, all-reduced over x forward: 288 B;
    # its gradient only serves the input's, which raw features do not need, so no dAGG
    # backward. layer 1 (inner x): OUT is 12 x 2, all-reduced over x: 96 B.
    assert bytes_by_axis(gcn_collectives(GCN, _shape(x=2))) == {"x": 288 + 96}
    # asked for the input's gradient, dAGG is all-reduced too (288 B); dH goes over z (1 rank)
    wanted = dataclasses.replace(GCN, input_grad=True)
    assert bytes_by_axis(gcn_collectives(wanted, _shape(x=2))) == {"x": 2 * 288 + 96}


def test_gcn_bytes_z2_by_hand():
    # layer 0 (depth z): gather H (2 pieces of 6x6 floats = 288 B) 144; gather W (24
    # floats in 2 pieces: 96 B) 48 forward, 48 backward, dW reduce-scatter 48; bias (4
    # floats) all-reduce 16. layer 1 (outer z): AGG 12x4 floats = 192 B, all-reduced
    # forward and backward 2 * 192. loss over classes (z): three all-reduces of 12 floats
    # (48 B each).
    z = 144 + 48 + 48 + 48 + 16 + 2 * 192 + 3 * 48
    assert bytes_by_axis(gcn_collectives(GCN, _shape(z=2))) == {"z": z}
    assert bytes_by_axis(gcn_collectives(GCN, _shape(z=2), loss=False)) == {"z": z - 144}


def test_gcn_bytes_y2_by_hand():
    # layer 0 (inner y): OUT 12x4 floats all-reduced: 192. layer 1 (depth y): W is 4x2 = 8
    # floats in 2 pieces of 4 (32 B): gather 16 forward + 16 backward, dW 16; dH all-reduce
    # 12x4 floats: 192; bias 2 floats: 8. loss over rows (y): one float (4) and the float64
    # mask count (8).
    y = 192 + 16 + 16 + 16 + 192 + 8 + 4 + 8
    assert bytes_by_axis(gcn_collectives(GCN, _shape(y=2))) == {"y": y}


def test_gcn_rejects_a_data_axis():
    with pytest.raises(PlanError, match="no batch to split over data=2"):
        gcn_collectives(GCN, _shape(data=2))


# GPT with one block: hidden 8 (MLP 8 -> 32 -> 8), 12 tokens per rank, float32
GPT = GPTProblem.sized(layers=1, hidden=8, heads=2, seq=3, batch=4, vocab=10, element_size=4)


def _mlp_bytes(shape):
    colls = [c for c in gpt_collectives(GPT, shape) if c.what.startswith("blocks.0.mlp")]
    return bytes_by_axis(colls)


def test_mlp_bytes_megatron_on_x2_and_y2():
    # 1D: one all-reduce of the 12 x 8 floats (384 B) forward and one backward
    assert _mlp_bytes(_shape(x=2)) == {"x": 384 + 384}
    assert _mlp_bytes(_shape(y=2)) == {"y": 384 + 384}


def test_mlp_bytes_z2_gathers_weights():
    # each 32x8 weight (256 floats) split over z in 2 pieces: gather 1024 B -> 512 forward,
    # reduce-scatter 512 backward; two layers
    assert _mlp_bytes(_shape(z=2)) == {"z": 2 * (512 + 512)}


def test_mlp_bytes_data2_is_silent_until_the_gradient_sync():
    assert _mlp_bytes(_shape(data=2)) == {}
    sync = [c for c in gpt_collectives(GPT, _shape(data=2)) if c.what.startswith("gradient")]
    assert [c.axis for c in sync] == ["data"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpt_memory_by_hand_on_data2_z2(stage):
    """Per-rank bytes of a 2-layer GPT (h 16, vocabulary 32, 8 positions, tied head) on
    data=2, z=2, float32, written out: matrices M = V·h + T·h + L·(3h² + h² + 4h² + 4h²)
    = 512 + 128 + 6144 = 6784, each rank stores M/z = 3392 of them; biases 9h per layer
    (288) and the norms' 2h·(2L + 1) = 160 stay whole over z: n = 3840 elements."""
    from gnnpar.models.gpt.memory import gpt_memory
    from gnnpar.models.gpt.model import GPTConfig

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    got = gpt_memory(GPTProblem(cfg, batch=4, element_size=4, stage=stage),
                     {"data": 2, "x": 1, "y": 1, "z": 2})  # fmt: skip
    n, matrix, d, e = 3840, 3392, 2, 4
    want = {
        0: {"parameters": n * e, "gradients": n * e, "optimizer": 8 * n},
        # stage 1: full gradient buffers + the reduced float32 chunk; the float32 master
        # chunk beside the moments
        1: {"parameters": n * e, "gradients": n * e + 4 * n / d, "optimizer": (8 + 4) * n / d},
        2: {"parameters": n * e, "gradients": 4 * n / d, "optimizer": (8 + 4) * n / d},
        # stage 3: the parameter chunk plus two gathered blocks ((n - 448) / L matrices
        # each: running and prefetched), one block's full gradient before its reduce-scatter
        3: {"parameters": n * e / d + 2 * (n - 448) / 2 * e,
            "gradients": n * e / d + (n - 448) / 2 * e, "optimizer": 8 * n / d},
    }[stage]  # fmt: skip
    want["gathered"] = matrix * 2 * e  # every z-gathered block, held forward to backward
    assert {k: got[k] for k in want} == want


def test_intra_and_inter_node_placement_by_hand():
    # 2x2x2 on nodes of 4 ranks: x (stride 1) and y (stride 2) groups stay inside a node;
    # z (stride 4, size 2) crosses nodes
    p = intra_node_axes(_shape(x=2, y=2, z=2), 4)
    assert (p["x"], p["y"], p["z"], p["xy"], p["tensor"]) == (True, True, False, True, False)
    assert all(intra_node_axes(_shape(x=2, y=2, z=2), 8).values())
    # data (stride 4) over two nodes of 4
    assert not intra_node_axes(_shape(x=4, data=2), 4)["data"]
    # x=3 on nodes of 4: the group {3, 4, 5} straddles two nodes
    assert not intra_node_axes(_shape(x=3, y=2), 4)["x"]


def _toy_machine() -> Machine:
    return Machine(
        "toy",
        "",
        devices_per_node=4,
        memory_gb=1.0,
        intra=Link(gbps=100.0, latency_us=1.0),
        inter=Link(gbps=10.0, latency_us=10.0),
        peak_tflops=1.0,
        gemm_tflops=1.0,
        spmm_gflops=1.0,
        mem_gbps=1.0,
    )


def test_collective_seconds_follow_placement():
    m = _toy_machine()
    # all-reduce over 4 ranks: 6 ring steps; 1e9 ring bytes
    assert m.collective_seconds("all_reduce", 4, 1e9, True) == pytest.approx(6e-6 + 1e-2)
    assert m.collective_seconds("all_gather", 4, 1e9, False) == pytest.approx(3e-5 + 1e-1)
    assert m.collective_seconds("all_gather", 1, 1e9, False) == 0.0
    # the z axis of 2x2x2 is inter-node on this 4-GPU machine: 10x slower than x
    colls = gcn_collectives(GCN, _shape(x=2, y=2, z=2))
    secs = comm_seconds(colls, _shape(x=2, y=2, z=2), m)
    b = bytes_by_axis(colls)
    per_byte = {a: (secs[a] / b[a]) for a in b}
    assert per_byte["z"] > 5 * per_byte["x"]


def test_bandwidth_table_fit(tmp_path):
    # t = 1 ms + bytes / 2 GB/s, measured at two sizes, for all-reduce over 2 ranks (ring
    # bytes = the buffer)
    entries = []
    for nbytes in (1e6, 1e7):
        t = 1e-3 + nbytes / 2e9
        entries.append(
            {
                "axis": "x",
                "group_size": 2,
                "intra_node": True,
                "kind": "all_reduce",
                "bytes": nbytes,
                "seconds": t,
                "busbw_gbps": nbytes / t / 1e9,
            }
        )
    path = tmp_path / "bw.json"
    path.write_text(json.dumps({"schema": 1, "entries": entries}))
    (fit,) = load_bandwidth_table(path)
    assert fit.alpha_s == pytest.approx(1e-3) and fit.sec_per_byte == pytest.approx(0.5e-9)
    m = get_machine(str(path))
    assert m.name == "cpu+measured"
    assert m.collective_seconds("all_reduce", 2, 4e9, True) == pytest.approx(1e-3 + 2.0)
    # inter-node groups were not measured: the machine's defaults price them
    assert m.collective_seconds("all_reduce", 2, 1e9, False) == pytest.approx(
        m.inter.latency_us * 2e-6 + 1e9 / (m.inter.gbps * 1e9)
    )
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="is not JSON"):
        load_bandwidth_table(bad)
    bad.write_text(json.dumps({"schema": 1, "entries": [{"axis": "x"}]}))
    with pytest.raises(PlanError, match="entry 0 lacks group_size"):
        load_bandwidth_table(bad)


def test_ranking_orders_by_time_and_drops_what_does_not_fit():
    problem = GCNProblem.from_edges(2_449_029, 61_859_140, features=100, classes=47)
    cands = rank_gcn(problem, 64, get_machine("perlmutter"))
    assert len(cands) == 28 and all(c.shape["data"] == 1 for c in cands)
    times = [c.step_seconds for c in cands if c.fits]
    assert times == sorted(times)
    small = rank_gcn(problem, 8, _toy_machine())  # 1 GB per device: nothing fits
    assert not any(c.fits for c in small) and "needs" in small[0].reason
    gpt = rank_gpt(
        GPTProblem.sized(layers=2, hidden=64, heads=8, seq=16, batch=8), 16, get_machine("a100x4")
    )
    bad = [c for c in gpt if not c.fits]
    assert any("n_head=8 does not divide" in c.reason for c in bad)  # 8 heads over 16
    assert any("does not divide over data*z" in c.reason for c in bad)


@pytest.mark.parametrize(
    "world, nodes, dims, ops, want",
    [
        (8, 1000, [64, 64, 8], 1, {"x": 4, "y": 2, "z": 1}),
        (8, 50, [256, 256, 256], 1, {"x": 8, "y": 1, "z": 1}),
        (8, 1000, [64, 64, 8], 2, {"x": 2, "y": 4, "z": 1}),
        (4, 999, [7, 5, 3], 2, {"x": 1, "y": 4, "z": 1}),
        (6, 10000, [16, 16, 4], 1, {"x": 3, "y": 2, "z": 1}),
    ],
)
def test_choose_fullgraph_grid_takes_the_fewest_bytes(world, nodes, dims, ops, want):
    """Without a machine: the fewest bytes per epoch on rank 0 (the 3D formulas of
    tests/byte_formulas.py, float32, raw features needing no gradient), ties to the shape whose
    busiest axis moves least, then to x before y.

    x is the first layer's outer axis, whose aggregate is all-reduced forward only (its
    gradient would serve only the raw features', which need none), so shapes with a large x
    move less than they did while dAGG was counted: the first case's x4 y2 moves 344,800 B
    against 367,056 for x2 y2 z2 (then 536,800 against 431,056, and x2 y2 z2 won), the
    second's x8 179,200 B against 201,728 for x4 y2 (then the pick), the last's x3 y2
    1,013,493 B against 1,146,963 for x2 y3 (then the pick). The GraphSAGE cases keep
    theirs: their aggregates are two operators wide, and x2 y4 still moves less than x4 y2
    (524,656 B against 537,568)."""

    def key(s):
        f, b = plexus_bytes(s, {"x": 0, "y": 0, "z": 0}, nodes, dims, ops, 4, False, True)
        axis = [sum(f.bytes[a].values()) + sum(b.bytes[a].values()) for a in "xyz"]
        return (sum(axis), max(axis), -s["x"], -s["y"])

    shapes = [dict(zip("xyz", f, strict=True)) for f in factorizations(world, 3)]
    assert min(shapes, key=key) == want  # the formulas' choice, worked out here
    assert choose_fullgraph_grid(world, nodes, dims, ops) == want


def test_choose_fullgraph_grid_with_a_machine_takes_the_fastest_that_fits():
    problem = GCNProblem.from_widths(1000, 20_000, [64, 64, 8], model="gcn", element_size=4)
    machine = _toy_machine()
    fastest = next(c for c in rank_gcn(problem, 8, machine) if c.fits)
    shape = choose_fullgraph_grid(8, 1000, [64, 64, 8], nnz=20_000, machine=machine)
    assert shape == {a: fastest.shape[a] for a in ("x", "y", "z")}
    with pytest.raises(PlanError, match="no grid shape can run this graph"):
        choose_fullgraph_grid(8, 10**9, [4096, 4096, 8], nnz=10**10, machine=machine)


def test_local_rates_are_measured():
    rates = measure_local_rates(seconds=0.01, size=32)
    assert set(rates) == {"gemm_tflops", "spmm_gflops", "mem_gbps"}
    assert all(v > 0 for v in rates.values()), rates


def test_problem_errors_are_clear():
    with pytest.raises(PlanError, match="nodes must be a positive integer"):
        GCNProblem.from_edges(0, 10, features=3, classes=2)
    with pytest.raises(PlanError, match="hidden 10 is not a multiple of heads 4"):
        GPTProblem.sized(layers=1, hidden=10, heads=4)
    with pytest.raises(PlanError, match="unknown machine 'nope'; built-in machines: cpu"):
        get_machine("nope")
    assert GPTProblem.sized(layers=44, hidden=6144, heads=64).num_params == pytest.approx(
        20.2e9, 0.01
    )


def test_cli_plan_tables_plot_and_json(tmp_path, capsys):
    out_json, png = tmp_path / "p.json", tmp_path / "p.png"
    argv = "plan gcn --dataset ogbn-products --gpus 64 --machine perlmutter --top 3".split()
    rc = main([*argv, "--plot", str(png), "--json", str(out_json)])
    assert rc == 0 and png.stat().st_size > 1000
    text = capsys.readouterr().out
    assert "ogbn-products" in text and "\n1 " in text and "\n3 " in text and "\n4 " not in text
    doc = json.loads(out_json.read_text())
    assert doc["candidates"][0]["fits"] and doc["candidates"][0]["shape"]["data"] == 1
    argv = "plan gpt --n-layer 2 --n-embd 64 --n-head 8 --block-size 16 --batch-size 8 --gpus 8"
    argv += " --machine h100x8"
    rc = main(argv.split())
    assert rc == 0 and "GPT 232k (2 layers" in capsys.readouterr().out
    assert main(["plan", "machines"]) == 0 and "frontier" in capsys.readouterr().out


def test_plan_plot_draws_the_top_shapes_with_labelled_axes():
    pytest.importorskip("matplotlib")
    from gnnpar.plan.plot import plan_figure

    problem = GCNProblem.from_edges(2_449_029, 61_859_140, features=100, classes=47)
    cands = rank_gcn(problem, 64, get_machine("perlmutter"))
    (ax,) = plan_figure(cands, "products", top=3).axes
    best = [shape_label(c.shape) for c in cands if c.fits][:3]
    assert [t.get_text() for t in ax.get_xticklabels()] == best
    assert len(ax.patches) == 2 * 3  # compute and communication per shape
    assert ax.get_xlabel().startswith("grid shape") and ax.get_ylabel().endswith("(ms)")
    (every,) = plan_figure(cands, "products").axes  # no top: every shape that fits, to 40
    assert len(every.get_xticklabels()) == min(40, sum(c.fits for c in cands))
    with pytest.raises(PlanError, match="at least 1"):
        plan_figure(cands, "products", top=0)


def test_plan_plot_names_the_zero_stage_where_shapes_differ_in_it():
    pytest.importorskip("matplotlib")
    from gnnpar.plan.plot import plan_figure

    problem = GPTProblem.sized(layers=2, hidden=64, heads=8, seq=16, batch=8)
    cands = rank_gpt_stages(problem, 8, get_machine("h100x8"), (0, 1))
    (ax,) = plan_figure(cands, "small", top=4).axes
    labels = [t.get_text() for t in ax.get_xticklabels()]
    # Without the stage, one shape at two stages would read as the same bar twice.
    assert len(labels) == len(set(labels)) == 4 and all(" Z" in s for s in labels), labels
    assert "ZeRO stage" in ax.get_xlabel() and ax.get_ylabel() == "predicted step time (ms)"


@pytest.mark.parametrize(
    "n, text",
    [(640, "640"), (85_000, "85k"), (10_612_000, "10.6M"), (999_950, "1M"), (125e6, "125M"),
     (1_315_000_000, "1.31B"), (1.3e9, "1.3B"), (20_260_000_000, "20.3B"), (3.3e12, "3.3T")],
)  # fmt: skip
def test_format_count_has_3_significant_digits_and_a_unit(n, text):
    assert format_count(n) == text
    assert parse_count(text) == pytest.approx(n, rel=5e-3)


@pytest.mark.parametrize(
    "argv, message",
    [
        ("plan gcn --nodes 10 --gpus 8", "give --dataset NAME, or --edges, --features"),
        ("plan gcn --dataset sbm --nodes 10 --gpus 8", "either --dataset or --nodes"),
        ("plan gcn --hidden 0 --gpus 8", "config key 'hidden' must be positive"),
        ("plan gpt --params 21q --gpus 8", "cannot read '21q' as a count"),
        ("plan gpt --params 5B --gpus 8", "no GPT shape of about 5B"),
        ("plan gpt --params 20B --gpus 0", "must be positive"),
        ("plan gcn --dataset ogbn-arxiv --gpus 4 --machine x", "unknown machine 'x'"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys):
    assert main(argv.split()) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def _planned_world(text: str) -> dict:
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.train.spec import build_task

    cfg = GPTTaskConfig(
        data=text, vocab_size=300, n_layer=2, n_embd=16, n_head=2, block_size=8, batch_size=8,
        sample_tokens=0, steps=1,
    )  # fmt: skip
    task = build_task("gpt", cfg)  # no grid, no zero_stage: the planner's
    return {"shape": task.grid.shape, "stage": task.stage, "vocab": task.corpus.vocab_size}


def test_train_gpt_without_a_grid_runs_what_plan_recommends(tmp_path, capsys, monkeypatch):
    """The trainer's pick equals the top row of ``gnnpar plan gpt`` for the same model and
    machine (shape and ZeRO stage)."""
    from gnnpar.testing import run_distributed

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 200)
    got = run_distributed(_planned_world, 4, str(text), timeout=300)[0]
    out = tmp_path / "plan.json"
    argv = (
        f"plan gpt --n-layer 2 --n-embd 16 --n-head 2 --block-size 8 --batch-size 8 "
        f"--vocab-size {got['vocab']} --gpus 4 --machine cpu --json {out}"
    )
    assert main(argv.split()) == 0
    best = json.loads(out.read_text())["candidates"][0]
    assert best["shape"] == {a: got["shape"][a] for a in best["shape"]}
    assert best["stage"] == got["stage"]


def _planned_fullgraph(folder: str, algorithm: str) -> dict:
    from gnnpar.models.fullgraph.task import FullGraphConfig
    from gnnpar.train.spec import build_task

    cfg = FullGraphConfig(
        dataset_options="num_nodes=300", out=folder, algorithm=algorithm, epochs=1
    )  # no grid: the planner's, with every other option at the trainer's default
    return dict(build_task("gcn", cfg).grid.shape)


def test_train_gcn_without_a_grid_runs_what_plan_recommends(tmp_path, capsys, monkeypatch):
    """``gnnpar plan gcn`` with the trainer's defaults (the same flags, nothing else) ranks
    first the shape ``gnnpar train gcn`` runs on this machine; 2D and 1D get their own."""
    from gnnpar.testing import run_distributed

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    got = run_distributed(_planned_fullgraph, 4, str(tmp_path / "run"), "3d", timeout=300)[0]
    out = tmp_path / "plan.json"
    argv = f"plan gcn --dataset-options num_nodes=300 --gpus 4 --machine cpu --json {out}"
    assert main(argv.split()) == 0
    best = json.loads(out.read_text())["candidates"][0]["shape"]
    assert {a: best[a] for a in ("x", "y", "z")} == {a: got.get(a, 1) for a in ("x", "y", "z")}
    assert choose_fullgraph_grid(6, 300, [8, 4], algorithm="2d") == {"x": 2, "y": 3}
    assert choose_fullgraph_grid(6, 300, [8, 4], algorithm="1d") == {"x": 6}


def test_gcn_memory_host_parts():
    """The host parts of a CPU rank: on one rank a 3-layer GCN maps Â in two orders (layers
    0 and 2 share Â₁), 12 bytes an entry and 8 a row, and all features, and no all-reduce
    buffer; on z=2 the depth all-reduce of layer 0's input gradient adds a buffer."""
    from gnnpar.models.fullgraph.cost import GCNProblem
    from gnnpar.models.fullgraph.memory import gcn_memory

    n, nnz, feats = 1000, 9000, 32
    problem = GCNProblem.from_widths(n, nnz, [feats, 16, 16, 4])
    one = {"x": 1, "y": 1, "z": 1}
    plain = gcn_memory(problem, one)
    host = gcn_memory(problem, one, host=True)
    assert "staging" not in plain and "buffers" not in plain
    assert host.pop("staging") == 2 * (nnz * 12 + n * 8) + n * feats * 4
    assert host.pop("buffers") == 0
    assert host == plain
    # z=2: layer 0's input gradient (all 1000 columns x 32 features) is all-reduced over
    # its depth axis z; layer 1's Â·H gradient (1000 x 16) over its outer axis z is smaller
    two = gcn_memory(problem, {"x": 1, "y": 1, "z": 2}, host=True)
    assert two["buffers"] == 1000 * 32 * 4  # below 256 KiB: gloo's copy
    # 4000 nodes: layer 0's all-gather of H (4000 x 32 floats, 512,000 bytes) goes through
    # the same-host transport, a segment of two slots of one rank's half (256,000 bytes,
    # a multiple of 64); layer 1's Â·H all-reduce (4000 x 16 floats, 256,000 bytes, under
    # the 256 KiB threshold) stays on gloo, which stages a copy of it
    big = GCNProblem.from_widths(4000, 36000, [feats, 16, 16, 4])
    buffers = gcn_memory(big, {"x": 1, "y": 1, "z": 2}, host=True)["buffers"]
    assert buffers == 2 * 256_000 + 256_000


# ------------------------------------------------------------------ mini-batch memory
def _mb_problem(**kw):
    from gnnpar.models.minibatch.cost import MiniBatchProblem

    args = dict(nodes=1000, edges=8000, features=16, classes=4, hidden=8, layers=2,
                fanouts=(3, 2), batch_size=20, train_nodes=600, feature_cache=5)  # fmt: skip
    return MiniBatchProblem(**{**args, **kw})


def test_minibatch_memory_parts_by_hand():
    """Every part of a data rank's bytes from the formulas, written out here: two data
    ranks, a given part (500 owned, 100 halo nodes, 4,000 in-edges), every node of degree 8
    (no histogram), 10 seeds per rank and batch (20 over two ranks), fan-outs 3 then 2."""
    import math

    from gnnpar.models.minibatch.cost import (
        HEAP_RETAINED,
        RUNTIME_BYTES,
        expected_blocks,
        minibatch_memory,
    )

    p = _mb_problem()
    part = {"num_owned": 500, "num_halo": 100, "num_local_edges": 4000}
    got = minibatch_memory(p, 2, part)
    assert got["graph"] == 601 * 8 + 4000 * 8 + 2 * 600 * 8
    assert got["features"] == (500 + 5) * 16 * 4
    assert got["node_data"] == 500 * 11
    assert got["sampler"] == 1000 * 8 + (3 * 300 + 600) * 8
    # hop 0: the 10 seeds, 3 draws each; hop 1: every node with probability
    # 1 - (1 - 10/1000)·exp(-drawn·8/8000) in the frontier, 2 draws each
    miss = 1 - 10 / 1000
    src0 = 1000 * (1 - miss * math.exp(-30 * 8 / 8000))
    m1 = src0 * 2
    src1 = 1000 * (1 - miss * math.exp(-(30 + m1) * 8 / 8000))
    want = [(10, src0, 30), (src0, src1, m1)]
    for a, b in zip(expected_blocks(p, 10), want, strict=True):
        assert a == pytest.approx(b)
    batch = (src0 + 10 + 1 + src1 + src0 + 1) * 8 + 2 * (30 + m1) * 8 + src1 * 16 * 4 + 10 * 8
    assert got["batches"] == pytest.approx(3 * batch)  # prefetch 1: 3 batches alive
    assert got["buffers"] == pytest.approx(2 * src1 / 2 * (16 * 4 + 8))
    params = (16 * 8 * 2 + 8) + (8 * 4 * 2 + 4)
    assert got["weights"] == 4 * params * 4  # stage 0: parameters, gradients, two moments
    assert got["staging"] == 0
    assert got["runtime"] == RUNTIME_BYTES
    # glibc keeps HEAP_RETAINED times the step's blocks resident (all under the ceiling)
    step = got["batches"] + got["activations"] + got["buffers"]
    assert got["heap"] == pytest.approx(HEAP_RETAINED * step)
    # one rank: the mapped graph folder (CSR, features, labels and masks) and the kept
    # full-neighbour evaluation block
    one = minibatch_memory(p, 1)
    assert one["staging"] == 1001 * 8 + 8000 * 8 + 1000 * 16 * 4 + 1000 * 11
    assert one["graph"] == 2001 * 8 + 2 * 8000 * 8
    assert one["features"] == one["node_data"] == one["buffers"] == 0
    host_only = {"staging", "kernels", "runtime", "heap"}
    assert not host_only & set(minibatch_memory(p, 1, host=False))


def test_minibatch_heap_leaves_out_mapped_blocks():
    """Blocks of glibc's mmap ceiling or more are mapped and returned, not retained: with
    2,048 features (8 KiB a row) a batch's 13,000 input rows are 103 MiB; they leave the
    heap part in the three batches alive, the first layer's dropout output and backward's
    copy of it (the one-byte dropout mask, 26 MiB, stays), and nothing else does."""
    from gnnpar.models.minibatch.cost import (
        HEAP_CEILING,
        HEAP_RETAINED,
        expected_blocks,
        minibatch_memory,
    )

    wide = _mb_problem(nodes=20000, edges=400000, features=2048, batch_size=2000,
                       train_nodes=20000, feature_cache=0)  # fmt: skip
    got = minibatch_memory(wide, 1)
    inputs = expected_blocks(wide, 2000)[-1][1] * 2048 * 4
    assert inputs >= HEAP_CEILING > inputs / 4  # the mask is under the ceiling
    step = got["batches"] + got["activations"]
    assert got["heap"] == pytest.approx(HEAP_RETAINED * (step - 5 * inputs))


def test_minibatch_expected_blocks_match_the_sampler():
    """The expected sources and edges of each hop, from the degree histogram, within 10%
    of the mean over batches that the neighbour sampler really draws."""
    import torch

    from gnnpar.graph import Graph
    from gnnpar.models.minibatch.cost import degree_histogram, expected_blocks
    from gnnpar.sampling import NeighborSampler

    gen = torch.Generator().manual_seed(0)
    n = 3000
    deg = torch.randint(0, 30, (n,), generator=gen)
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(deg, 0)
    indices = torch.randint(0, n, (int(indptr[-1]),), generator=gen)
    g = Graph(indptr, indices, n)
    p = _mb_problem(nodes=n, edges=int(indptr[-1]), batch_size=64, train_nodes=n,
                    fanouts=(5, 5), degrees=degree_histogram(indptr))  # fmt: skip
    sampler = NeighborSampler(g, [5, 5])
    runs = [sampler.sample(torch.randperm(n, generator=gen)[:64], key=k) for k in range(20)]
    src = [sum(b.blocks[-1 - h].num_src for b in runs) / 20 for h in range(2)]
    edges = [sum(b.blocks[-1 - h].num_edges for b in runs) / 20 for h in range(2)]
    for h, (_, s, m) in enumerate(expected_blocks(p, 64)):
        assert s == pytest.approx(src[h], rel=0.1)
        assert m == pytest.approx(edges[h], rel=0.1)


def test_minibatch_memory_monotone():
    """More data ranks at ZeRO-3 hold fewer weight bytes; a bigger batch more batch and
    activation bytes; the estimated part shrinks with the data size."""
    from gnnpar.models.minibatch.cost import estimated_part, minibatch_memory

    part = {"num_owned": 500, "num_halo": 100, "num_local_edges": 4000}
    big = _mb_problem(hidden=256, stage=3)
    w = [minibatch_memory(big, d, part)["weights"] for d in (2, 4, 8)]
    assert w[0] > w[1] > w[2]
    small, large = (minibatch_memory(_mb_problem(batch_size=b), 2, part) for b in (20, 200))
    for key in ("batches", "activations", "buffers"):
        assert large[key] > small[key]
    est = [estimated_part(_mb_problem(), d) for d in (2, 4)]
    assert est[0]["num_owned"] > est[1]["num_owned"]
    assert est[0]["num_local_edges"] > est[1]["num_local_edges"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda mm, P: mm(P(), 0), "data must be a positive integer, got 0"),
        (lambda mm, P: mm(P(), 2, {"num_owned": 5}), "part lacks num_halo, num_local_edges"),
        (lambda mm, P: P(fanouts=(3,)), "fanouts [3] give 1 fan-outs for 2 layers"),
        (lambda mm, P: P(degrees=((8, 999),)), "the degree histogram counts 999 nodes"),
        (lambda mm, P: P(train_nodes=0), "train_nodes must be in 1..1000, got 0"),
    ],
)
def test_minibatch_memory_errors(call, message):
    from gnnpar.models.minibatch.cost import minibatch_memory

    with pytest.raises(PlanError) as err:
        call(minibatch_memory, _mb_problem)
    assert message in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------- typed R-GCN mini-batch
def _mag(**kw):
    from gnnpar.data.mag import mag_synth

    sizes = dict(num_papers=600, num_authors=400, num_institutions=12, num_fields=30, seed=1)
    return mag_synth(**{**sizes, **kw})


@pytest.mark.parametrize("bases", [None, 2])
def test_typed_parameters_are_the_model_s(bases):
    """The typed R-GCN's parameter count and largest ZeRO-3 unit, written out (per featured
    type a projection F_t x H + H, per featureless type an embedding N_t x H; per layer R
    weights H x H (or B bases and R x B coefficients), the root H x H and a bias; the
    classifier), equal the model the task builds."""
    from gnnpar.models.hetero import TypedGNN
    from gnnpar.models.minibatch.typed_cost import typed_parameters, typed_sizes

    g = _mag()
    sizes = typed_sizes(g, "4,3", bases)
    h, c, layers, r = 16, g.num_classes, 2, len(g.types.relations)
    nodes = [sizes.type_nodes[t] for t in range(len(sizes.type_nodes))]
    feats = list(g.types.feat_dims)
    inputs = sum(f * h + h if f else n * h for n, f in zip(nodes, feats, strict=True))
    layer = (r * h * h if bases is None else bases * h * h + r * bases) + h * h + h
    want = inputs + layers * layer + h * c + c
    model = TypedGNN(g.types, h, c, layers, "rgcn", 0.0, 1, num_bases=bases)
    assert typed_parameters(sizes, h, c, layers) == (want, max(inputs, layer, h * c + c))
    assert sum(p.numel() for p in model.parameters()) == want


def test_typed_expected_blocks_match_the_sampler():
    """Per hop, the expected sources and edges of a typed batch (per relation fan-outs,
    destinations spread over their type) within 15% of the mean the typed neighbour sampler
    draws."""
    import torch

    from gnnpar.models.minibatch.typed_cost import expected_typed_blocks, typed_sizes
    from gnnpar.sampling import NeighborSampler

    g = _mag()
    sizes = typed_sizes(g, "4,3", None)
    papers = torch.nonzero(g.ndata["train_mask"]).reshape(-1)
    sampler = NeighborSampler(g, "4,3")
    gen = torch.Generator().manual_seed(0)
    runs = [sampler.sample(papers[torch.randperm(len(papers), generator=gen)[:64]], key=k)
            for k in range(20)]  # fmt: skip
    for h, (_, src, edges) in enumerate(expected_typed_blocks(sizes, 64)):
        got_src = sum(b.blocks[-1 - h].num_src for b in runs) / 20
        got_edges = sum(b.blocks[-1 - h].num_edges for b in runs) / 20
        assert sum(src) == pytest.approx(got_src, rel=0.15), h
        assert sum(edges) == pytest.approx(got_edges, rel=0.15), h


def test_cli_plan_sage_prices_rgcn_on_a_typed_graph(capsys):
    """``gnnpar plan sage --model rgcn`` on a typed graph is ``minibatch_memory`` of the
    problem with its typed sizes (the embedding tables of the featureless types among the
    weights); HGT is refused in one line."""
    from gnnpar.models.minibatch.cost import minibatch_memory
    from gnnpar.models.minibatch.task import MiniBatchConfig, plan_problem
    from gnnpar.train.loop import load_dataset

    opts = "num_papers=600,num_authors=400,num_institutions=12,num_fields=30,seed=1"
    flags = ["--dataset", "mag-synth", "--dataset-options", opts, "--fanouts", "4,3",
             "--batch-size", "64", "--model", "rgcn"]  # fmt: skip
    assert main(["plan", "sage", *flags, "--gpus", "2"]) == 0
    text = capsys.readouterr().out
    cfg = MiniBatchConfig(dataset="mag-synth", dataset_options=opts, fanouts="4,3",
                          batch_size=64, model="rgcn")  # fmt: skip
    problem = plan_problem(cfg, load_dataset(cfg))
    assert problem.typed is not None and "rgcn (7 relations) on mag-synth" in text
    for d in (1, 2):
        mib = sum(minibatch_memory(problem, d).values()) / (1 << 20)
        assert f"{mib:,.0f}" in text
    untyped = minibatch_memory(dataclasses.replace(problem, typed=None), 1)
    typed = minibatch_memory(problem, 1)
    assert typed["weights"] > untyped["weights"]  # 400 authors' and 42 others' embeddings
    assert main(["plan", "sage", *flags[:-1], "hgt", "--gpus", "2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "not model hgt" in err[0], err


# ---------------------------------------------------------------- gnnpar plan sage
def test_cli_plan_sage_prints_the_memory_model_per_data_rank(tmp_path, capsys):
    """``gnnpar plan sage`` is ``minibatch_memory`` of the run the same flags train: for 1, 2,
    4, ... up to --gpus ranks on estimated parts, and for each part of a partition folder
    (its own records); a model or sampler it does not describe, a partition of another graph
    and a --gpus that contradicts the folder are one-line errors."""
    from gnnpar.data import sbm
    from gnnpar.models.minibatch.cost import (
        MiniBatchProblem,
        degree_histogram,
        estimated_part,
        minibatch_memory,
    )
    from partitioners import load_meta
    from partitioners.cli import main as partition_main

    root = str(tmp_path / "data")
    flags = ["--dataset", "sbm", "--dataset-options", "num_nodes=300,feat_dim=8,seed=3",
             "--root", root, "--batch-size", "64", "--fanouts", "4,3"]  # fmt: skip
    out = tmp_path / "plan.json"
    assert main(["plan", "sage", *flags, "--gpus", "6", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    # the problem written out from the graph itself, not through plan_problem
    g = sbm(num_nodes=300, feat_dim=8, seed=3)
    problem = MiniBatchProblem(
        nodes=300, edges=g.num_edges, features=8, classes=g.num_classes, hidden=64, layers=2,
        fanouts=(4, 3), batch_size=64, train_nodes=int(g.ndata["train_mask"].sum()),
        degrees=degree_histogram(g.indptr.numpy()),
    )  # fmt: skip
    assert [r["data"] for r in doc["rows"]] == [1, 2, 4, 6]
    for row in doc["rows"]:
        d = row["data"]
        assert row["memory"] == pytest.approx(minibatch_memory(problem, d), rel=1e-12)
        want = None if d == 1 else estimated_part(problem, d)
        assert row["part"] == (want if want is None else pytest.approx(want, rel=1e-12))
        mib = sum(row["memory"].values()) / (1 << 20)
        assert f"{mib:,.0f}" in text
    # a partition folder: one row per part, from its records
    parts = tmp_path / "parts"
    argv = ["sbm", "--dataset-options", "num_nodes=300,feat_dim=8,seed=3", "--root", root,
            "--parts", "3", "--out", str(parts), "--no-progress"]  # fmt: skip
    assert partition_main(argv) == 0
    capsys.readouterr()
    assert main(["plan", "sage", *flags, "--partitions", str(parts), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    records = load_meta(parts)["parts"]
    assert [(r["data"], r["rank"]) for r in doc["rows"]] == [(3, 0), (3, 1), (3, 2)]
    for row, rec in zip(doc["rows"], records, strict=True):
        assert row["memory"] == pytest.approx(minibatch_memory(problem, 3, rec), rel=1e-12)
    # one-line errors
    for extra, words in (
        (["--gpus", "2", "--model", "gat"], "covers GraphSAGE with the neighbour sampler"),
        (["--gpus", "2", "--sampler", "cluster"], "not model sage with sampler cluster"),
        (["--partitions", str(parts), "--gpus", "4"], "holds 3 parts"),
        ([], "give --gpus"),
    ):
        capsys.readouterr()
        assert main(["plan", "sage", *flags, *extra]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and words in err[0], err
    other = [f if f != "num_nodes=300,feat_dim=8,seed=3" else "num_nodes=200,feat_dim=8,seed=3"
             for f in flags]  # fmt: skip
    assert main(["plan", "sage", *other, "--partitions", str(parts)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and str(parts) in err[0], err
