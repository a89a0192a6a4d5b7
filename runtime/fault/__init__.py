"""Fault tolerance for the runtime: detect failures, agree on a generation, regroup, recover, checkpoint.

Start a job with `python -m schedcomp.runtime.fault.launch` (see `launch` for one host and
several); each worker drives its membership through a `FaultSession` (see `session` for the
training loop around it):

- `store`: where the job's store listens (loopback unless told otherwise), its keys, the
  launcher's environment (`WorkerEnv`).
- `membership`: `View` (generation + failed set), `Heartbeat`, `FailureDetector`, `wait_work`.
- `agreement`: one view per generation for every survivor; joins; commit records.
- `protocol`: the agreement's steps and the meetings of a change of generation, one store
  operation per step (what `tests/fault/test_fault_protocol.py` model-checks); every wait in them
  gives up when the failure detector finds a member dead, and past the agreement timeout
  (`RecoveryTimeout`: `AgreementTimeout`, `MeetingTimeout`; the worker then leaves the job).
- `groups`: process groups per generation on `PrefixStore(f"gen{G}")`, without the dead; their
  construction gives up when the generation breaks (`Abort`).
- `transfer`: stage state as plain data: replica recovery, step snapshots for undo.
  `chunks`: the same for every model chunk a worker holds (virtual stages), keyed by virtual stage.
- `checkpoint`: asynchronous per-stage DCP checkpoints, restored without trusting pickles;
  `checkpoint_check`: everything a restore checks first (manifest, layout), `checkpoint_storage`:
  DCP's metadata and the stored bytes' digests; `checkpoint_layers` (`checkpoint_layers_check`): the
  same per layer for an `nn.Sequential` model, written under any cut and restored into any other.
- `launch_args`: the launcher's command line, checked whole before anything starts;
  `launch_hosts`: the job's store it serves or reaches, and what it does when hosts part.
- `restart`: checkpoints while training and a restart of the whole job when a stage is lost
  (`CheckpointPolicy`, passed to `ResilientTrainer(checkpoint=...)`).
- `recovery`: the recovery-policy interface `ResilientTrainer` calls (`RecoveryPolicy`, with
  `RollbackPolicy` and `RestartPolicy`; `runtime.lossy.LossyPolicy`); its docstring says how to
  add one. `rollback`: the rollback decision and `residual`: what survivors finish under the
  lossy policy (pure functions).
- `worker_start`: how a `ResilientTrainer` worker starts (joins, builds its trainer, restores or
  receives its state); `plan_source`: the plans it asks for and what its policy refuses of them;
  `switches`: what it does between iterations (recover, admit replacements, take a better plan).
"""

from schedcomp.runtime.fault.agreement import AgreementTimeout, CommitLog, Evicted, agree, join_job, switch_iteration
from schedcomp.runtime.fault.groups import Generation, Graveyard, Groups, regroup
from schedcomp.runtime.fault.membership import FailureDetector, GenerationAborted, Heartbeat, View, wait_work
from schedcomp.runtime.fault.protocol import MeetingTimeout, RecoveryTimeout
from schedcomp.runtime.fault.recovery import RecoveryPolicy, RestartPolicy, RollbackPolicy
from schedcomp.runtime.fault.restart import CheckpointPolicy
from schedcomp.runtime.fault.rollback import Rollback, rollback_decision
from schedcomp.runtime.fault.session import FaultSession
from schedcomp.runtime.fault.store import StoreAddress, WorkerEnv, serve_store
from schedcomp.runtime.fault.transfer import StepSnapshot, recv_stage_state, send_stage_state

__all__ = [
    "AgreementTimeout",
    "CheckpointPolicy",
    "CommitLog",
    "Evicted",
    "FailureDetector",
    "FaultSession",
    "Generation",
    "GenerationAborted",
    "Graveyard",
    "Groups",
    "Heartbeat",
    "MeetingTimeout",
    "RecoveryPolicy",
    "RecoveryTimeout",
    "RestartPolicy",
    "Rollback",
    "RollbackPolicy",
    "StepSnapshot",
    "StoreAddress",
    "View",
    "WorkerEnv",
    "agree",
    "join_job",
    "recv_stage_state",
    "regroup",
    "rollback_decision",
    "send_stage_state",
    "serve_store",
    "switch_iteration",
    "wait_work",
]
