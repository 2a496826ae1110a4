"""The course's pictures keep two promises: no text under 8 pt (a label readers must squint at
teaches nothing; the site shows the PNGs at their stored size), and one meaning for red in a
trace timeline, stated in its legend: a rank blocked inside a call, its own transfer included."""
import ast
from pathlib import Path

import matplotlib
matplotlib.use("Agg")

VIZ = Path(__file__).resolve().parent.parent / "lib" / "distlab" / "viz"


def test_no_label_under_8_points():
    small = []
    for path in sorted(VIZ.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg in ("fontsize", "size", "labelsize"):
                v = node.value
                if isinstance(v, ast.Constant) and isinstance(v.value, (int, float)) and v.value < 8:
                    small.append(f"{path.name}:{v.lineno} {node.arg}={v.value}")
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and "small" in t.id
                                                    for t in node.targets):
                for c in ast.walk(node.value):
                    if isinstance(c, ast.Constant) and isinstance(c.value, (int, float)) \
                            and c.value < 8:
                        small.append(f"{path.name}:{c.lineno} {ast.unparse(node)}")
    assert not small, "text under 8 pt: " + ", ".join(small)


def test_the_timeline_legend_says_what_red_means():
    import matplotlib.pyplot as plt
    from distlab.viz import trace as viz_trace
    ax = viz_trace.timeline(_Empty())
    legend = ax.get_legend()
    by_colour = {matplotlib.colors.to_hex(h.get_facecolor()): t.get_text()
                 for h, t in zip(legend.legend_handles, legend.texts)}
    plt.close("all")
    red = by_colour[matplotlib.colors.to_hex(viz_trace.WAIT)]
    assert "blocked in a call" in red and "transfer" in red, red


class _Empty:
    """A trace with one rank and nothing in it: the legend is drawn all the same."""
    world_size, emulated, source = 1, None, None

    def end(self):
        return 1e-3

    def compute(self, r):
        return []

    def comm(self, r):
        return []
