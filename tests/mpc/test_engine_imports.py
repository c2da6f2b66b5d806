"""The two-party engine's process loads neither torch nor CrypTen (``mpc/__init__.py``: each engine
start paid 1.8 s of CPU for them), and the package's documented names still resolve."""

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


@pytest.mark.parametrize("name", ["run_parties", "open_party", "PartyError", "PartyResults", "meter", "LinkProfile"])
def test_the_package_names_resolve(name):
    import mpc
    assert getattr(mpc, name) is not None
    assert name in mpc.__all__


def test_an_unknown_name_is_an_attribute_error():
    import mpc
    with pytest.raises(AttributeError, match="no_such_name"):
        mpc.no_such_name  # noqa: B018
