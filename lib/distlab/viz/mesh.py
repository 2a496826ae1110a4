"""Pictures of device meshes: the ranks as a grid, coloured by their group along one dimension.

`draw_mesh` draws one picture (1, 2 or 3 dimensions); `MeshExplorer` is a widget where the
learner picks the sizes, the dimension order and the dimension to colour, and sees the groups.
"""
import io
import itertools
import math

import ipywidgets as widgets

from ..mesh import _dim, check_mesh, coordinate, groups_along, peers

CELL = 0.9    # a rank's square, in grid units (the rest of the unit is the gap between squares)
PANEL_GAP = 0.8


def _layout(shape):
    """(panels, rows, cols) of the picture: the last dimension runs across, the one before down,
    and the first of three dimensions splits the picture into side-by-side panels."""
    if len(shape) == 1:
        return 1, 1, shape[0]
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if len(shape) == 3:
        return shape
    raise ValueError(f"draw_mesh draws meshes of 1 to 3 dimensions; shape {shape} has "
                     f"{len(shape)}.")


def cell_xy(rank, shape):
    """Bottom-left corner of `rank`'s square in the picture's coordinates."""
    panels, rows, cols = _layout(shape)
    coord = (0,) * (3 - len(shape)) + coordinate(rank, shape)
    panel, row, col = coord
    return panel * (cols + PANEL_GAP) + col, rows - 1 - row


def group_colours(shape, names, color_by):
    """{rank: index of its group along `color_by`} — the colour each rank's square gets."""
    shape, names = check_mesh(shape, names)
    return {r: i for i, group in enumerate(groups_along(shape, color_by, names)) for r in group}


def _palette(n):
    import matplotlib
    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _figsize(shape):
    panels, rows, cols = _layout(shape)
    width = panels * cols + (panels - 1) * PANEL_GAP
    return min(1.2 + 0.8 * width, 14), 1.4 + 0.8 * rows


def draw_mesh(shape, names, color_by, highlight=None, ax=None, ranks_per_machine=None):
    """Draw the mesh; squares of the same colour are one process group along `color_by`.

    highlight: a rank whose group gets a thick outline. ranks_per_machine: label each square
    with its machine (m0, m1, …), numbered as launchers number ranks, and draw a dashed box
    around each machine's ranks. Returns the Figure.
    """
    import matplotlib.patches as patches
    shape, names = check_mesh(shape, names)
    d = _dim(color_by, names)
    panels, rows, cols = _layout(shape)
    n = math.prod(shape)
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=_figsize(shape))
    colour_of = group_colours(shape, names, d)
    palette = _palette(len(set(colour_of.values())))
    outlined = set(peers(highlight, shape, d)) if highlight is not None else set()
    small = 8   # the smallest label the course draws
    for r in range(n):
        x, y = cell_xy(r, shape)
        ax.add_patch(patches.FancyBboxPatch(
            (x, y), CELL, CELL, boxstyle="round,pad=0,rounding_size=0.12",
            facecolor=palette[colour_of[r]], alpha=0.9 if r in outlined or not outlined else 0.45,
            edgecolor="black", linewidth=3 if r in outlined else 0.8))
        ax.text(x + CELL / 2, y + CELL * (0.66 if ranks_per_machine else 0.58), str(r),
                ha="center", va="center", fontsize=13,
                fontweight="bold" if r == highlight else "normal")
        label = str(coordinate(r, shape)).replace(" ", "")
        if ranks_per_machine:      # its own line: "(1,0,3) m1" is wider than a square at 8 pt
            label += f"\nm{r // ranks_per_machine}"
        ax.text(x + CELL / 2, y + CELL * (0.26 if ranks_per_machine else 0.2), label,
                ha="center", va="center", fontsize=small, color="#222222", linespacing=1.1)
    _label_axes(ax, shape, names, panels, rows, cols)
    size = shape[d]
    groups = n // size
    ax.set_title(f"mesh {_shape_text(shape, names)}\n{groups} {names[d]} group"
                 f"{'s' if groups != 1 else ''} of {size} rank{'s' if size != 1 else ''}"
                 f", one colour each"
                 + (f"\nm = machine of {ranks_per_machine} ranks" if ranks_per_machine else ""),
                 fontsize=10)
    width = panels * cols + (panels - 1) * PANEL_GAP
    ax.set_xlim(-0.45, width + 0.05)
    ax.set_ylim(-0.45 if len(shape) == 3 else -0.1, rows + 0.3)
    ax.set_aspect("equal")
    ax.axis("off")
    if ranks_per_machine:
        outline_machines(ax, shape, ranks_per_machine)
    return ax.figure


def outline_machines(ax, shape, ranks_per_machine):
    """A dashed box around each machine's ranks, named on its right: launchers number ranks
    machine by machine, so a machine is a run of consecutive ranks."""
    import matplotlib.patches as patches
    n = math.prod(shape)
    for m in range(math.ceil(n / ranks_per_machine)):
        cells = [cell_xy(r, shape)
                 for r in range(m * ranks_per_machine, min(n, (m + 1) * ranks_per_machine))]
        x0, y0 = min(x for x, _ in cells) - 0.05, min(y for _, y in cells) - 0.05
        x1, y1 = max(x for x, _ in cells) + CELL + 0.05, max(y for _, y in cells) + CELL + 0.05
        ax.add_patch(patches.Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, linestyle="--",
                                       linewidth=1.8, edgecolor="#333333"))
        ax.text(x1 + 0.08, (y0 + y1) / 2, f"machine {m}", rotation=90, ha="left", va="center",
                fontsize=9)
    left, right = ax.get_xlim()
    ax.set_xlim(left, right + 0.45)


def _label_axes(ax, shape, names, panels, rows, cols):
    across, down = names[-1], (names[-2] if len(shape) >= 2 else None)
    ax.text(0, rows + 0.02, f"{across} →", ha="left", va="bottom", fontsize=9, style="italic")
    if down is not None:
        ax.text(-0.1, rows - 0.5, f"{down}\n↓", ha="right", va="center", fontsize=9,
                style="italic")
    if len(shape) == 3:
        for p in range(panels):
            ax.text(p * (cols + PANEL_GAP) + (cols - 1 + CELL) / 2, -0.25, f"{names[0]} = {p}",
                    ha="center", va="center", fontsize=9, style="italic")


def _shape_text(shape, names):
    return " × ".join(f"{n}={s}" for n, s in zip(names, shape))


def groups_text(shape, names, color_by, highlight=None):
    """The groups along `color_by` as text lines (what the picture shows, for reading)."""
    shape, names = check_mesh(shape, names)
    d = _dim(color_by, names)
    lines = [f"{names[d]} groups: " + "  ".join(str(g) for g in groups_along(shape, d))]
    if highlight is not None:
        lines.append(f"rank {highlight}: coordinate {coordinate(highlight, shape)}, "
                     f"{names[d]} peers {peers(highlight, shape, d)}")
    return "\n".join(lines)


def render_png(shape, names, color_by, highlight=None, dpi=80, format="png"):
    """The picture as PNG bytes, drawn without pyplot so nothing else appears in the notebook.
    format="svg": vector (sharp at any size; what the explorer shows)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=_figsize(tuple(shape)))
    FigureCanvasAgg(fig)
    draw_mesh(shape, names, color_by, highlight, ax=fig.add_subplot())
    buffer = io.BytesIO()
    fig.savefig(buffer, format=format, dpi=dpi, bbox_inches="tight",
                metadata={"Date": None} if format == "svg" else None)
    return buffer.getvalue()


class MeshExplorer(widgets.VBox):
    """Pick the size of dp, pp and tp, their order and the dimension to colour; see the groups.

    Everything is drawn in the kernel into an Image widget, so it works in JupyterLab and
    in any front end that shows widgets, with no interactive matplotlib backend.
    """

    DIMS = ("dp", "pp", "tp")

    def __init__(self, dp=2, pp=1, tp=4, order=("dp", "pp", "tp"), color_by="tp",
                 max_size=4):
        style = {"description_width": "initial"}
        self.sizes = {n: widgets.IntSlider(value=v, min=1, max=max_size, description=n,
                                           continuous_update=False, style=style)
                      for n, v in zip(self.DIMS, (dp, pp, tp))}
        self.order = widgets.Dropdown(
            options=[(" × ".join(p), p) for p in itertools.permutations(self.DIMS)],
            value=tuple(order), description="order (last = neighbouring ranks)", style=style,
            layout=widgets.Layout(width="420px"))  # the label and "dp × pp × tp" both fit
        self.color_by = widgets.ToggleButtons(options=self.DIMS, value=color_by,
                                              description="colour groups along", style=style)
        self.highlight = widgets.Dropdown(description="outline rank", style=style,
                                          layout=widgets.Layout(width="200px"))
        # Drawn at twice the pixels it is shown with (sharp on any screen), at its natural size
        # (never stretched to the output's width), at most about a screen high.
        self.image = widgets.Image(format="png", layout=widgets.Layout(
            align_self="flex-start", max_width="100%", max_height="70vh"))
        self.groups = widgets.HTML()
        super().__init__([widgets.HBox(list(self.sizes.values())),
                          widgets.HBox([self.order, self.highlight]),
                          self.color_by, self.image, self.groups])
        for w in [*self.sizes.values(), self.order, self.color_by, self.highlight]:
            w.observe(self._changed, names="value")
        self._updating = False
        self.update()

    @property
    def mesh(self):
        """(shape, names) currently chosen."""
        names = self.order.value
        return tuple(self.sizes[n].value for n in names), names

    def _changed(self, _):
        if not self._updating:
            self.update()

    def update(self):
        shape, names = self.mesh
        n = math.prod(shape)
        self._updating = True  # resetting the rank list must not redraw halfway
        try:
            options = [("none", -1)] + [(str(r), r) for r in range(n)]
            keep = self.highlight.value if self.highlight.value in range(n) else -1
            if list(self.highlight.options) != options:
                self.highlight.options = options
            self.highlight.value = keep
        finally:
            self._updating = False
        color_by = self.color_by.value
        keep = None if self.highlight.value == -1 else self.highlight.value
        png = render_png(shape, names, color_by, keep, dpi=2 * 96)
        self.image.width = str(int.from_bytes(png[16:20], "big") // 2)  # IHDR: the width
        self.image.value = png
        text = groups_text(shape, names, color_by, keep)
        self.groups.value = f"<pre style='line-height:1.3'>{text}</pre>"

    def _repr_mimebundle_(self, **kwargs):
        """The widget, plus a PNG of what it shows now for front ends that cannot run widgets
        (a static page: the notebook as stored)."""
        from matplotlib.figure import Figure

        from ._fallback import figure_png
        data = super()._repr_mimebundle_(**kwargs)
        if data and "image/png" not in data:
            import base64
            shape, names = self.mesh
            fig = Figure(figsize=_figsize(tuple(shape)))
            keep = None if self.highlight.value == -1 else self.highlight.value
            draw_mesh(shape, names, self.color_by.value, keep, ax=fig.add_subplot())
            data["image/png"] = base64.b64encode(figure_png(fig)).decode("ascii")
        return data

    def __repr__(self):
        shape, names = self.mesh
        return f"MeshExplorer({_shape_text(shape, names)}, colour by {self.color_by.value})"
