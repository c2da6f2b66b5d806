"""Every Python example in README.md runs as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
# whole programs only: a block indented inside a list item is a fragment (README's CrypTen notes)
EXAMPLES = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index, tmp_path):
    script = tmp_path / f"example_{index}.py"
    script.write_text(EXAMPLES[index])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensor(" in proc.stdout  # each example prints the opened result
