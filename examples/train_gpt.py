"""Train a small GPT on Shakespeare (or any text) with the library API: 4D hybrid parallelism
(data × x × y × z) and ZeRO, in one readable loop.

    python examples/train_gpt.py --nprocs 4 --grid data=2,x=2 --steps 100
    python examples/train_gpt.py --nprocs 4 --grid data=2,z=2 --zero-stage 3 --out runs/ex
    torchrun --nproc-per-node 4 examples/train_gpt.py --grid x=2,y=2 --out runs/ex-xy
    python examples/train_gpt.py --data README.md --n-layer 4 --n-head 4 --n-embd 256 \\
        --out runs/ex-readme
    python examples/train_gpt.py --consolidate runs/ex full.pt

(The documentation tests run these with ``--steps 3 --sample-tokens 5 --n-layer 2
--n-embd 64 --n-head 4``.)

It is ``gnnpar train gpt`` spelled out (that command adds the planner's grid, metrics,
progress, TensorBoard, resume on failure and mixed precision). The model is a plain GPT
(gnnpar/models/gpt/model.py): ``tensor.parallelize`` splits its layers over x, y and z, and
``shard`` makes it data-parallel over the data axis (stage 0 all-reduce, 1-3 ZeRO). A
checkpoint is written every ``--checkpoint-every`` steps and at the end into
``OUT/checkpoints``; ``--resume`` continues from it on any grid; ``--consolidate`` turns one
into a plain state dict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

import gnnpar
from gnnpar import checkpoint, comm, tensor
from gnnpar.data.text import TokenBlocks, load_corpus
from gnnpar.grid import parse_grid_spec
from gnnpar.launch import launch_local, strip_nprocs, under_launcher
from gnnpar.models.gpt.model import GPT, Block, GPTConfig
from gnnpar.shard import by_type, shard
from gnnpar.train.schedule import apply as apply_schedule


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", type=int, default=1, help="start this many local processes")
    p.add_argument("--grid", default="data=1", help="e.g. data=2,x=2 (x·y·z share each layer)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--data", default="shakespeare", help="shakespeare, a text file or folder")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step, global")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--sample-tokens", type=int, default=100)
    p.add_argument("--out", default="runs/gpt-example", help="run folder (checkpoints, JSON)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--consolidate", nargs=2, metavar=("RUN_OR_CKPT", "OUT"),
                   help="write the plain state dict of a checkpoint to OUT and exit")  # fmt: skip
    return p.parse_args(argv)


def lr_schedule(args: argparse.Namespace) -> SimpleNamespace:
    """The trainer's schedule keys: linear warm-up over 20 steps, then cosine decay to a
    tenth (``gnnpar.train.schedule`` computes it, as for ``gnnpar train``)."""
    return SimpleNamespace(
        lr=args.lr, warmup=20, lr_schedule="cosine", min_lr=args.lr / 10,
        lr_gamma=1.0, lr_step_every=1,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.consolidate:
        src, dest = args.consolidate
        torch.save(checkpoint.consolidate(src), dest)
        print(f"wrote the plain state dict of {src} to {dest}")
        return 0
    if args.nprocs > 1 and not under_launcher():
        return launch_local(args.nprocs, strip_nprocs(argv), script=__file__)

    # --- the grid, the data (rank 0 trains the tokenizer first), the batches ---------------
    grid = gnnpar.init(**parse_grid_spec(args.grid))
    if grid.global_rank == 0:
        corpus = load_corpus(args.data, args.vocab_size)
    comm.barrier(grid)
    corpus = load_corpus(args.data, args.vocab_size)
    train_tokens, _ = corpus.split(0.05)
    shards = grid.size("data") * grid.size("z")  # the batch is split over data and z
    index = grid.rank("z") + grid.size("z") * grid.rank("data")
    batches = TokenBlocks(train_tokens, args.block_size, args.batch_size, index, shards, args.seed)

    # --- the model: plain GPT -> tensor parallel -> sharded over data -> AdamW -------------
    torch.manual_seed(args.seed)  # the same initial values on every rank
    cfg = GPTConfig(corpus.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)
    model = tensor.parallelize(GPT(cfg), grid)
    dp = shard(model, grid, args.zero_stage, units=by_type(Block))
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=args.lr, weight_decay=0.1))
    ckpt_dir = Path(args.out) / "checkpoints"
    start = 0
    if args.resume:
        found = checkpoint.load(ckpt_dir, grid, dp, opt)  # on any grid
        start = found.step if found is not None else 0

    # --- the loop -----------------------------------------------------------------------------
    rank0 = grid.global_rank == 0
    losses = []
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps,
               disable=not rank0 or args.quiet)  # fmt: skip
    t0 = time.perf_counter()
    schedule = lr_schedule(args)
    for step in bar:
        apply_schedule(opt, schedule, step, args.steps)
        x, y = batches.batch(step)
        loss = tensor.cross_entropy(model(x), y, model.lm_head)  # logits split over vocab
        loss.backward()  # gradients reduced over data (and z) while backward runs
        dp.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        comm.all_reduce(mean, grid, "z", op="avg")
        comm.all_reduce(mean, grid, "data", op="avg")
        losses.append(float(mean))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            checkpoint.save(ckpt_dir, step + 1, grid, dp, opt)
    bar.close()
    seconds = time.perf_counter() - t0
    checkpoint.save(ckpt_dir, args.steps, grid, dp, opt)

    # --- a sample: every rank runs the model, one seeded generator draws the same tokens ----
    text = ""
    if args.sample_tokens:
        head = model.lm_head

        def full(logits):  # the head keeps the vocabulary split: gather it
            sizes = head.out_sizes
            return comm.all_gather(logits.contiguous(), grid, head.out_axis, dim=-1, sizes=sizes)

        ids = torch.tensor([corpus.encode("ROMEO:\n")])
        g = torch.Generator().manual_seed(args.seed)
        split = grid.size(head.out_axis) > 1
        with dp.gathered():
            out = model.generate(ids, args.sample_tokens, temperature=0.8, top_k=50, generator=g,
                                 full_logits=full if split else None)  # fmt: skip
        text = corpus.decode(out[0])
    if rank0:
        tail = losses[-10:]
        mean = sum(tail) / max(len(tail), 1)
        print(f"{grid.describe()}, ZeRO stage {args.zero_stage}: final train loss {mean:.3f} "
              f"after {args.steps} steps, {seconds:.1f} s")  # fmt: skip
        print("--- sample ---\n" + text)
        result = {"losses": losses, "sample": text, "grid": grid.shape, "seconds": seconds}
        os.makedirs(args.out, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps(result))
    gnnpar.shutdown(grid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
