"""LoRA fine-tuning: adapters on a tensor-parallel model equal serial ones, the frozen base
never enters a gradient collective or the optimizer (bytes against a formula), and through
the trainer: instruction data with the loss on responses, resume on another grid, adapters
alone in the checkpoint, ``export-hf --merge``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gnnpar
from gnnpar import comm, tensor
from gnnpar.data.instruct import IGNORE, InstructionBatches, read_instructions
from gnnpar.errors import UserError
from gnnpar.models.gpt.llama import LlamaBlock
from gnnpar.tensor.lora import add_lora, lora_targets, merge_lora
from gnnpar.testing import run_distributed
from gnnpar.train.metrics import read_metrics
from tests.test_llama import _tiny_llama, pretrained_folder

transformers = pytest.importorskip("transformers", reason="a dev extra: make test installs it")

TARGETS = ["qkv", "o_proj", "gate_up", "down"]
RANK, ALPHA = 4, 8.0


def _adapted(model):
    add_lora(model, TARGETS, RANK, ALPHA, seed=1)
    return model


def _serial():
    """The serial model with adapters, B away from zero so that every gradient shows."""
    model = _adapted(_tiny_llama())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _trainable_elements(x: int) -> int:
    """Adapter elements per rank of _tiny_llama (width 16, 4 heads of 4, 2 key-value heads,
    SwiGLU 22, 2 blocks), every adapter split over x: per projection (in, out), A is
    rank x in and B out x rank."""
    qkv_out = (4 + 2 * 2) * 4
    projections = [(16, qkv_out), (16, 16), (16, 2 * 22), (22, 16)]
    return sum(RANK * i + o * RANK for i, o in projections) * 2 // x


def _lora_world(stage: int, fcdp: bool) -> str:
    from gnnpar.shard import FCDP, by_type, shard

    grid = gnnpar.init(data=2, x=2)
    serial = _serial()
    par = _adapted(tensor.parallelize(_tiny_llama(), grid))
    full = serial.state_dict()
    tensor.load_full_state_dict(par, {k: v for k, v in full.items() if "lora_B" in k}, grid, False)
    dp = shard(par, grid, stage=stage, units=by_type(LlamaBlock), fcdp=FCDP() if fcdp else None)
    trainable = {n for n, p in serial.named_parameters() if p.requires_grad}
    assert trainable == {n for n in full if ".lora_" in n} and len(trainable) == 16
    # the optimizer holds the adapters alone: this rank's pieces (from stage 1, half of them)
    assert sum(p.numel() for p in dp.parameters()) == _trainable_elements(2) // (1 + (stage > 0))
    ids = torch.randint(0, 37, (2, 4, 9), generator=torch.Generator().manual_seed(5))
    opt_s = torch.optim.AdamW([p for p in serial.parameters() if p.requires_grad], lr=1e-2)
    opt_p = dp.attach(torch.optim.AdamW(dp.parameters(), lr=1e-2))
    element = 8  # float64
    for step in range(2):
        x, y = ids[step, :, :-1], ids[step, :, 1:]
        mine = slice(2 * grid.rank("data"), 2 * grid.rank("data") + 2)
        F.cross_entropy(serial(x).reshape(-1, 37), y.reshape(-1)).backward()
        with comm.record(grid) as traffic:
            tensor.cross_entropy(par(x[mine]), y[mine], par.lm_head).backward()
        # only the adapters' gradients cross the data axis: ring all-reduce (stage 0) or
        # reduce-scatter (stage 3) of this rank's adapter pieces, nothing of the frozen base
        grads = _trainable_elements(2) * element
        want = {0: ("all_reduce", grads), 3: ("reduce_scatter", grads // 2)}[stage]
        got = {k: traffic.bytes("data", k) for k in ("all_reduce", "reduce_scatter")}
        assert got == {want[0]: want[1], ({"all_reduce", "reduce_scatter"} - {want[0]}).pop(): 0}
        if fcdp and step == 1:  # the frozen base is cached whole after the first step
            assert traffic.bytes("data", "all_gather") == grads // 2
        opt_s.step()
        opt_p.step()
        opt_s.zero_grad()
        opt_p.zero_grad()
    back = tensor.full_state_dict(par, grid) if stage == 0 else dp.full_state_dict()
    for k in trainable:
        worst = float((back[k] - serial.state_dict()[k]).abs().max())
        if worst > 1e-12:
            raise AssertionError(f"stage {stage}: {k} differs from serial by {worst}")
    for k in set(full) - trainable:  # the base did not move
        if not torch.equal(back[k], full[k]):
            raise AssertionError(f"stage {stage}: frozen {k} changed")
    return "ok"


@pytest.mark.parametrize("stage,fcdp", [(0, False), (3, True)])
def test_lora_on_a_grid_equals_serial_and_moves_no_frozen_gradient(stage, fcdp):
    assert run_distributed(_lora_world, 4, stage, fcdp) == ["ok"] * 4


def test_lora_targets_merge_and_refusals():
    model = _tiny_llama()
    assert lora_targets(model, ["qkv"]) == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
    assert lora_targets(model, ["blocks.1.mlp.*"]) == ["blocks.1.mlp.gate_up", "blocks.1.mlp.down"]
    with pytest.raises(UserError, match="LoRA target 'q_proj' matches no Linear"):
        lora_targets(model, ["q_proj"])
    serial = _serial()
    x = torch.randint(0, 37, (2, 8))
    merged = merge_lora(serial.state_dict(), ALPHA / RANK)
    assert not any(".lora_" in k for k in merged)
    plain = _tiny_llama()
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(x), serial(x), rtol=1e-12, atol=1e-12)
    trainable = [n for n, p in serial.named_parameters() if p.requires_grad]
    with pytest.raises(UserError, match="already has LoRA adapters"):
        _adapted(serial)
    assert [n for n, p in serial.named_parameters() if p.requires_grad] == trainable
    qkv = serial.blocks[0].attn.qkv  # the update follows its input however it is passed
    h = torch.randn(2, 16, dtype=torch.float64)
    assert torch.equal(qkv(input=h), qkv(h))


def test_instruction_pairs_train_only_on_their_responses(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {c: i for i, c in enumerate("abcdefgh")} | {"</s>": 8}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = __import__("tokenizers").pre_tokenizers.Split("", "isolated")
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "abc", "response": "de"}\n\n{"prompt": "a", "response": "fgh"}\n')
    data = read_instructions(path, tok)
    assert [e.tolist() for e in data.examples] == [[0, 1, 2, 3, 4, 8], [0, 5, 6, 7, 8]]
    batches = InstructionBatches(data, [0, 1], 6, 2)
    x, y = batches.inputs, batches.targets
    assert x.tolist() == [[0, 1, 2, 3, 4, 8], [0, 5, 6, 7, 8, 0]]
    # a target counts where it is a response token (the end-of-sequence id included)
    assert y.tolist() == [[IGNORE, IGNORE, 3, 4, 8, IGNORE], [5, 6, 7, 8, IGNORE, IGNORE]]
    assert batches.expected_tokens(0, 2) == 7 / 2
    for text, message in [
        ('{"prompt": "a"}', "pairs.jsonl:1: expected an object with string 'prompt'"),
        ('{"prompt": "a", "response": "b"}\nnot json', "pairs.jsonl:2: not JSON"),
        ("", "no prompt/response pairs"),
    ]:
        path.write_text(text)
        with pytest.raises(UserError, match=message):
            read_instructions(path, tok)


# --------------------------------------------------------------------- the trainer
def _pretrained(tmp_path: Path) -> tuple[Path, Path, object]:
    """The tiny pretrained folder of tests/test_llama.py and 40 prompt/response pairs."""
    hf, _ = pretrained_folder(tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    with pairs.open("w") as f:
        for i in range(40):
            row = {"prompt": f"Question {i}: what is it?", "response": "To be. " * (1 + i % 3)}
            f.write(json.dumps(row) + "\n")
    return tmp_path / "hf", pairs, hf


def _argv(hf: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "gpt", "--model", "llama", "--pretrained", str(hf), "--data", str(data),
            "--block-size", "16", "--batch-size", "8", "--lr", "1e-2", "--sample-tokens", "0",
            "--quiet", "--eval-every", "2", "--val-fraction", "0.2", "--val-batches", "1",
            "--peft", "lora", "--lora-rank", "4", "--dtype", "float64", "--out", str(out),
            *extra]  # fmt: skip


def _losses(run: Path) -> list[float]:
    """Every step's loss and the last validation loss (a resumed run's first part ends with
    a validation of its own)."""
    records = list(read_metrics(run / "metrics.jsonl"))
    return [r["loss"] for r in records if "loss" in r] + [records[-1]["val_loss"]]


def test_lora_finetunes_on_instructions_resumes_on_another_grid_and_merges(tmp_path):
    from gnnpar.cli import main
    from gnnpar.models.gpt.llama import Llama, LlamaConfig
    from tests.cli_world import run_commands

    hf, pairs, base = _pretrained(tmp_path)
    one = tmp_path / "one"
    assert main(_argv(hf, pairs, one, "--steps", "4", "--grid", "x=1", "--zero-stage", "0")) == 0
    split, piped = tmp_path / "split", tmp_path / "piped"
    four = [
        _argv(hf, pairs, split, "--steps", "2", "--grid", "data=2,x=2", "--zero-stage", "3",
              "--fcdp"),
        _argv(hf, pairs, piped, "--steps", "4", "--grid", "pipe=2,x=2", "--grad-accum", "2",
              "--zero-stage", "1"),
    ]  # fmt: skip
    two = [_argv(hf, pairs, split, "--steps", "4", "--grid", "y=2", "--zero-stage", "2",
                 "--resume")]  # fmt: skip
    assert run_commands(4, four) == [[0, 0]] * 4
    assert run_commands(2, two) == [[0]] * 2
    want = _losses(one)
    for run in (split, piped):
        assert _losses(run) == pytest.approx(want, rel=1e-12, abs=0), run.name
    from gnnpar.checkpoint import consolidate

    adapters = consolidate(split)
    assert sorted(adapters) == sorted(k for k in adapters if ".lora_" in k) and len(adapters) == 16
    out = tmp_path / "merged"
    assert main(["ckpt", "export-hf", str(split), str(out)]) == 2  # adapters only: --merge
    assert main(["ckpt", "export-hf", str(split), str(out), "--merge"]) == 0
    # ours: the pretrained base with the trained adapters, unmerged (float64)
    cfg = LlamaConfig(**_sizes(base))
    ours = Llama(cfg).to(torch.float64)
    add_lora(ours, TARGETS, 4, 16.0)
    state = _ours(base.state_dict(), cfg)
    ours.load_state_dict({**{k: v.double() for k, v in state.items()}, **adapters})
    # the export is the merge of these (W + alpha/rank · B @ A), read back into our model
    merged = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float64)
    plain = Llama(cfg).to(torch.float64)
    plain.load_state_dict(_ours(merged.state_dict(), cfg))
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    torch.testing.assert_close(plain(ids), ours(ids), rtol=1e-10, atol=1e-10)
    # and transformers computes the same logits from it (its norms run in float32)
    want = merged.float()(ids).logits
    assert (want - plain.float()(ids)).abs().max() <= 1e-5 * want.abs().max()
    # unmerged, in peft's format: PeftModel on the base gives the merged model's logits
    from peft import PeftModel

    adapters_dir = tmp_path / "adapters"
    assert main(["ckpt", "export-hf", str(split), str(adapters_dir), "--adapters"]) == 0
    tuned = PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(hf), adapters_dir
    )
    got = tuned.float()(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _ours(hf_state: dict, cfg) -> dict[str, torch.Tensor]:
    """Our full state dict of a transformers Llama state dict (fused tensors read whole)."""
    from gnnpar.models.gpt.hf_llama import llama_state_from_hf

    state = llama_state_from_hf(hf_state, cfg, "hf")
    return {k: v if isinstance(v, torch.Tensor) else v[:] for k, v in state.items()}


def _sizes(hf) -> dict:
    from gnnpar.models.gpt.hf_llama import llama_config_from_hf

    return llama_config_from_hf(hf.config.to_dict())


# --------------------------------------------------------------------- the planner
class _Tokens:
    """A corpus stand-in: random token ids (the memory does not depend on the text)."""

    name, vocab_size, tokens = "random", 290, torch.zeros(1)  # below the tokenizer's 297

    def split(self, val_fraction: float):
        ids = torch.randint(0, 290, (6000,), generator=torch.Generator().manual_seed(5))
        return ids, ids[:1200]

    def encode(self, text: str) -> list[int]:
        return [1]


def _memory_world(hf: str) -> list[tuple[float, float]]:
    """(measured, predicted) bytes per run on this rank: the state ShardedModel.memory
    measures (parameters, gradients, optimizer) plus what autograd saved in a step, against
    the planner's parameters + gradients + optimizer + activations."""
    import dataclasses

    import gnnpar
    from gnnpar.models.gpt.memory import gpt_memory
    from gnnpar.models.gpt.task import GPTTaskConfig, plan_problem
    from gnnpar.train.spec import build_task
    from tests.test_context import _saved_bytes

    out = []
    for stage, peft in ((0, "none"), (0, "lora"), (1, "lora"), (2, "lora")):
        cfg = GPTTaskConfig(
            model="llama", pretrained=hf, peft=peft, lora_rank=8, block_size=32, batch_size=8,
            grid="data=2,x=2", zero_stage=stage, steps=3, sample_tokens=0, val_batches=1,
        )  # fmt: skip
        task = build_task("gpt", cfg, corpus=_Tokens())
        _, saved = _saved_bytes(task, 0)
        state = task.dp.memory(task.optimizer)
        plan = gpt_memory(dataclasses.replace(plan_problem(cfg, task.sizes), stage=stage),
                          task.grid.shape)  # fmt: skip
        predicted = sum(plan[k] for k in ("parameters", "gradients", "optimizer", "activations"))
        out.append((state["params"] + state["grads"] + state["optimizer"] + saved, predicted))
        gnnpar.release(task.grid)
    return out


def test_planner_memory_of_llama_and_lora_within_20_percent(tmp_path):
    hf, _, _ = _pretrained(tmp_path)
    for rank in run_distributed(_memory_world, 4, str(hf)):
        for measured, predicted in rank:
            assert 0.8 <= measured / predicted <= 1.2, (measured, predicted)
