import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "actors_pipeline.py"


def test_actors_pipeline_example_runs():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "results: [1, 4, 9, 16, 25]" in out
    assert "worker restarts: 1" in out
    assert "retrying" in out
    assert "pipeline shut down cleanly" in out
