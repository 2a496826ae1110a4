"""The real-browser test runs only under `make test-browser` (DISTLAB_BROWSER_TEST=1): it needs
Chromium and playwright, and minutes of JupyterLab. `make test` does not collect it."""
import os

if not os.environ.get("DISTLAB_BROWSER_TEST"):
    collect_ignore_glob = ["test_*.py"]
