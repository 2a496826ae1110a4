"""Loaded first by `make test` (`-p fast_imports`, before pytest's entry-point plugins).

nbval imports nbformat, nbformat jsonschema, and jsonschema, to offer the "iri" string format,
imports rfc3987_syntax if it is installed (jupyter-events asks for it), which compiles 39 lark
grammars on import: ≈ 1.7 CPU-seconds in each of the suite's processes, the pytest controller and
all six workers at once while they collect. Nothing the suite validates uses that format, so the
test processes do without it (jsonschema skips the format when the import fails).
"""
import sys

sys.modules.setdefault("rfc3987_syntax", None)
