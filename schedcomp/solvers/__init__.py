"""Solvers behind the adaptive schedules (see `schedcomp.adaptive`).

- `problem`: the instance (slots, who may run them, durations) numbered densely for speed;
- `greedy`: a memory-aware list scheduler over the compute graph;
- `improve`: local search on its result, scored by the steady-state period;
- `cpsat`: an exact / anytime CP-SAT model (interval per op, periodic objective, proven bound);
- `timing`: the solvers' clock (the simulator's semantics on the compute graph);
- `bounds`: the work-conservation lower bound.
"""
