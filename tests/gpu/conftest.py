"""The GPU suite: skipped where CUDA is absent; tests needing several GPUs skip below that many.

Run it with `tests/gpu/run.sh` on a GPU machine (it sets up imports without installing and
records the results). The shared test helpers (`dist_audit`, `momentum`, `fault_procs`,
`resilient_procs`) live in tests/support; this suite may run without tests/conftest.py (which
needs hypothesis), so it puts tests/support on the path itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))
