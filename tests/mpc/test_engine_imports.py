"""The two-party engine's process loads neither torch nor CrypTen (``mpc/__init__.py``: each engine
start paid 1.8 s of CPU for them), because the package's ``__init__`` imports nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded_after(statement: str) -> set[str]:
    code = f"{statement}\nimport sys\nprint(' '.join(sorted(m for m in ('torch', 'crypten', 'jax', 'spu') if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_the_engine_module_loads_no_torch_or_crypten():
    assert _loaded_after("import mpc.spu_process") == set()


def test_the_package_imports_nothing():
    """``import mpc`` alone loads no module of the runtime: names come from their own modules."""
    assert _loaded_after("import mpc") == set()
    import mpc
    assert not hasattr(mpc, "__getattr__")
    with pytest.raises(AttributeError):
        mpc.run_parties  # noqa: B018
