"""The Llama-class model: equal to transformers' LlamaForCausalLM, tensor-parallel equal to
serial on every grid shape (float64 ≤ 1e-12), through the trainer on context, pipe and
ZeRO-3 grids, and Hugging Face folders in and out (``--pretrained``, ``ckpt export-hf``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gnnpar
from gnnpar.errors import UserError
from gnnpar.models.gpt.hf_llama import (
    StackedRows,
    llama_config_from_hf,
    llama_state_from_hf,
    llama_state_to_hf,
)
from gnnpar.models.gpt.llama import Llama, LlamaConfig
from gnnpar.testing import run_distributed
from gnnpar.train.metrics import read_metrics
from tests.test_gpt import VOCAB, _check_state_dicts, _compare_training

transformers = pytest.importorskip("transformers", reason="a dev extra: make test installs it")

F64 = torch.float64
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind.\n" * 300


def hf_llama(tie: bool = False, kv: int = 2, vocab: int = 61, seed: int = 0):
    """A random transformers ``LlamaForCausalLM`` (6 heads of 8, SwiGLU 78, 2 layers), its
    weights moved away from the initialisation so that every one shows."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=78, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=kv, max_position_embeddings=32,
        tie_word_embeddings=tie, rms_norm_eps=1e-5, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # away from the initialisation, so that every weight shows
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return hf


def _read_all(state: dict) -> dict[str, torch.Tensor]:
    return {k: v if isinstance(v, torch.Tensor) else v[:] for k, v in state.items()}


@pytest.mark.parametrize("tie,kv", [(False, 2), (True, 3), (False, 6)])
def test_logits_equal_transformers_llama_and_the_weights_map_back_exactly(tie, kv):
    hf = hf_llama(tie, kv)
    cfg = LlamaConfig(**llama_config_from_hf(hf.config.to_dict()))
    assert (cfg.n_kv_head, cfg.tie_weights, cfg.ffn_hidden) == (kv, tie, 78)
    ours = Llama(cfg).eval()
    ours.load_state_dict(_read_all(llama_state_from_hf(hf.state_dict(), cfg, "hf")))
    ids = torch.randint(0, 61, (3, 32), generator=torch.Generator().manual_seed(1))
    want, got = hf(ids).logits, ours(ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # fp32; measured 1.5e-6 abs
    back, ref = llama_state_to_hf(ours.state_dict(), cfg), hf.state_dict()
    assert set(back) == set(ref) - ({"lm_head.weight"} if tie else set())
    assert all(torch.equal(back[k], ref[k]) for k in back)


def test_stacked_rows_read_only_the_box_asked_for():
    a, b = torch.arange(20.0).view(5, 4), torch.arange(100.0, 124.0).view(6, 4)
    stacked = StackedRows([(a, 1, 4), (b, 0, 2), (a, 4, 5)])
    full = torch.cat([a[1:4], b[0:2], a[4:5]])
    assert stacked.shape == stacked.get_shape() == (6, 4)
    for rows in (slice(0, 6), slice(2, 5), slice(3, 4), slice(5, 6)):
        assert torch.equal(stacked[rows, 1:3], full[rows, 1:3])
    with pytest.raises(UserError, match="trailing shape"):
        StackedRows([(a, 0, 1), (torch.zeros(2, 3), 0, 1)])


def test_configs_that_cannot_run_are_refused_in_one_line():
    with pytest.raises(UserError, match="multiple of n_kv_head=4"):
        LlamaConfig(n_head=6, n_kv_head=4, n_embd=48)
    with pytest.raises(UserError, match="even head width"):
        LlamaConfig(n_head=4, n_embd=12)
    hf = hf_llama().config.to_dict()
    for change, message in [
        ({"model_type": "mistral"}, "not 'llama'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling 'llama3'"),
        ({"hidden_act": "gelu"}, "only silu"),
        ({"mlp_bias": True}, "attention_bias and mlp_bias differ"),
    ]:
        with pytest.raises(UserError, match=message):
            llama_config_from_hf({**hf, **change}, "cfg.json")
    cfg = LlamaConfig(**llama_config_from_hf(hf))
    state = dict(hf_llama().state_dict())
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(UserError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        llama_state_from_hf(state, cfg, "hf")


# ----------------------------------------------------------------- tensor parallelism
def _tiny_llama(n_head: int = 4, n_kv_head: int = 2, n_embd: int = 16, **kw) -> Llama:
    # ffn_hidden 22: each fused half splits unevenly over an axis of 4
    cfg = LlamaConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=n_head,
                      n_kv_head=n_kv_head, n_embd=n_embd, ffn_hidden=22, **kw)  # fmt: skip
    torch.manual_seed(0)
    return Llama(cfg).to(F64)


def _deferred_equals_eager(cfg: LlamaConfig, grid) -> None:
    """A model built on the meta device gets, on every rank, the pieces of the eager build."""
    torch.manual_seed(0)
    eager = gnnpar.tensor.parallelize(Llama(cfg), grid)
    with torch.device("meta"):
        plain = Llama(cfg)
    torch.manual_seed(0)
    deferred = gnnpar.tensor.parallelize(plain, grid)
    for (k, a), b in zip(eager.state_dict().items(), deferred.state_dict().values(), strict=True):
        if not torch.equal(a, b):
            raise AssertionError(f"{grid.describe()}: deferred {k} differs from eager")


def _llama_world(folder: str) -> str:
    folder = Path(folder)
    shapes = [
        (dict(data=2, x=2, y=2), {}),
        (dict(x=2, y=2, z=2), {"bias": True, "tie_weights": True}),
        (dict(x=4, data=2), {"n_head": 8, "n_kv_head": 4, "n_embd": 32}),
        (dict(x=8), {"n_head": 16, "n_kv_head": 8, "n_embd": 32}),
        (dict(x=2, y=4), {}),
        (dict(y=2, z=4), {}),
        (dict(z=2, data=4), {}),
    ]
    for i, (shape, sizes) in enumerate(shapes):
        grid = gnnpar.init(**shape)
        make = lambda sizes=sizes: _tiny_llama(**sizes)  # noqa: E731
        _compare_training(make, grid)
        if i < 2:
            _check_state_dicts(make, grid, folder / f"llama-{i}")
            _deferred_equals_eager(_tiny_llama(**sizes).config, grid)
    # two key-value heads over four ranks: the attention's heads stay whole (every rank of
    # x computes them all, its projections still split), the MLP split; equal to serial
    grid = gnnpar.init(x=4, data=2)
    decided = gnnpar.tensor.plan_styles(_tiny_llama(), grid)
    if decided["unsplit"] != [
        f"attention block 'blocks.{i}.attn': n_kv_head=2 does not divide over x=4" for i in (0, 1)
    ] or any(block.endswith(".attn") for block, _ in decided["chains"]):
        raise AssertionError(f"x=4 with two key-value heads: {decided['unsplit']}")
    _compare_training(_tiny_llama, grid)
    return "ok"


def test_llama_parallel_equals_serial_on_8_ranks(tmp_path):
    assert run_distributed(_llama_world, 8, str(tmp_path), timeout=500) == ["ok"] * 8


# --------------------------------------------------------------------- the trainer
def _argv(text: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "gpt", "--model", "llama", "--data", str(text), "--vocab-size", "300",
            "--block-size", "8", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2",
            "--n-embd", "16", "--ffn-hidden", "22", "--batch-size", "4", "--steps", "3",
            "--eval-every", "3", "--val-batches", "1", "--sample-tokens", "0", "--quiet",
            "--dtype", "float64", "--grad-clip", "0.5", "--out", str(out), *extra]  # fmt: skip


def _losses(run: Path) -> list[float]:
    return [r[k] for r in read_metrics(run / "metrics.jsonl") for k in ("loss", "val_loss")
            if k in r]  # fmt: skip


def test_trainer_runs_llama_on_context_pipe_and_zero3_grids_as_on_one_rank(tmp_path):
    from gnnpar.cli import main
    from tests.cli_world import run_commands

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    one = ["--grid", "x=1", "--zero-stage", "0"]
    assert main(_argv(text, tmp_path / "one", *one)) == 0
    grids = {
        "context": ["--grid", "context=2,x=2", "--zero-stage", "0"],
        "pipe": ["--grid", "pipe=2,x=2", "--zero-stage", "1", "--grad-accum", "2",
                 "--activation-checkpointing", "full"],
        "zero3": ["--grid", "data=2,y=2", "--zero-stage", "3", "--activation-checkpointing",
                  "selective"],
    }  # fmt: skip
    runs = [_argv(text, tmp_path / name, *extra) for name, extra in grids.items()]
    assert run_commands(4, runs) == [[0, 0, 0]] * 4
    want = _losses(tmp_path / "one")
    assert len(want) >= 4  # three steps and a validation
    for name in grids:
        got = _losses(tmp_path / name)
        assert got == pytest.approx(want, rel=1e-12, abs=0), name


def pretrained_folder(tmp_path: Path) -> tuple[object, Path]:
    """A seeded tiny ``LlamaForCausalLM`` saved with the BPE of TEXT as ``tmp_path/hf`` (a
    ``--pretrained`` folder), and the text file: ``(model, text)``."""
    from gnnpar.data.text import load_corpus

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    tok = load_corpus(text, 300).tokenizer
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=40,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32,
    ))  # fmt: skip
    hf.save_pretrained(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    return hf, text


def test_pretrained_llama_folder_trains_on_a_grid_and_exports_back_bit_for_bit(tmp_path):
    """``--pretrained`` reads a LlamaForCausalLM folder slice by slice onto x=2 (lr 0: the
    weights stay), ``gnnpar ckpt export-hf`` writes it back, and transformers loads it with
    every tensor and every logit equal to the original."""
    from gnnpar.cli import main
    from gnnpar.data.text import load_corpus
    from tests.cli_world import run_commands

    hf, text = pretrained_folder(tmp_path)
    tok = load_corpus(text, 300).tokenizer
    run = tmp_path / "run"
    argv = ["train", "gpt", "--model", "llama", "--pretrained", str(tmp_path / "hf"),
            "--data", str(text), "--block-size", "8", "--batch-size", "4", "--steps", "1",
            "--lr", "0", "--min-lr", "0", "--grid", "x=2", "--zero-stage", "3",
            "--sample-tokens", "0", "--quiet", "--eval-every", "0", "--out", str(run)]  # fmt: skip
    assert run_commands(2, [argv]) == [[0]] * 2
    out = tmp_path / "exported"
    assert main(["ckpt", "export-hf", str(run), str(out)]) == 0
    assert main(["ckpt", "export-hf", str(run), str(out)]) == 2  # exists: --overwrite
    back = transformers.LlamaForCausalLM.from_pretrained(out)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    ref, got = hf.state_dict(), back.state_dict()
    assert set(ref) == set(got) and all(torch.equal(ref[k], got[k]) for k in ref)
    ids = torch.randint(0, tok.get_vocab_size(), (2, 16))
    assert torch.equal(hf(ids).logits, back(ids).logits)
