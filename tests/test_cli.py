"""The gnnpar command: info, config errors as one line, --print-config, resume, reports."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gnnpar import checkpoint
from gnnpar.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one clear line, no traceback
    return err[0]


def test_info_prints_versions(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "gloo" in out


def test_info_check_runs_every_collective(tmp_path):
    out = tmp_path / "bw.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gnnpar.cli",
            "info",
            "--check",
            "--nprocs",
            "2",
            "--mbytes",
            "0.25",
            "--iters",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "all collectives returned correct results" in proc.stdout
    import json

    kinds = {e["kind"] for e in json.loads(out.read_text())["entries"]}
    assert kinds == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"}


def test_config_errors_are_one_line(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("hiden = 16\n")
    assert main(["train", "gcn", "--config", str(cfg)]) == 2
    assert "unknown key 'hiden'" in _err_line(capsys)
    cfg.write_text('hidden = "sixteen"\n')
    assert main(["train", "gcn", "--config", str(cfg)]) == 2
    assert "config key 'hidden' must be a int, got str" in _err_line(capsys)
    assert main(["train", "gcn", "--algorithm", "4d"]) == 2
    assert "config key 'algorithm'" in _err_line(capsys)
    assert main(["train", "gcn", "--grid", "x=2,y=2", "--out", str(tmp_path / "r")]) == 2
    assert "= 4 does not divide the world size 1" in _err_line(capsys)
    assert main(["train", "gcn", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in _err_line(capsys)


def test_print_config_merges_file_and_flags(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[gcn]\nhidden = 32\nepochs = 7\n")
    assert main(["train", "gcn", "--config", str(cfg), "--epochs", "9", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "hidden = 32" in out and "epochs = 9" in out and 'model = "gcn"' in out


def _train(out: Path, epochs: int, extra: list[str] = ()) -> int:
    return main(
        [
            "train",
            "gcn",
            "--dataset",
            "sbm",
            "--dataset-options",
            "num_nodes=300,feat_dim=8",
            "--root",
            str(out.parent / "data"),
            "--epochs",
            str(epochs),
            "--out",
            str(out),
            "--eval-every",
            "2",
            "--quiet",
            *extra,
        ]
    )


def test_resume_continues_exactly(tmp_path):
    full, half = tmp_path / "full", tmp_path / "half"
    assert _train(full, 8, ["--checkpoint-every", "4"]) == 0
    assert _train(half, 4, ["--checkpoint-every", "4"]) == 0
    assert _train(half, 8, ["--checkpoint-every", "4", "--resume"]) == 0
    a, b = checkpoint.consolidate(full), checkpoint.consolidate(half)
    for k, v in a.items():
        assert torch.equal(v, b[k]), k
    from gnnpar.train.report import write_report

    summary = write_report(half)
    assert "resumed 1 time(s)" in summary
    assert all((half / "plots" / f"{n}.png").is_file() for n in ("loss", "accuracy", "throughput"))
    # A second run into the same folder must say how to proceed.
    assert _train(half, 2) == 2


def test_a_resumed_run_records_each_epoch_once(tmp_path):
    """A run killed after epoch 6 whose last checkpoint is epoch 4 redoes epochs 5 and 6:
    metrics.jsonl (and so the plots) keeps them once, the resumed attempt's."""
    from gnnpar.train.metrics import read_metrics

    out = tmp_path / "run"
    assert _train(out, 6, ["--checkpoint-every", "2", "--keep-checkpoints", "0"]) == 0
    first = {r["epoch"]: r["time"] for r in read_metrics(out / "metrics.jsonl") if "epoch" in r}
    shutil.rmtree(out / "checkpoints" / "step-000006")  # as if killed before it was written
    (out / "checkpoints" / "latest").write_text("step-000004")
    assert _train(out, 6, ["--checkpoint-every", "2", "--resume"]) == 0
    records = read_metrics(out / "metrics.jsonl")
    epochs = [r["epoch"] for r in records if "epoch" in r]
    assert epochs == [1, 2, 3, 4, 5, 6], epochs
    (resume,) = [r for r in records if r.get("event") == "resume"]
    assert resume["step"] == 4 and resume["dropped_records"] == 2
    redone = {r["epoch"]: r["time"] for r in records if r.get("epoch", 0) > 4}
    assert all(redone[e] > first[e] for e in (5, 6))  # the new attempt's, not the old


def test_damaged_checkpoints_are_reported_alike(tmp_path, capsys):
    """Every damage to a checkpoint warns naming it (a deleted manifest was skipped
    silently), a step that is not the folder's is damage, and a checkpoint past the run's
    length is one line instead of a run that trains nothing and reports the old result."""
    from gnnpar.verified import META_CHECKSUM, meta_digest

    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    assert _train(out, 6, ["--checkpoint-every", "2", "--keep-checkpoints", "0"]) == 0
    (ckpts / "step-000006" / "manifest.json").unlink()
    capsys.readouterr()
    assert _train(out, 6, ["--resume"]) == 0
    err = capsys.readouterr().err
    assert f"{ckpts / 'step-000006'}: no manifest.json (incomplete or damaged)" in err, err

    manifest = ckpts / "step-000006" / "manifest.json"
    for step in (-5, 10**6):  # edited, with the meta checksum recomputed to match
        doc = json.loads(manifest.read_text())
        doc["meta"]["step"] = step
        doc[META_CHECKSUM] = meta_digest(doc["meta"])
        manifest.write_text(json.dumps(doc))
        assert _train(out, 6, ["--resume"]) == 0
        err = capsys.readouterr().err
        assert f"{manifest}: " in err and "trying the previous checkpoint" in err, err

    shutil.rmtree(ckpts / "step-000006")
    assert _train(out, 3, ["--resume"]) == 2
    line = _err_line(capsys)
    assert "at epoch 4, past this run's 3 epochs: pass --epochs 4 or more" in line, line


def test_interrupted_checkpoint_leaves_previous_usable(tmp_path):
    import gnnpar

    grid = gnnpar.init()
    root = tmp_path / "ckpt"
    model = torch.nn.Linear(3, 1)
    checkpoint.save(root, 1, grid, model)
    # What a kill mid-write leaves: a temporary folder with a partial rank file, no manifest.
    tmp = root / ".tmp-step-000002"
    tmp.mkdir()
    (tmp / "rank-00000.pt").write_bytes(b"\x80\x02truncated")
    assert checkpoint.complete_steps(root) == [1]
    other = torch.nn.Linear(3, 1)
    assert checkpoint.load(root, grid, other).step == 1
    assert torch.equal(other.weight, model.weight)


def _train_gpt(out: Path, steps: int, extra: list[str] = ()) -> int:
    return main(
        [
            "train",
            "gpt",
            "--steps",
            str(steps),
            "--n-layer",
            "1",
            "--n-embd",
            "32",
            "--n-head",
            "2",
            "--batch-size",
            "2",
            "--block-size",
            "16",
            "--vocab-size",
            "300",
            "--warmup",
            "2",
            "--eval-every",
            "100",
            "--val-batches",
            "1",
            "--sample-tokens",
            "5",
            "--out",
            str(out),
            "--quiet",
            "--checkpoint-every",
            "3",
            *extra,
        ]
    )


def test_gpt_resume_continues_exactly(tmp_path):
    full, half = tmp_path / "full", tmp_path / "half"
    assert _train_gpt(full, 6) == 0
    assert _train_gpt(half, 3) == 0
    assert _train_gpt(half, 6, ["--resume"]) == 0
    a, b = checkpoint.consolidate(full), checkpoint.consolidate(half)
    for k, v in a.items():
        assert torch.equal(v, b[k]), k


def test_tensorboard_scalars_match_the_metrics_file(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gnnpar.train.metrics import read_metrics

    out = tmp_path / "tb"
    assert _train(out, 4, ["--tensorboard"]) == 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    expected = [(r["epoch"], r["loss"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [s for s, _ in logged] == [s for s, _ in expected] == [1, 2, 3, 4]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert {"seconds", "peak_rss_mb", "val_acc"} <= set(events.Tags()["scalars"])


def test_metric_scalars_flatten_bytes_per_axis_and_kind():
    from gnnpar.train.metrics import scalars

    record = {
        "time": 1.0,
        "epoch": 3,
        "loss": 0.5,
        "quiet": True,
        "bytes": {"x": {"all_gather": 8}},
    }
    assert scalars(record) == {"loss": 0.5, "bytes/x/all_gather": 8.0}


def test_metrics_log_after_a_torn_line(tmp_path):
    from gnnpar.train.metrics import MetricsLog, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"epoch": 1, "loss": 0.5}\n{"epoch": 2, "lo')  # killed mid-write
    MetricsLog(path).write({"event": "resume", "step": 1})
    records = read_metrics(path)
    assert [r.get("epoch", r.get("event")) for r in records] == [1, "resume"]


def test_every_train_option_has_help_and_a_row_in_the_option_table():
    """Every flag of the three tasks says what it does, and the option table of
    docs/training.md has a row for every config key (a new option cannot be added
    undocumented)."""
    import argparse
    import dataclasses

    from gnnpar.cli import build_parser
    from gnnpar.train.spec import specs

    parser = build_parser()
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    tasks = next(
        a for a in train.choices["train"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    for name, sub in tasks.choices.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and len(action.help) > 10, (name, action.option_strings)
    text = (ROOT / "docs" / "training.md").read_text()
    table = text[text.index("**Trainer options.**") : text.index("A run folder holds")]
    for spec in specs().values():
        for f in dataclasses.fields(spec.config):
            assert f"`{f.name}`" in table, f"docs/training.md's option table lacks {f.name}"


# ------------------------------------------------------------------- what a run prints
def test_significant_writes_three_digits_without_exponents_for_everyday_values():
    from gnnpar.fmt import significant

    cases = {
        19917.2351: "19900",
        1163.7606: "1160",
        14.9537: "15.0",
        3.92: "3.92",
        0.012345: "0.0123",
        999.7: "1000",  # rounding carries into the next power of ten
        0.99996: "1.00",
        -2.456: "-2.46",
        0.0: "0",
        1.234e-5: "1.23e-05",
        float("nan"): "nan",
    }
    assert {v: significant(v) for v in cases} == cases
    assert significant(19917.2351, digits=2) == "20000"


def test_counts_take_the_number_of_their_noun():
    import gnnpar
    from gnnpar.fmt import count

    assert [count(1, "rank"), count(2, "rank"), count(19874, "edge")] == [
        "1 rank",
        "2 ranks",
        "19,874 edges",
    ]
    assert count(1, "class", "classes") == "1 class"
    assert count(4, "class", "classes") == "4 classes"
    assert "(1 rank, gloo, cpu, 1 rank/node)" in gnnpar.init().describe()


def test_rates_and_times_are_shown_to_three_significant_digits():
    import io

    from gnnpar.fmt import significant
    from gnnpar.train.progress import Progress, metrics_text, rate_text

    record = {"loss": 1.911944, "val_acc": 0.50401, "tokens_per_s": 19917.2351, "seconds": 0.01234}
    shown = "loss=1.9119 val_acc=0.5040 tokens_per_s=19900 seconds=0.0123"
    assert metrics_text(record) == shown  # losses and accuracies keep four decimals
    assert rate_text(3.9234, "epoch") == "3.92 epoch/s"
    assert rate_text(0.885, "epoch") == "1.13 s/epoch"  # below one per second: the inverse
    screen = io.StringIO()
    bar = Progress().bar(4, unit="epoch", file=screen)
    bar.update(2)
    bar.set_postfix({"seeds_per_s": "1160"})
    bar.close()
    shown = screen.getvalue().split("\r")[-1]
    assert "2/4" in shown and "epoch/s, seeds_per_s=1160]" in shown, shown
    rate = shown.split(", ")[-2].split()[0]  # "12.3" in "[00:00<00:00, 12.3 epoch/s, ..."
    assert rate == significant(float(rate)), shown


def test_a_run_says_what_it_trains_on_which_grid_before_the_first_epoch(tmp_path, capsys):
    from gnnpar.train.metrics import read_metrics

    out = tmp_path / "run"
    assert _train(out, 2) == 0
    lines = capsys.readouterr().out.splitlines()
    first_epoch = next(i for i, line in enumerate(lines) if line.startswith("epoch 1/2"))
    before = "\n".join(lines[:first_epoch])
    # the slow preparation stages, each with the time it took
    assert any(line.startswith("loading sbm ... ") and line.endswith(" s") for line in lines)
    assert f"cutting shards into {out / 'shards'}" in before
    # the start lines: the dataset's sizes, the run folder, the grid and who chose it
    assert "gcn on sbm: 300 nodes, " in before and " edges, 8 features, 4 classes" in before
    assert f"; run folder {out}" in before
    assert "grid data=1 x=1 y=1 z=1 (chosen by the planner) on 1 rank (gloo, cpu)" in before
    assert lines[-2].startswith("done: grid data=1 x=1 y=1 z=1 (1 rank, gloo, cpu, 1 rank/node)")
    # the last line: the peak resident memory over the process before it loaded anything
    memory = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "memory")
    (peak,), (baseline,) = memory["peak_rss_mb"], memory["baseline_rss_mb"]
    assert 0 < baseline < peak
    assert lines[-1] == f"peak memory: {peak:,.0f} MiB over an idle baseline of {baseline:,.0f} MiB"


def test_the_launching_process_says_that_ranks_are_starting(tmp_path, monkeypatch, capsys):
    import time

    from gnnpar.train.progress import LAUNCHED_AT_ENV, Progress

    launched = []
    monkeypatch.setattr("gnnpar.launch.launch_local", lambda *a, **k: launched.append(k) or 0)
    assert main(["train", "gcn", "--nprocs", "2", "--out", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out == "starting 2 ranks ...\n"
    # rank 0 then says how long the ranks took to start (each imports torch)
    env = {LAUNCHED_AT_ENV: repr(time.time() - 3.0)}
    assert LAUNCHED_AT_ENV in launched[0]["env"]
    Progress().ranks_started(env)
    assert re.fullmatch(r"1 rank started in 3\.\d\d s\n", capsys.readouterr().out)
    Progress().ranks_started({**env, "TORCHELASTIC_RESTART_COUNT": "1"})  # not after a restart
    Progress().ranks_started({})  # nor outside a local launch
    Progress(enabled=False).ranks_started(env)  # nor on other ranks
    assert capsys.readouterr().out == ""


def test_no_help_text_states_its_default_twice():
    """Every ``--help`` of gnnpar and gnnpar-partition: no "(default: None)", and no flag
    whose help gives its default twice (one place formats defaults: config.with_default)."""
    import contextlib
    import io

    from gnnpar.cli import build_parser
    from gnnpar.train.config import with_default
    from partitioners.cli import main as partition_main

    assert with_default("hidden width", 16) == "hidden width (default: 16)"
    assert with_default("grid (default: the planner's)", None) == "grid (default: the planner's)"
    assert with_default("grid (default: the planner's)", "x=1") == "grid (default: the planner's)"

    texts = [p.format_help() for p in _parsers(build_parser())]
    for command in ([], ["inspect"], ["compare"]):
        screen = io.StringIO()
        with contextlib.redirect_stdout(screen):
            assert partition_main([*command, "--help"]) == 0
        texts.append(screen.getvalue())
    assert len(texts) > 15
    for text in texts:
        flat = " ".join(text.split())  # argparse wraps long help over lines
        assert "(default: None)" not in flat, text
        assert not re.search(r"\(default[^)]*\) ?\(default", flat), text
    actions = [a for p in _parsers(build_parser()) for a in p._actions if a.help]
    assert not [a.help for a in actions if a.help.count("(default") > 1]


# ------------------------------------------------------------------ argument errors, --help
def _parsers(p: argparse.ArgumentParser):
    """``p`` and every sub-command's parser under it."""
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _help_texts() -> dict[str, str]:
    """Every ``--help`` of gnnpar and gnnpar-partition, by program."""
    from gnnpar.cli import build_parser
    from partitioners.cli import _compare_parser, _inspect_parser, _partition_parser

    found = [*_parsers(build_parser()), _partition_parser(), _inspect_parser(), _compare_parser()]
    return {p.prog: p.format_help() for p in found}


@pytest.mark.parametrize(
    "argv, prog, message",
    [
        ("train gcn --lr abc", "gnnpar train gcn", "argument --lr: invalid float value: 'abc'"),
        ("train sage --batch-size x", "gnnpar train sage",
         "argument --batch-size: invalid int value: 'x'"),
        ("train gpt --steps", "gnnpar train gpt", "argument --steps: expected one argument"),
        ("train gcn --hiden 16", "gnnpar train gcn", "unrecognized arguments: --hiden 16"),
        ("data info", "gnnpar data info", "the following arguments are required: PATH_OR_NAME"),
        ("plan gcn --gpus four", "gnnpar plan gcn", "argument --gpus: invalid int value: 'four'"),
        ("info --nprocs x", "gnnpar info", "argument --nprocs: invalid int value: 'x'"),
        ("evaluate run --split dev", "gnnpar evaluate",
         "argument --split: invalid choice: 'dev' (choose from 'test', 'val', 'train')"),
        ("ckpt", "gnnpar ckpt", "the following arguments are required: ckpt_command"),
        ("data import g.npz --out d --bogus", "gnnpar data import",
         "unrecognized arguments: --bogus"),
    ],
)  # fmt: skip
def test_a_bad_argument_is_one_line_naming_it_and_where_to_look(capsys, argv, prog, message):
    """argparse's errors, in every sub-command: the error and a pointer to ``--help`` on one
    line (no usage block above it), exit code 2."""
    with pytest.raises(SystemExit) as exit_:
        main(argv.split())
    assert exit_.value.code == 2
    assert _err_line(capsys) == f"{prog}: error: {message} (see {prog} --help)"


def test_no_data_command_is_one_line_too(capsys):
    assert main(["data"]) == 2  # gnnpar's own message, not argparse's
    assert _err_line(capsys) == (
        "gnnpar data: error: choose a command: list, prepare, import or info (see gnnpar data "
        "--help)"
    )


def test_help_is_plain_text_with_distinct_section_titles():
    """No docstring markup reaches a terminal (Sphinx roles, ``literals``), and no --help has
    two sections of one title (a task's options and its launch flags were both "options")."""
    texts = _help_texts()
    progs = {"gnnpar train gcn", "gnnpar plan gpt", "gnnpar ckpt", "gnnpar-partition compare"}
    assert progs <= set(texts)
    for prog, text in texts.items():
        assert not re.search(r":[a-z]+:`|``", text), (prog, text)
        titles = [line for line in text.splitlines() if re.fullmatch(r"\S.*:", line)]
        assert len(titles) == len(set(titles)), (prog, titles)
    gcn = texts["gnnpar train gcn"]
    assert "\nhelp, config file and launch:\n" in gcn
    assert "\nOptions of gnnpar train gcn (and --config FILE keys):\n" in gcn
    assert "\nActivation checkpointing (gcn, gpt):\n" in gcn  # its pointer to the module docs gone


def test_options_with_fixed_choices_show_them_and_the_check_refuses_others():
    """Every config key declared with choices lists them in --help in place of STR, holds
    its default among them, and is checked against them (naming the key): --help shows what
    the check takes."""
    import dataclasses

    from gnnpar.train.config import ConfigError, choices_of, from_mapping
    from gnnpar.train.spec import specs

    texts = _help_texts()
    assert "--model {gcn,sage,gat,gin,rgcn}" in texts["gnnpar train gcn"]
    sage = texts["gnnpar train sage"]
    assert "--sampler {neighbor,vertex,saint-node,saint-edge,saint-rw,cluster}" in sage
    assert "--schedule {gpipe,1f1b,interleaved}" in texts["gnnpar train gpt"]
    declared = 0
    for name, spec in specs().items():
        if not spec.listed:
            continue
        cls = spec.config
        usage = " ".join(texts[f"gnnpar train {name}"].split())
        for f in dataclasses.fields(cls):
            choices = choices_of(cls, f.name)
            if choices is None:
                continue
            declared += 1
            flag = "--" + f.name.replace("_", "-")
            assert f"{flag} {{{','.join(choices)}}}" in usage, (name, flag)
            assert f.default is None or f.default in choices, (name, f.name)
            with pytest.raises(ConfigError, match=f"'{f.name}'"):
                from_mapping(cls, {f.name: "no-such-choice"})
    assert declared >= 25


def test_train_help_names_every_model_of_each_task():
    """``gnnpar train --help`` lists the models each task takes (its --model choices: GAT
    and GIN for gcn too), and the samplers of sage."""
    from gnnpar.train.config import choices_of
    from gnnpar.train.spec import specs

    text = " ".join(_help_texts()["gnnpar train"].split())
    tasks = {name: spec for name, spec in specs().items() if spec.listed}
    for name, spec in tasks.items():
        assert " ".join(spec.help.split()) in text, name
        for model in choices_of(spec.config, "model"):
            assert re.search(rf"\b{re.escape(model)}\b", spec.help), (name, model)
    assert re.search(r"\bgat\b.*\bgin\b", tasks["gcn"].help)
    for sampler in choices_of(tasks["sage"].config, "sampler"):
        assert sampler in tasks["sage"].help


def test_the_collective_timeout_is_a_trainer_option(tmp_path, monkeypatch, capsys):
    """``--timeout`` reaches the grid every task builds (the variable is its default), and a
    bad value of either is one line naming it."""
    from datetime import timedelta

    from gnnpar.train.spec import build_task, get

    spec = get("gcn")
    out = str(tmp_path / "run")
    monkeypatch.setenv("GNNPAR_TIMEOUT", "41")
    assert build_task(spec, spec.config(dataset="karate", out=out)).grid.timeout == timedelta(
        seconds=41
    )
    task = build_task(spec, spec.config(dataset="karate", out=out, timeout=7.5))
    assert task.grid.timeout == timedelta(seconds=7.5)
    assert "--timeout" in subprocess.run(
        [sys.executable, "-m", "gnnpar.cli", "train", "gcn", "--help"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert main(["train", "gcn", "--timeout", "0", "--out", out]) == 2
    assert "config key 'timeout' must be > 0" in _err_line(capsys)
    monkeypatch.setenv("GNNPAR_TIMEOUT", "soon")
    assert main(["train", "gcn", "--dataset", "karate", "--epochs", "1", "--out", out]) == 2
    assert "$GNNPAR_TIMEOUT must be a positive number of seconds, got 'soon'" in _err_line(capsys)


@pytest.mark.parametrize("task", ["gcn", "sage"])
def test_a_resume_onto_other_data_of_the_same_shapes_is_refused(tmp_path, capsys, task):
    """The checkpoint recorded only the dataset's name: a resume onto another graph of the
    same sizes reported the old graph's metrics as its own. It records the fingerprint, and
    a resume onto other data is one line unless --other-data says so (then recorded)."""
    from gnnpar.train.metrics import read_metrics

    out = tmp_path / "run"
    data = ["--dataset", "sbm", "--root", str(tmp_path / "data"), "--quiet", "--out", str(out)]
    data += ["--eval-every", "1"]
    data += ["--fanouts", "3,3", "--hidden", "8"] if task == "sage" else []
    first, other = "num_nodes=200,feat_dim=8,seed=1", "num_nodes=200,feat_dim=8,seed=2"
    assert main(["train", task, *data, "--epochs", "1", "--dataset-options", first]) == 0
    capsys.readouterr()
    argv = ["train", task, *data, "--epochs", "2", "--resume", "--dataset-options", other]
    assert main(argv) == 2
    line = _err_line(capsys)
    assert "the checkpoint was trained on sbm (fingerprint " in line and "--other-data" in line
    assert main([*argv, "--other-data"]) == 0
    (resume,) = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "resume"]
    change = resume["data_changed"]
    assert change["from"]["fingerprint"] != change["to"]["fingerprint"]
    # the checkpoint now records the new data: a further resume on it needs no flag
    again = ["train", task, *data, "--epochs", "3", "--resume", "--dataset-options", other]
    assert main(again) == 0
