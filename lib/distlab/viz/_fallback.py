"""A widget's output that still shows something where no kernel runs (a static page, GitHub,
nbviewer, the course's site): the widget's own MIME bundle plus a PNG of its default view.

Front ends that run widgets (JupyterLab with a kernel) prefer the widget view; the others skip
it (it has no state there) and show the picture, whose footer says to run the cell. nbval never
compares PNGs, so stored outputs stay deterministic.
"""
import io

NOTE = "Picture of the default view: run this cell in Jupyter to interact."


def figure_png(fig, dpi=100, note=NOTE):
    """PNG bytes of a matplotlib Figure (no pyplot), with `note` as a footer line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)
    if note:
        fig.text(0.01, 0.0, note, fontsize=8, style="italic", color="#555555",
                 ha="left", va="top")  # under the figure: bbox_inches="tight" keeps it
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight", pad_inches=0.15)
    return buffer.getvalue()


def bundle(widget, png):
    """The widget's display bundle with `png` (bytes) added as its static fallback."""
    import base64
    data = widget._repr_mimebundle_()
    data = dict(data[0] if isinstance(data, tuple) else data)
    data["image/png"] = base64.b64encode(png).decode("ascii")
    return data


def display_widget(widget, png):
    """display() the widget so that it renders live, or as `png` where widgets cannot run."""
    from IPython.display import display
    display(bundle(widget, png), raw=True)
