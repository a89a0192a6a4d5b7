"""The torch runtime: execute compiled plans with one process per live worker (the only package importing torch).

    trainer = PipelineTrainer(plan, build_stage, loss_fn, make_optimizer)
    for batch in batches:
        loss = trainer.step(batch)      # returns at once; float(loss) waits for every rank

Resilient jobs (issue 5): `ResilientTrainer(plan_cache, build_stage, loss_fn, make_optimizer,
batch_for).run(iterations)` under `python -m schedcomp.runtime.fault.launch` (see `resilient`).
See `trainer.PipelineTrainer` for the contract, `comm` for the rank <-> worker mapping,
`splitgrad` for the split backward and `executor` for the instruction semantics.
"""

from schedcomp.runtime.comm import RankMap
from schedcomp.runtime.resilient import ResilientTrainer
from schedcomp.runtime.splitgrad import WeightGradStore, enable_split_backward
from schedcomp.runtime.stage import Stage, even_split
from schedcomp.runtime.trainer import Loss, PipelineTrainer

__all__ = ["Loss", "PipelineTrainer", "RankMap", "ResilientTrainer", "Stage", "WeightGradStore",
           "enable_split_backward", "even_split"]
