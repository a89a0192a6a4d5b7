"""Fault tolerance for the runtime: detect failures, agree on a generation, regroup, recover, checkpoint.

    server, address = serve_store()                           # the job's store (launcher), loopback by default
    beat = Heartbeat(address, me, incarnation).start()         # every worker
    detector = FailureDetector(address, me).start()
    view = join_job(store, pp, dp, me, detector)               # generation 0
    groups = regroup(store, view, me)                          # world + stage groups of that generation
    ...  executor: wait_work(work, detector.signal); on GenerationAborted or a transfer error:
    groups.close(); view = agree(store, view, me, detector); groups = regroup(store, view, me)
    decision = rollback_decision(CommitLog(store).read(view.members))   # which steps to undo, what to re-run

Modules: `store` (address, keys, launcher env), `membership` (views, heartbeats, detector),
`agreement` (one view per generation, joins), `groups` (process groups per generation),
`transfer` (stage state from a live replica, step snapshots), `checkpoint` (async DCP, safe
restore), `policy` (rollback and lossy decisions, pure), `launch` (survivor-friendly launcher).
"""
