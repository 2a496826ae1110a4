"""Sphinx configuration of the course's site: `make book` (see docs/README.md).

The source folder is the repository's root (so the README's links work unchanged); this file
lives in docs/ and `sphinx-build -c docs` points at it. Nothing is executed: the chapters are
shown with the outputs stored in them, as nbval checks them.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

project = "distlab"
author = "the distlab authors"
copyright = "the distlab authors"

extensions = ["myst_nb"]
root_doc = "README"                       # the README's overview is the front page
include_patterns = ["README.md", "CONTRIBUTING.md", "INSTRUCTORS.md",
                    "notebooks/*.ipynb", "exercises/*.ipynb"]
exclude_patterns = ["docs/_build", ".venv", "**/.ipynb_checkpoints"]

# Notebooks: stored outputs only (never run here: the course's outputs come from real runs).
nb_execution_mode = "off"
# Widgets: every course widget also stores a PNG of its default view with a "run this cell to
# interact" line (distlab/viz/_fallback.py); the site shows that picture. The notebooks do save
# their widget state (tools/regen.py, for JupyterLab and nbviewer), but drawing it here would
# load @jupyter-widgets/html-manager and RequireJS from a CDN on every chapter page (a site
# that needs the network to show a picture it already has), and the controls it drew would do
# nothing without a kernel. So no widget view, no CDN scripts, and no state blob in the pages.
nb_mime_priority_overrides = [
    (builder, "application/vnd.jupyter.widget-view+json", None)
    for builder in ("html", "dirhtml", "singlehtml", "readthedocs", "linkcheck")
]
nb_ipywidgets_js = {}
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

html_theme = "sphinx_book_theme"
html_title = "distlab: distributed training in PyTorch, run for real"
html_theme_options = {
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "use_download_button": True,      # each page's .ipynb: the exercises, downloadable
    "use_fullscreen_button": False,
}
# docs/_static/distlab.css: code cells wrap at the content width (see the file for why).
html_static_path = ["_static"]
html_css_files = ["distlab.css"]
html_show_sourcelink = False

# Internal links are checked by the build (`make book` runs with -W --keep-going: a missing
# document, anchor or image is an error).
nitpicky = True


def _chapters(folder):
    return [f"{folder}/{p.stem}" for p in sorted((ROOT / folder).glob("*.ipynb"))]


def _toctree(caption, entries):
    return ("\n\n```{toctree}\n:hidden:\n:maxdepth: 1\n"
            f":caption: {caption}\n\n" + "\n".join(entries) + "\n```\n")


def _add_navigation(app, docname, source):
    """The front page is the README as it stands; the site's navigation is appended here so
    the README itself stays plain Markdown for GitHub."""
    if docname != root_doc:
        return
    workbooks = "\n".join(
        f"- [{Path(name).stem}]({name}.ipynb)" for name in _chapters("exercises"))
    source[0] += ("\n\n## Workbooks\n\nOne per chapter, to fill in and check (download the "
                  "notebook with the button at the top of its page):\n\n" + workbooks + "\n"
                  + _toctree("Chapters", _chapters("notebooks"))
                  + _toctree("Workbooks", _chapters("exercises"))
                  + _toctree("Teaching the course", ["INSTRUCTORS", "CONTRIBUTING"]))


def _index_page(app, exception):
    """index.html for static hosts: the front page is README.html."""
    if exception is None and app.builder.format == "html":
        (Path(app.outdir) / "index.html").write_text(
            '<!DOCTYPE html><meta charset="utf-8"><title>distlab</title>'
            '<meta http-equiv="refresh" content="0; url=README.html">'
            '<a href="README.html">distlab</a>\n')


def _drop_widget_state(app, doctree):
    """myst-nb embeds a notebook's saved widget state in its page (for the CDN scripts turned
    off above); without a widget view to draw it is dead weight: leave it out."""
    pages = getattr(app.env, "nb_metadata", {})
    if app.env.docname in pages:
        pages[app.env.docname].get("js_files", {}).pop("ipywidgets_state", None)


def setup(app):
    app.connect("source-read", _add_navigation)
    app.connect("doctree-read", _drop_widget_state)
    app.connect("build-finished", _index_page)
