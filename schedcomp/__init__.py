"""schedcomp: a fault-tolerant pipeline-parallel schedule compiler (importable without torch).

topology -> route -> order -> lower -> check -> simulate / draw -> execute.
"""

from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.errors import SchedcompError
from schedcomp.ir import InstrKind, Instruction, Op, OpKind, Order, Plan
from schedcomp.simulator import Simulation, simulate
from schedcomp.topology import Topology, Worker

__version__ = "0.1.0"

__all__ = [
    "CostModel",
    "InstrKind",
    "Instruction",
    "Op",
    "OpKind",
    "Order",
    "Plan",
    "SchedcompError",
    "Simulation",
    "Topology",
    "Worker",
    "__version__",
    "compile",
    "simulate",
]
