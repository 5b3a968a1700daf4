"""The planner's offload tiers (:mod:`gnnpar.models.gpt.memory`,
:func:`gnnpar.models.gpt.planning.choose_offload`): the memory formulas written out by hand,
the smallest tier that fits (none, host, file) on built-in machines and on the CPU box, and
``gnnpar plan gpt --offload auto``. No processes: the models only.

The hand-sized GPT (vocabulary 32, 8 positions, 8 blocks of width 16, tied head, biases) on
data = 4 (z = 1): its matrices ``V·h + T·h + L·12h² = 512 + 128 + 24576 = 25216``, biases
``9h·L = 1152`` and norms ``2h·(2L + 1) = 544``, so ``n = 26912`` elements on every rank,
and a block (a stage-3 unit) holds ``P = 25216 / L = 3152`` of them (the planner spreads the
embeddings over the blocks). With ``d = 4`` data ranks, ``e`` bytes an element and prefetch
depth ``D``, ZeRO stage 3 holds::

    none   parameters n·e/d + (1 + D)·P·e   gradients n·e/d + P·e   optimizer n·(8 + 4·[e<4])/d
    host   parameters (1 + D)·P·e           gradients P·e           host 12n/d + 4n/d
    file   parameters (1 + D)·P·e           gradients P·e           file 12n/d, host 4n/d,
           offload_buffers (1 + D)·4P/d + 3·(P/d)·(4 + 8)
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from gnnpar.cli import main
from gnnpar.models.gpt.cost import PLAN_OFFLOAD_MODES, GPTProblem, lora_params
from gnnpar.models.gpt.memory import gpt_memory
from gnnpar.models.gpt.model import GPTConfig
from gnnpar.models.gpt.planning import choose_offload, rank_gpt_stages
from gnnpar.plan import PlanError, get_machine, local_machine
from gnnpar.plan.memory import USABLE_FRACTION, device_bytes, memory_shortfall, sharded_state
from gnnpar.shard.config import OFFLOAD_MODES

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=8, n_head=2, n_embd=16)
SHAPE = {"data": 4, "x": 1, "y": 1, "z": 1}
N, P, D4 = 26912, 3152, 4  # elements per rank, per block, data ranks


def _tiny(**kw) -> GPTProblem:
    return GPTProblem(TINY, batch=4, **kw)


def _parts(problem: GPTProblem) -> dict[str, float]:
    got = gpt_memory(problem, SHAPE)
    return {k: v for k, v in got.items() if k not in ("gathered", "activations")}


def test_the_hand_sized_model_has_the_elements_written_out():
    assert gpt_memory(_tiny(element_size=4), SHAPE)["parameters"] == N * 4
    blocks = gpt_memory(_tiny(element_size=4, stage=3, prefetch_depth=0), SHAPE)["gradients"]
    assert blocks == pytest.approx(N * 4 / D4 + P * 4)


@pytest.mark.parametrize("e", [2, 4])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_stage3_memory_of_each_tier_by_hand(e, depth):
    n, p, d = N, P, D4
    base = {"element_size": e, "stage": 3, "prefetch_depth": depth}
    want = {
        "none": {
            "parameters": n * e / d + (1 + depth) * p * e,
            "gradients": n * e / d + p * e,
            "optimizer": n * (8 + (4 if e < 4 else 0)) / d,
        },
        # the parameter chunk leaves the device (at e = 4 it is the master, at e = 2 it is not
        # stored at all); the float32 reduced gradient chunk is host memory
        "host": {
            "parameters": (1 + depth) * p * e,
            "gradients": p * e,
            "optimizer": 0.0,
            "host": 12 * n / d + 4 * n / d,
        },
        "file": {
            "parameters": (1 + depth) * p * e,
            "gradients": p * e,
            "optimizer": 0.0,
            "file": 12 * n / d,
            "host": 4 * n / d,
            "offload_buffers": (1 + depth) * 4 * p / d + 3 * (p / d) * (4 + 8),
        },
    }
    for tier, parts in want.items():
        got = _parts(_tiny(**base, offload=tier))
        assert got == pytest.approx(parts), (tier, got)
    # the default depth is 1: today's two gathered units
    if depth == 1:
        assert _parts(_tiny(element_size=e, stage=3)) == pytest.approx(want["none"])


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_offload_the_optimizer_and_the_gradient_chunk(stage):
    """Stages 1–2 keep the parameters (and stage 1 the full gradients) on the device; the
    master copy and the moments go to the tier, the reduced gradient chunk to the host, and
    the file tier's step holds three groups (a block bounds a bucket) at 12 bytes each."""
    n, p, d, e = N, P, D4, 2
    for tier in ("host", "file"):
        got = _parts(_tiny(element_size=e, stage=stage, offload=tier))
        want = {
            "parameters": n * e,
            "gradients": n * e if stage == 1 else 0.0,
            "optimizer": 0.0,
            "host": 4 * n / d + (12 * n / d if tier == "host" else 0.0),
        }
        if tier == "file":
            want.update(file=12 * n / d, offload_buffers=3 * (p / d) * 12)
        assert got == pytest.approx(want), (stage, tier, got)


def test_lora_offloads_only_the_adapters():
    """With LoRA the trainable parameters are the adapters: only their master, moments and
    gradient chunk leave; the frozen base's chunk stays on the device."""
    plain = _tiny(element_size=4, stage=3, lora_rank=2)
    host = dataclasses.replace(plain, offload="host")
    from gnnpar.models.gpt.cost import gpt_layout

    a = lora_params(plain, gpt_layout(plain, SHAPE), {"data": 0, "x": 0, "y": 0, "z": 0})
    assert a > 0
    none_parts, host_parts = _parts(plain), _parts(host)
    assert host_parts["host"] == pytest.approx(16 * a / D4)
    assert none_parts["parameters"] - host_parts["parameters"] == pytest.approx(4 * a / D4)


def test_the_file_tier_buffers_hold_at_most_every_unit():
    """Two blocks (n = 7232, P = 3392 on data = 4): three groups of the step and three units
    read ahead (D = 2) would be more than the model's 2 blocks and embeddings; each term is
    capped at n."""
    two = dataclasses.replace(TINY, n_layer=2)
    n, p, d = 7232, 3392, D4
    for depth, reads in ((0, p), (2, n)):
        problem = GPTProblem(two, batch=4, stage=3, offload="file", prefetch_depth=depth)
        got = gpt_memory(problem, SHAPE)["offload_buffers"]
        assert got == pytest.approx(reads * 4 / d + n * 12 / d), depth


def test_sharded_state_generalises_the_gathered_units():
    for depth in (0, 1, 3):
        got = sharded_state(100.0, 2, 3, 4, 10.0, depth)
        assert got["parameters"] == 100 * 2 / 4 + (1 + depth) * 10 * 2
    assert sharded_state(100.0, 2, 3, 4, 10.0) == sharded_state(100.0, 2, 3, 4, 10.0, 1)


def test_problem_options_are_checked_in_one_line():
    assert PLAN_OFFLOAD_MODES == (*OFFLOAD_MODES, "auto") and "auto" not in OFFLOAD_MODES
    with pytest.raises(PlanError, match=r"^prefetch_depth must be an integer >= 0, got -1$"):
        _tiny(prefetch_depth=-1)
    with pytest.raises(PlanError, match=r"^offload must be one of .*'auto'.*got 'disk'$"):
        _tiny(offload="disk")
    with pytest.raises(PlanError, match="planner's choice, not a tier"):
        gpt_memory(_tiny(stage=3, offload="auto"), SHAPE)


# ------------------------------------------------------------------------- machines
def test_gpu_machines_state_their_host_memory_and_the_cpu_box_does_not(tmp_path):
    machines = {name: get_machine(name) for name in ("a100x4", "h100x8", "perlmutter", "frontier")}
    assert {k: m.host_memory_gb for k, m in machines.items()} == {
        "a100x4": 256.0, "h100x8": 2000.0, "perlmutter": 256.0, "frontier": 512.0,
    }  # fmt: skip
    for m in machines.values():
        assert "host memory" in m.assumptions and m.host_memory_gb > m.memory_gb
    assert get_machine("cpu").host_memory_gb is None
    assert local_machine("nccl", 2).host_memory_gb == local_machine("gloo").memory_gb
    # a bandwidth table given as the machine is the CPU box, with or without the key
    entry = {"group_size": 2, "intra_node": True, "kind": "all_reduce", "seconds": 0.001,
             "busbw_gbps": 2.0, "bytes": 1 << 20}  # fmt: skip
    for extra in ({}, {"host_memory_gb": 64}):
        table = tmp_path / f"t{len(extra)}.json"
        table.write_text(json.dumps({"schema": 1, "entries": [entry], **extra}))
        m = get_machine(str(table))
        assert m.host_memory_gb is None and len(m.fits) == 1


def test_memory_shortfall_counts_the_node_s_ranks_host_memory():
    h100 = get_machine("h100x8")
    host = USABLE_FRACTION * 2000e9 / 8  # what each of 8 ranks of a node may hold
    assert memory_shortfall({"parameters": 1e9, "host": host * 0.99}, h100, 8) == ""
    assert "host memory" in memory_shortfall({"host": host * 1.01}, h100, 8)
    assert memory_shortfall({"host": host * 1.01}, h100, 4) == ""  # 4 ranks on the node
    assert memory_shortfall({"file": 1e15}, h100, 8) == ""  # page cache: not counted
    assert "of 80 GB" in memory_shortfall({"parameters": 80e9}, h100, 8)
    # the CPU box: no host memory of its own, only the device parts are checked
    cpu = get_machine("cpu")
    assert memory_shortfall({"host": 1e15}, cpu, 8) == ""


# ------------------------------------------------------------------------ the tiers
def _gpt(layers: int, hidden: int, **kw) -> GPTProblem:
    return GPTProblem.sized(
        layers=layers, hidden=hidden, heads=64, seq=128, batch=8, stage=3, schedule=None, **kw
    )


DATA8 = {"data": 8}


def test_auto_picks_none_for_a_small_model():
    problem = GPTProblem(TINY, batch=8, stage=3, offload="auto")
    assert choose_offload(problem, DATA8, get_machine("h100x8")) == "none"
    assert choose_offload(problem, DATA8, get_machine("cpu")) == "none"


def test_auto_picks_host_where_the_device_part_does_not_fit_but_the_host_does():
    """39B parameters on 8 H100s at stage 3: without offload 84 GB a rank (80 GB GPUs);
    with the host tier 6.7 GB on the GPU and 78 GB of host memory a rank, 625 GB of the
    node's 2 TB."""
    h100, problem = get_machine("h100x8"), _gpt(48, 8192, offload="auto")
    usable = USABLE_FRACTION * h100.memory_gb * 1e9
    shape = {**SHAPE, "data": 8}
    none = gpt_memory(dataclasses.replace(problem, offload="none"), shape)
    host = gpt_memory(dataclasses.replace(problem, offload="host"), shape)
    assert device_bytes(none) > usable and device_bytes(host) < usable
    assert 8 * host["host"] < USABLE_FRACTION * h100.host_memory_gb * 1e9
    assert choose_offload(problem, DATA8, h100) == "host"
    # the same model with 1 TB of host memory a node: host does not fit, file does
    small_host = dataclasses.replace(h100, host_memory_gb=500.0)
    assert choose_offload(problem, DATA8, small_host) == "file"


def test_auto_picks_file_where_the_host_does_not_fit_either():
    """146B parameters on 8 H100s at stage 3: the host tier needs 291 GB of host memory a
    rank, 2.3 TB a node (of 2 TB); the file tier 73 GB a rank (its float32 gradient chunk)."""
    h100, problem = get_machine("h100x8"), _gpt(80, 12288, offload="auto")
    shape = {**SHAPE, "data": 8}
    host = gpt_memory(dataclasses.replace(problem, offload="host"), shape)
    assert 8 * host["host"] > USABLE_FRACTION * h100.host_memory_gb * 1e9
    assert choose_offload(problem, DATA8, h100) == "file"
    cands = rank_gpt_stages(problem, 8, h100, stages=(3,))
    picked = {c.shape["data"]: c.offload for c in cands if c.fits and c.shape.get("pipe", 1) == 1}
    assert picked[8] == "file"
    assert {c.offload for c in cands} <= {"none", "host", "file"}


def test_the_cpu_box_never_picks_host():
    """On the CPU box the host is the device memory: where none does not fit, the host
    tier (whose device part would) is skipped for the file tier."""
    problem = _tiny(element_size=4, stage=3, offload="auto")
    none = device_bytes(gpt_memory(dataclasses.replace(problem, offload="none"), SHAPE))
    host = device_bytes(gpt_memory(dataclasses.replace(problem, offload="host"), SHAPE))
    file = device_bytes(gpt_memory(dataclasses.replace(problem, offload="file"), SHAPE))
    assert host < file < none
    budget = (file + none) / 2 / USABLE_FRACTION
    cpu = dataclasses.replace(local_machine("gloo", 4), memory_gb=budget / 1e9)
    assert cpu.host_memory_gb is None
    assert choose_offload(problem, SHAPE, cpu) == "file"
    between = dataclasses.replace(cpu, memory_gb=(host + file) / 2 / USABLE_FRACTION / 1e9)
    with pytest.raises(PlanError, match="no tier fits"):
        choose_offload(problem, SHAPE, between)  # host would fit its device part: not here
    roomy = dataclasses.replace(cpu, memory_gb=none * 2 / 1e9)
    assert choose_offload(problem, SHAPE, roomy) == "none"
    cands = rank_gpt_stages(problem, 4, cpu)
    assert "host" not in {c.offload for c in cands}


def test_choose_offload_errors_are_one_line():
    big = _gpt(2, 49152, offload="auto")  # one block's gathered units alone exceed 80 GB
    with pytest.raises(PlanError) as err:
        choose_offload(big, DATA8, get_machine("h100x8"))
    text = str(err.value)
    assert text.startswith("offload 'auto': no tier fits shape d8 x1 y1 z1 at ZeRO stage 3 on")
    assert "(offload file)" in text and "\n" not in text
    forced = dataclasses.replace(big, offload="host")
    with pytest.raises(PlanError, match=r"^offload 'host': does not fit shape d8 x1 y1 z1"):
        choose_offload(forced, DATA8, get_machine("h100x8"))
    with pytest.raises(PlanError, match=r"^offload 'file' needs ZeRO stage 1, 2 or 3, not 0$"):
        choose_offload(_tiny(offload="file"), SHAPE, get_machine("h100x8"))


def test_stage_0_is_ranked_with_auto_and_left_out_with_a_forced_tier():
    h100 = get_machine("h100x8")
    auto = rank_gpt_stages(_tiny(offload="auto"), 4, h100, stages=(0, 3))
    assert {(c.stage, c.offload) for c in auto if c.fits} == {(0, "none"), (3, "none")}
    forced = rank_gpt_stages(_tiny(offload="file"), 4, h100, stages=(0, 3))
    assert {(c.stage, c.offload) for c in forced if c.fits} == {(3, "file")}
    assert forced[0].as_dict()["offload"] == "file"
    # a shape that cannot run (heads that do not split) has no tier
    assert all(c.offload is None for c in forced if c.memory == {})


# --------------------------------------------------------------------- the command
FLAGS = "plan gpt --n-layer 48 --n-embd 8192 --n-head 64 --block-size 128 --batch-size 8"
FLAGS += " --gpus 8 --machine h100x8 --stage 3 --grid data=8 --schedule gpipe --top 3"


def test_cli_plan_gpt_offload_auto_prints_each_shape_s_tier(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*FLAGS.split(), "--offload", "auto", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    title, head, _, row, *_ = text.splitlines()
    assert "offload auto" in title and "2000 GB host memory" in title
    assert head.split()[-3:] == ["host", "GB", "offload"]
    assert row.split()[1:5] == ["d8", "x1", "y1", "z1"] and row.split()[-1] == "host", row
    doc = json.loads(out.read_text())
    fitting = [c for c in doc["candidates"] if c["fits"]]
    assert fitting and {c["offload"] for c in fitting} == {"host"}
    # a deeper prefetch holds more gathered units; a forced tier shows no tier column
    assert main([*FLAGS.split(), "--offload", "host", "--prefetch-depth", "2"]) == 0
    text = capsys.readouterr().out
    assert "offload host, prefetch depth 2" in text
    assert "offload" not in text.splitlines()[1]


def test_cli_plan_gpt_offload_errors_are_one_line(capsys):
    assert main([*FLAGS.split(), "--offload", "disk"]) == 2
    err = capsys.readouterr().err
    assert "--offload must be one of none, host, file, auto, got 'disk'" in err
    assert err.count("\n") == 1
    assert main([*FLAGS.split(), "--offload", "auto", "--prefetch-depth", "-1"]) == 2
    err = capsys.readouterr().err
    assert "prefetch_depth" in err and err.count("\n") == 1
    argv = "plan gpt --n-layer 2 --n-embd 64 --n-head 8 --gpus 2 --machine cpu --stage 0"
    assert main([*argv.split(), "--offload", "auto"]) == 0  # auto at stage 0: none
    capsys.readouterr()
    assert main([*argv.split(), "--offload", "host"]) == 2
    assert "--offload host needs --stage 1, 2 or 3" in capsys.readouterr().err
