"""The embedded training-loop API in one page: train the small GPT on a compiled plan.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py                # pp=2 dp=2, zb-h1
    torchrun --standalone --nproc-per-node 3 examples/train_gpt.py --fail 1:1    # adaptive, 1:1 down

Every process compiles the same plan (compilation is deterministic), builds only its own stage
(rank i runs the plan's i-th live worker) and calls `trainer.step(batch)` with the same global
batch. `python -m schedcomp.runtime.demo` does the same and also draws the plan and launches torchrun.
"""

from __future__ import annotations

import argparse

import torch

from schedcomp.cli.common import add_failure_arguments
from schedcomp.compiler import compile
from schedcomp.runtime import PipelineTrainer
from schedcomp.runtime.gpt import GPTConfig, gpt, lm_loss, synthetic_batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    add_failure_arguments(p)  # --fail D:S (repeat it) or --failed D:S D:S, as in every schedcomp command
    p.add_argument("--iterations", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)

    schedule = "adaptive" if args.failed else "zb-h1"
    plan = compile(args.pp, args.dp, microbatches=args.microbatches, failed=args.failed, schedule=schedule)
    config = GPTConfig()
    trainer = PipelineTrainer(
        plan,
        gpt(config, seed=0),  # an nn.Sequential: cut into pp stages (or pass `stage_index -> nn.Module`)
        lm_loss,  # (logits, targets) -> mean loss of one micro-batch, on the last stage
        lambda params: torch.optim.AdamW(params, lr=3e-3),  # one optimizer per stage
    )
    rows = args.dp * args.microbatches * 4  # 4 sequences per micro-batch
    losses = [trainer.step(synthetic_batch(config, rows, seed=i)) for i in range(args.iterations)]
    # Reading a loss waits for every rank to finish that iteration: read them at the end (or a step late).
    if trainer.rank == 0:
        print(" ".join(f"{float(loss):.3f}" for loss in losses))
    trainer.close()


if __name__ == "__main__":
    main()
