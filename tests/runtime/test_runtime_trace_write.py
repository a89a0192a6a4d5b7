"""`PipelineTrainer.save_trace` writes through `write_trace`: atomically, a failure naming the path."""

from __future__ import annotations

from pathlib import Path

import pytest
from full_disk import FullDisk

from schedcomp import compile, fileio, simulate
from schedcomp.draw.trace import read_chrome_trace
from schedcomp.errors import RuntimeSetupError
from schedcomp.runtime.trace import write_trace


def test_a_trace_is_written_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spans = list(simulate(compile(2, 1, microbatches=2, schedule="1f1b"), iterations=1).spans)
    path = tmp_path / "run.trace.json"
    write_trace(spans, path)
    old = path.read_bytes()
    assert [(s.worker, s.index, s.instruction) for s in read_chrome_trace(path)] == \
        [(s.worker, s.index, s.instruction) for s in spans]
    monkeypatch.setattr(fileio, "os", FullDisk())
    with pytest.raises(RuntimeSetupError, match=f"cannot write {path}: No space left on device"):
        write_trace(spans[:1], path)
    assert path.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == [path.name]
