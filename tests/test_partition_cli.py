"""Quality metrics and the ``gnnpar-partition`` command line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from partitioners import Partition, load_meta, load_part
from partitioners.cli import main
from partitioners.metrics import balance, edge_cut, format_table, halo_counts, measure, quality

# A 6-node directed graph (row i lists the sources of edges into i):
# 0 <- 1, 2; 1 <- 0; 2 <- 3; 3 <- 2, 4; 4 <- 5; 5 <- 4, 0
INDPTR = np.array([0, 2, 3, 4, 6, 7, 9])
INDICES = np.array([1, 2, 0, 3, 2, 4, 5, 4, 0])


def test_metrics_on_a_hand_checked_graph():
    owner = np.array([0, 0, 0, 1, 1, 1])
    # Cut edges: 3 -> 2, 2 -> 3, 0 -> 5.
    assert edge_cut(INDPTR, INDICES, owner) == (3, 3 / 9)
    # Halo of part 0: {3}; of part 1: {2, 0}.
    np.testing.assert_array_equal(halo_counts(INDPTR, INDICES, owner, 2), [1, 2])
    # Parts {0, 3, 4, 5} and {1, 2}: node 2 feeds both 0 and 3, yet is one halo node.
    other = np.array([0, 1, 1, 0, 0, 0])
    assert edge_cut(INDPTR, INDICES, other) == (5, 5 / 9)
    np.testing.assert_array_equal(halo_counts(INDPTR, INDICES, other, 2), [2, 2])
    assert balance(np.array([3, 1])) == 1.5 and balance(np.zeros(2)) == 1.0
    part = Partition(owner, 2, method="custom")
    q = quality((INDPTR, INDICES), part, feature_bytes=16)
    assert q.edge_cut == 3 and q.node_balance == 1.0
    assert q.edge_balance == pytest.approx(5 / 4.5)
    assert q.replication_factor == pytest.approx(9 / 6)
    assert q.halo_fraction == pytest.approx(3 / 9)
    assert q.max_halo_fraction == pytest.approx(2 / 5)
    assert q.comm_bytes == 3 * 16 and q.max_comm_bytes == 2 * 16
    assert q.train_balance is None
    table = format_table([{"a": "x", "b": 1.5}, {"a": "yy", "b": None}])
    assert table.splitlines()[0].split() == ["a", "b"] and "-" in table.splitlines()[3]


def test_measure_sees_memory_and_time():
    import mmap
    import os

    with measure() as m:
        # A fresh anonymous mapping, every page written: new resident memory whatever the
        # allocator kept from earlier tests (np.ones may reuse an already resident heap).
        if os.path.isfile("/proc/self/status"):  # measured by RSS
            block = mmap.mmap(-1, 40 * 2**20)
            for offset in range(0, len(block), mmap.PAGESIZE):
                block[offset] = 1
            block.close()
        else:  # measured by tracemalloc, which sees numpy's allocations
            np.ones(40 * 2**20 // 8).sum()
    assert m.time_s > 0
    assert m.peak_bytes >= 30 * 2**20, m
    assert m.source in ("rss", "tracemalloc")


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_partition_inspect_and_compare(tmp_path, capsys):
    out = tmp_path / "karate-2"
    code, text, err = _run(
        capsys, "karate", "--parts", "2", "--out", str(out), "--balance-train", "--no-progress"
    )
    assert code == 0, err
    assert "edge cut" in text and "replication factor" in text and "owned" in text
    meta = load_meta(out)
    assert meta["num_parts"] == 2 and meta["method"] == "metis" and meta["balance"] == ["train"]
    assert load_part(out, 1).num_owned > 0

    code, text, err = _run(capsys, "inspect", str(out))
    assert code == 0, err
    assert "2 parts by metis" in text and "xxh3_64" in text and "gnnpar.partition v2" in text

    code, text, err = _run(
        capsys, "sbm", "--dataset-options", "num_nodes=300", "--parts", "3", "--method", "fennel",
        "--out", str(tmp_path / "sbm"), "--halo", "0", "--seed", "4", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert load_meta(tmp_path / "sbm")["halo_hops"] == 0

    rows_file = tmp_path / "rows.json"
    code, text, err = _run(
        capsys, "compare", "sbm", "--dataset-options", "num_nodes=300", "--parts", "4",
        "--methods", "random,metis,fennel", "--json", str(rows_file), "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    lines = text.splitlines()
    assert lines[1].split()[:2] == ["method", "cut"]
    assert [line.split()[0] for line in lines[3:]] == ["random", "metis", "fennel"]
    rows = json.loads(rows_file.read_text())
    assert rows[1]["edge_cut_fraction"] < rows[0]["edge_cut_fraction"]


def test_compare_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "cmp.png"
    code, _, err = _run(
        capsys, "compare", "karate", "--parts", "2", "--methods", "random,metis",
        "--plot", str(png), "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_overwrite_replaces_a_partition_folder(tmp_path, capsys):
    out = tmp_path / "parts"
    argv = ["karate", "--out", str(out), "--no-progress"]
    assert _run(capsys, *argv, "--parts", "2")[0] == 0
    code, _, err = _run(capsys, *argv, "--parts", "3")
    assert code == 2 and "already exists: add --overwrite, or another --out" in err
    assert load_meta(out)["num_parts"] == 2  # the refused run left the folder alone
    code, _, err = _run(capsys, *argv, "--parts", "3", "--overwrite")
    assert code == 0, err
    assert load_meta(out)["num_parts"] == 3


def test_compare_figure_labels_units_and_shows_every_bar():
    pytest.importorskip("matplotlib")
    from partitioners.plots import compare_figure

    rows = [
        {"method": m, "edge_cut_fraction": cut, "edge_balance": bal, "time_s": t,
         "peak_bytes": peak}
        for m, cut, bal, t, peak in [
            ("random", 0.75, 1.01, 0.0004, 64 * 2**10),
            ("metis", 0.004, 1.03, 2.5, 300 * 2**20),
            ("range", 0.6, 1.0, 0.0002, 0),
        ]
    ]  # fmt: skip
    cut, balance, time, memory = compare_figure(rows, "g, K=2").axes
    assert cut.get_ylabel() == "cut edges (% of all edges), log scale"
    assert balance.get_ylabel() == "max / mean edges per part" and balance.get_yscale() == "linear"
    assert time.get_ylabel() == "wall time (s), log scale"
    assert memory.get_ylabel() == "peak memory (MiB), log scale"
    for ax in (cut, time, memory):  # values spanning decades: log scales
        assert ax.get_yscale() == "log"
        bottom = ax.get_ylim()[0]
        assert len(ax.patches) == 3 and all(p.get_height() > bottom for p in ax.patches)
    # The zero peak is a visible stub, labelled with its value.
    assert [t.get_text() for t in memory.texts] == ["0.0625", "300", "0"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["karate", "--parts", "0", "--out", "{tmp}/x"], "num_parts must be >= 1"),
        (["karate", "--parts", "35", "--out", "{tmp}/x"], "cannot split 34 nodes into 35"),
        (["no-such-dataset", "--parts", "2", "--out", "{tmp}/x"], "unknown dataset"),
        (["karate", "--parts", "2", "--out", "{tmp}"], "already exists"),
        (["inspect", "{tmp}/missing"], "no such folder"),
        (["compare", "karate", "--parts", "2", "--methods", "metis,magic"], "unknown method"),
        (
            ["sbm", "--dataset-options", "colour=1", "--parts", "2", "--out", "{tmp}/x"],
            "unknown option",
        ),
    ],
)
def test_errors_are_one_line_with_status_2(tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, _, err = _run(capsys, *argv, "--no-progress")
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gnnpar-partition: error:"), err
    assert message in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_usage_errors_and_help(capsys):
    assert main(["karate"]) == 2  # argparse: --parts and --out are required
    assert "required" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, prog, message",
    [
        ("karate --parts two --out x", "gnnpar-partition",
         "argument --parts/-k: invalid int value: 'two'"),
        ("karate --parts 2 --out x --halo 2", "gnnpar-partition",
         "argument --halo: invalid choice: 2 (choose from 0, 1)"),
        ("karate --out x", "gnnpar-partition",
         "the following arguments are required: --parts/-k"),
        ("inspect DIR --verify all", "gnnpar-partition inspect",
         "argument --verify: invalid choice: 'all' (choose from 'checksum', 'size')"),
        ("compare karate --parts 2 --seed s", "gnnpar-partition compare",
         "argument --seed: invalid int value: 's'"),
        ("compare karate --parts 2 --bogus", "gnnpar-partition compare",
         "unrecognized arguments: --bogus"),
    ],
)  # fmt: skip
def test_a_bad_argument_is_one_line_with_where_to_look(capsys, argv, prog, message):
    """argparse's errors of every command: one line on stderr (no usage block), status 2."""
    code, _, err = _run(capsys, *argv.split())
    assert code == 2
    assert err.splitlines() == [f"{prog}: error: {message} (see {prog} --help)"]


def test_every_option_has_help_and_shows_its_default():
    """Every argument of the three commands says what it is, and an option with a value
    default says the default (a flag's default is off, unless its help says otherwise)."""
    import argparse

    from partitioners.cli import _compare_parser, _inspect_parser, _partition_parser

    for parser in (_partition_parser(), _inspect_parser(), _compare_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            name = action.option_strings or action.dest
            assert action.help and len(action.help) > 10, (parser.prog, name)
            if action.default not in (None, False):
                assert "(default: " in action.help, (parser.prog, name, action.default)
        text = parser.format_help()
        assert "(default: None)" not in text
    help_of = {a.dest: a.help for a in _partition_parser()._actions}
    assert help_of["method"].endswith("(default: metis)") and "fennel" in help_of["method"]
