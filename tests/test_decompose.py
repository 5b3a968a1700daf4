"""Decomposed collectives (``decompose=True``, gnnpar/tensor/overlap.py): a sequence-parallel
Linear whose all-gather → matmul and matmul → reduce-scatter run as point-to-point steps
overlapping the matmul gives the same bits as the collectives, forward and backward, float64
and float32, on 2 and 4 ranks, with sequences that split evenly and unevenly, and moves the
same bytes on the same axis; so does a whole GPT and Llama.

Bit-equality holds against the host's shared-memory transport, which sums a reduce-scatter in
group order as the decomposed schedule does (``GNNPAR_SHM_MIN_BYTES=0`` puts even these small
collectives on it). Against gloo's own algorithm the sums over 4 ranks are taken in another
order: the measured difference is bounded below (and exactly 0 on 2 ranks, where a sum of two
is the same in either order)."""

from __future__ import annotations

import os

import pytest
import torch

import gnnpar
from gnnpar import comm, tensor
from gnnpar.chunking import chunk_offsets, chunk_sizes
from gnnpar.models.gpt.llama import Llama, LlamaConfig
from gnnpar.models.gpt.model import GPT, GPTConfig
from gnnpar.tensor.sequence import SequenceSplit
from gnnpar.testing import run_distributed

B, H, M = 3, 12, 22  # batch, model width, inner width (22 splits 11/11 and 6/6/5/5)
LENGTHS = (8, 9)  # even and uneven over 2 and 4 ranks


def _layer(role: str, decompose: bool, grid, split, dtype):
    """A column (gather) or row (scatter) layer, the same weights whatever ``decompose``."""
    torch.manual_seed(7)
    if role == "gather":  # in axis y, out axis x: takes the sequence shard
        kw = dict(transpose=True, scatter_input=True, gather_output=False)
        return tensor.Linear(H, M, grid, **kw, sequence="gather", decompose=decompose,
                             sequence_split=split, dtype=dtype)  # fmt: skip
    kw = dict(transpose=False, scatter_input=False, gather_output=True)
    return tensor.Linear(M, H, grid, **kw, sequence="scatter", decompose=decompose,
                         sequence_split=split, dtype=dtype)  # fmt: skip


def _run_layer(role: str, decompose: bool, grid, t: int, dtype) -> tuple[dict, dict]:
    """Forward and backward of one layer: output and gradients, and the bytes by axis."""
    p, me = grid.size("x"), grid.rank("x")
    split = SequenceSplit(grid)
    split.begin(t)
    layer = _layer(role, decompose, grid, split, dtype)
    gen = torch.Generator().manual_seed(11)
    if role == "gather":  # this rank's tokens of one full input
        full = torch.randn(B, t, H, generator=gen, dtype=dtype)
        sizes = chunk_sizes(t, p)
        x = full.narrow(1, chunk_offsets(sizes)[me], sizes[me]).clone()
    else:  # every token, this rank's inner features
        x = torch.randn(p, B, t, M, generator=gen, dtype=dtype)[me]
        x = x[..., : layer.local_in_features].clone()
    x.requires_grad_(True)
    with comm.record(grid) as traffic:
        y = layer(x)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(13 + me), dtype=dtype)
        y.backward(dy)
    got = {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad}
    return got, traffic.by_axis()


def _layers(p: int) -> dict:
    out = {}
    grid = gnnpar.init(x=p)
    for transport, env in (("shm", ("GNNPAR_SHM_MIN_BYTES", "0")), ("gloo", ("GNNPAR_SHM", "0"))):
        os.environ[env[0]] = env[1]
        for dtype in (torch.float64, torch.float32):
            for role in ("gather", "scatter"):
                for t in LENGTHS:
                    ref, ref_bytes = _run_layer(role, False, grid, t, dtype)
                    dec, dec_bytes = _run_layer(role, True, grid, t, dtype)
                    key = (transport, str(dtype).split(".")[1], role, t)
                    out[key] = {
                        "equal": {k: bool(torch.equal(ref[k], dec[k])) for k in ref},
                        "rel": max(
                            float((ref[k] - dec[k]).abs().max() / ref[k].abs().max()) for k in ref
                        ),
                        "bytes": (ref_bytes, dec_bytes),
                    }
        del os.environ[env[0]]
    out["models"] = _models(grid)
    gnnpar.release(grid)
    return out


def _models(grid) -> dict:
    """Our GPT and Llama with sequence parallelism, decomposed or not: logits and every
    gradient bit for bit (float64, a sequence of 9: uneven over 2 and 4)."""
    os.environ["GNNPAR_SHM_MIN_BYTES"] = "0"
    p = grid.size("x")
    out = {}
    for name in ("gpt", "llama"):
        runs = []
        for decompose in (False, True):
            torch.manual_seed(0)
            if name == "gpt":
                plain = GPT(GPTConfig(vocab_size=37, block_size=9, n_layer=2, n_head=4, n_embd=20))
            else:
                plain = Llama(LlamaConfig(vocab_size=37, block_size=9, n_layer=2, n_head=4,
                                          n_kv_head=p, n_embd=16, ffn_hidden=22))  # fmt: skip
            plan = tensor.Plan(sequence_parallel=True, decompose=decompose)
            model = tensor.parallelize(plain.double(), grid, plan)
            ids = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(3))
            with comm.record(grid) as traffic:
                logits = model(ids[:, :-1])
                tensor.cross_entropy(logits, ids[:, 1:], model.lm_head).backward()
            grads = [p.grad for p in model.parameters()]
            runs.append((logits.detach(), grads, traffic.by_axis()))
        (la, ga, ba), (lb, gb, bb) = runs
        same = torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True))
        out[name] = {"equal": same, "bytes": (ba, bb)}
    del os.environ["GNNPAR_SHM_MIN_BYTES"]
    return out


@pytest.fixture(scope="module")
def worlds() -> dict[int, dict]:
    return {p: run_distributed(_layers, p, p, timeout=300) for p in (2, 4)}


CASES = [(dt, role, t) for dt in ("float64", "float32") for role in ("gather", "scatter")
         for t in LENGTHS]  # fmt: skip


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("dtype,role,t", CASES)
def test_decomposed_layer_is_bit_equal_and_moves_the_same_bytes(worlds, p, dtype, role, t):
    for rank in worlds[p]:
        got = rank[("shm", dtype, role, t)]
        assert all(got["equal"].values()), got["equal"]  # y, dx, dw, db
        ref_bytes, dec_bytes = got["bytes"]
        assert ref_bytes == dec_bytes and ref_bytes["x"] > 0


@pytest.mark.parametrize("p", [2, 4])
def test_against_gloos_own_sum_order_the_difference_is_last_bits(worlds, p):
    for rank in worlds[p]:
        for key, got in rank.items():
            if key == "models" or key[0] != "gloo":
                continue
            _, dtype, role, t = key
            assert got["bytes"][0] == got["bytes"][1]
            if p == 2:  # a + b = b + a
                assert all(got["equal"].values()), (dtype, role, t, got["equal"])
            # measured on 4 ranks: 2.5e-16 (float64) and 1.2e-7 (float32) of the largest value
            bound = 1e-15 if dtype == "float64" else 5e-7
            assert got["rel"] <= bound, (dtype, role, t, got["rel"])


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_decomposed_model_is_bit_equal_and_moves_the_same_bytes(worlds, p, model):
    for rank in worlds[p]:
        got = rank["models"][model]
        assert got["equal"]
        assert got["bytes"][0] == got["bytes"][1]
