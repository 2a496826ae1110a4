"""Holistic Trace Analysis as a referee: its tests run in `make test`, which installs it (the
[hta] extra). A missing HTA fails them, since a referee that skipped would judge nothing; only
DISTLAB_NO_HTA=1 (HTA deliberately absent, e.g. a machine without pandas) skips them."""
import importlib
import os

import pytest

WHY = ("HolisticTraceAnalysis is not installed: `make test` installs it (the [hta] extra, "
       "`pip install -e '.[hta]'`); set DISTLAB_NO_HTA=1 to skip its referee tests on purpose.")


def require_hta():
    """hta.trace_analysis, or the test fails saying how to get it (skips under DISTLAB_NO_HTA=1)."""
    try:
        return importlib.import_module("hta.trace_analysis")
    except ImportError:
        if os.environ.get("DISTLAB_NO_HTA") == "1":
            pytest.skip("DISTLAB_NO_HTA=1: HolisticTraceAnalysis deliberately absent")
        pytest.fail(WHY, pytrace=False)
