"""Train a small GPT on Shakespeare (or any text) with 4D hybrid parallelism.

    python examples/train_gpt.py --nprocs 4 --grid data=2,x=2 --steps 300
    torchrun --nproc-per-node 4 examples/train_gpt.py --grid x=2,y=2
    python examples/train_gpt.py --data my_notes.txt --n-layer 4 --n-embd 256 --steps 200
    python examples/train_gpt.py --consolidate ckpt/step-000300 full.pt

The grid is data × x × y × z (x·y·z ranks share each layer, AxoNN's 3D tensor parallelism;
the data axis holds replicas). The model is a plain GPT (gnnpar/nn/gpt.py), made parallel
from the outside by ``tensor.parallelize``; the loop below is the whole training recipe.
Checkpoints are sharded per rank; ``--consolidate`` turns one into a plain state dict.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from gnnpar import checkpoint, tensor
from gnnpar.launch import launch_local, strip_nprocs, under_launcher
from gnnpar.tensor.train import GPTTrainConfig, evaluate, sample, setup, train_step


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Every field of GPTTrainConfig as a flag (``--n-layer``, ``--grid`` ...), plus the
    launcher and output flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", type=int, default=1, help="start this many local processes")
    p.add_argument("--out", help="write the results as JSON here (rank 0)")
    p.add_argument("--threads", type=int, help="intra-op threads per rank")
    p.add_argument(
        "--consolidate",
        nargs=2,
        metavar=("CKPT", "OUT"),
        help="write the full state dict of a sharded checkpoint folder to OUT and exit",
    )
    for f in dataclasses.fields(GPTTrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "top_k":
            p.add_argument(flag, type=int, default=f.default)
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            p.add_argument(flag, type=kind, default=f.default)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.consolidate:
        src, dest = args.consolidate
        torch.save(checkpoint.consolidate(src), dest)
        print(f"wrote the full state dict of {src} to {dest}")
        return 0
    if args.nprocs > 1 and not under_launcher():
        # Relaunch this script on N processes (torchrun's launcher runs `python -m train_gpt`).
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [here, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        return launch_local(args.nprocs, strip_nprocs(argv), script=__file__)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = {f.name for f in dataclasses.fields(GPTTrainConfig)}
    cfg = GPTTrainConfig(**{k: v for k, v in vars(args).items() if k in names})

    # --- set up: grid, data (sharded over data × z), GPT made parallel, AdamW -------------
    s = setup(cfg)
    rank0 = s.grid.global_rank == 0
    if rank0:
        print(
            f"{s.grid.describe()}; GPT of {s.num_params / 1e6:.2f}M parameters, "
            f"{tensor.local_numel(s.model) / 1e6:.2f}M on this rank"
        )
    start = 0
    if cfg.resume and cfg.ckpt_dir:
        found = checkpoint.load(cfg.ckpt_dir, s.grid, s.model, s.optimizer)  # on any grid
        if found is not None:
            start = found.step
            if rank0:
                print(f"resumed from {found.folder}")

    # --- the loop ------------------------------------------------------------------------
    # train_step(s, step) is: set the learning rate; logits = model(x);
    # loss = tensor.cross_entropy(logits, y, model.lm_head); loss.backward();
    # tensor.sync_gradients(model, grid); tensor.clip_grad_norm_(model, clip, grid);
    # optimizer.step()  — see gnnpar/tensor/train.py.
    tokens_per_step = cfg.batch_size * cfg.block_size
    losses, t_first = [], None
    bar = tqdm(
        range(start, cfg.steps),
        initial=start,
        total=cfg.steps,
        disable=not (rank0 and cfg.progress),
    )
    for step in bar:
        loss, norm = train_step(s, step)
        losses.append(loss)
        t_first = t_first or time.perf_counter()  # rate from the end of the first step
        timed = step - start
        rate = tokens_per_step * timed / max(time.perf_counter() - t_first, 1e-9)
        bar.set_postfix(loss=f"{loss:.3f}", grad=f"{norm:.2f}", tok_s=f"{rate:,.0f}")
        if cfg.val_every and (step + 1) % cfg.val_every == 0:
            val = evaluate(s)
            if rank0:
                tqdm.write(f"step {step + 1}: val loss {val:.3f}")
        if cfg.ckpt_dir and cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0:
            checkpoint.save(cfg.ckpt_dir, step + 1, s.grid, s.model, s.optimizer)
    bar.close()

    # --- the end: validation, a checkpoint, a sample ---------------------------------------
    val = evaluate(s)
    if cfg.ckpt_dir:
        checkpoint.save(cfg.ckpt_dir, cfg.steps, s.grid, s.model, s.optimizer)
    text = sample(s) if cfg.sample_tokens else ""
    if rank0:
        print(
            f"final train loss {sum(losses[-10:]) / max(len(losses[-10:]), 1):.3f}, "
            f"val loss {val:.3f}"
        )
        print("--- sample ---\n" + text)
        if args.out:
            result = {
                "config": dataclasses.asdict(cfg),
                "losses": losses,
                "val_loss": val,
                "tokens_per_s": rate if losses else None,
                "sample": text,
            }
            Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
