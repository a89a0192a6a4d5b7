"""A training script for the fault-tolerant launcher: a small GPT that survives failed workers.

    schedcomp precompile --pp 2 --dp 2 --microbatches 4 --max-failures 1 -o plans/   # every plan, once
    python -m schedcomp.runtime.fault.launch --pp 2 --dp 2 --respawn 1 -- \\
        python examples/train_resilient.py --plans plans/ --iterations 20

The launcher starts one process per worker (pipeline:stage) and tells each who it is through the
environment; kill one (`kill -9 PID`) and the survivors agree on the failure, roll back the iteration
in flight, switch to the cached plan for the new failed set and go on; `--respawn 1` starts a
replacement, which receives its stage's state from a live replica and rejoins. The model trained is
exactly the fault-free one: every iteration uses the same global batch whoever runs it, so
`batch_for(i)` must return the same tensors whenever it is called for iteration i.

Precompiled with `--chunks 2` (interleaved placement) or `--chunks 2 --placement v` (ZB-V's), each
worker holds two model chunks (the GPT is cut into pp x 2 stages) and recovery moves both.
"""

from __future__ import annotations

import argparse

import torch

from schedcomp.cache import PlanCache
from schedcomp.runtime import ResilientTrainer
from schedcomp.runtime.gpt import GPTConfig, gpt, lm_loss, synthetic_batch

SEQUENCES_PER_MICROBATCH = 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", required=True, metavar="DIR", help="a plan cache written by `schedcomp precompile`")
    p.add_argument("--iterations", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)

    # The plan for every failure set up to --max-failures, checked (SHA-256, job shape, `check`) as read.
    plans = PlanCache.load(args.plans)
    plans.preload()  # read every plan now, so switching after a failure only renames pipelines
    config = GPTConfig()
    rows = plans.dp * plans.microbatches * SEQUENCES_PER_MICROBATCH  # the global batch: every pipeline's share

    def batch_for(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the whole global batch of `iteration`, the same on every call and rank."""
        return synthetic_batch(config, rows, seed=iteration)

    trainer = ResilientTrainer(
        plans,  # a PlanCache: or any `topology -> Plan`
        gpt(config, seed=0),  # an nn.Sequential cut into pp stages (or `stage_index -> nn.Module`)
        lm_loss,  # (logits, targets) -> the mean loss of one micro-batch, on the last stage
        lambda params: torch.optim.AdamW(params, lr=3e-3),  # one optimizer per stage
        batch_for,
    )
    report = trainer.run(args.iterations)
    if report.losses:  # the last stage's workers: their share of each iteration's mean loss
        last = max(report.losses)
        print(f"worker {report.worker}: {report.iterations} iterations, generation {report.generation}, "
              f"failed {list(report.failed) or 'none'}, loss share at iteration {last}: {report.losses[last]:.4f}",
              flush=True)


if __name__ == "__main__":
    main()
