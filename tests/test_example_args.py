"""Issue 17 item 8: `examples/train_gpt.py`'s argument errors name the argument and the accepted forms
(`--mesh 4` was a bare IndexError)."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


@pytest.mark.parametrize("argv,says", [
    (["--mesh", "4"], ["argument --mesh", "DATAxTENSOR", "'4'", "4x1", "1x4"]),
    (["--mesh", "2x0"], ["argument --mesh", "DATAxTENSOR", "'2x0'"]),
    (["--mesh", "2by2"], ["argument --mesh", "DATAxTENSOR"]),
    (["--steps", "0"], ["argument --steps", "positive"]),
])
def test_bad_arguments_name_the_argument(argv, says):
    r = subprocess.run([sys.executable, str(SCRIPT)] + argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    for s in says:
        assert s in r.stderr, (s, r.stderr)
