"""Stored widget views can be drawn without a kernel: every widget view a notebook stores has its
model (and every model that model refers to) in the notebook's saved widget state, under the
stable ids tools/regen.py gives them; and that renaming is consistent and reproducible."""
import importlib.util
import random
import uuid
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

ROOT = Path(__file__).resolve().parent.parent
VIEW = "application/vnd.jupyter.widget-view+json"
NOTEBOOKS = sorted(p for folder in ("notebooks", "solutions", "exercises")
                   for p in (ROOT / folder).glob("*.ipynb"))

_spec = importlib.util.spec_from_file_location("regen", ROOT / "tools" / "regen.py")
regen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen)
STATE = regen.WIDGET_STATE


def views_in(outputs):
    """Model ids of the widget views a cell's `outputs` show (views stored inside an Output
    widget's state are found by model_refs)."""
    return [out["data"][VIEW]["model_id"] for out in outputs
            if out.get("output_type") in ("display_data", "execute_result")
            and VIEW in out.get("data", {})]


def model_refs(value):
    """Every model a widget's state names: "IPY_MODEL_<id>" strings and nested view outputs."""
    if isinstance(value, str):
        return [value[len(regen.MODEL_REF):]] if value.startswith(regen.MODEL_REF) else []
    if isinstance(value, list):
        return [ref for v in value for ref in model_refs(v)]
    if isinstance(value, dict):
        found = [value[VIEW]["model_id"]] if VIEW in value else []
        return found + [ref for v in value.values() for ref in model_refs(v)]
    return []


def saved_state(nb):
    return nb.metadata.get("widgets", {}).get(STATE, {}).get("state", {})


@pytest.mark.parametrize("path", NOTEBOOKS,
                         ids=[f"{p.parent.name}/{p.stem[:2]}" for p in NOTEBOOKS])
def test_stored_widget_views_have_saved_state(path):
    nb = nbformat.read(path, as_version=4)
    views = [(i, m) for i, cell in enumerate(nb.cells) for m in views_in(cell.get("outputs", []))]
    state = saved_state(nb)
    where = path.relative_to(ROOT)
    missing = [(i, m) for i, m in views if m not in state]
    assert not missing, (
        f"{where}: cells {sorted({i for i, _ in missing})} show widget views with no saved state "
        "(\"Error displaying widget\" without a kernel): regenerate with tools/regen.py")
    for model_id, saved in state.items():
        assert {"model_name", "model_module", "model_module_version", "state"} <= set(saved), (
            f"{where}: widget model {model_id} is saved without its name, module or state")
        dangling = [ref for ref in model_refs(saved["state"]) if ref not in state]
        assert not dangling, (
            f"{where}: widget model {model_id} ({saved['model_name']}) refers to models that "
            f"are not saved: {dangling}")
    if state:
        assert views, f"{where} saves widget state but shows no widget view"
        name = where.as_posix()
        assert set(state) == {regen.stable_id(name, i) for i in range(len(state))}, (
            f"{where}: widget model ids are not the stable ones tools/regen.py gives "
            "(saved by another tool? every save would rewrite them)")


def _executed_notebook(seed):
    """A notebook as nbclient leaves it: a VBox of a slider and an Output widget whose stored
    outputs show a button, with fresh random model ids each call."""
    rng = random.Random(seed)
    box, slider, layout, out, button = (uuid.UUID(int=rng.getrandbits(128)).hex
                                        for _ in range(5))
    ref = regen.MODEL_REF.__add__

    def model(name, module, state, **extra):
        return {"model_name": name, "model_module": module, "model_module_version": "2.0.0",
                "state": state, **extra}

    view = {"model_id": box, "version_major": 2, "version_minor": 0}
    nb = new_notebook(cells=[
        new_code_cell("box", id="box", execution_count=1, outputs=[new_output(
            "display_data", data={VIEW: view, "text/plain": "VBox(...)"})]),
        new_code_cell("print(1)", id="print", execution_count=2, outputs=[
            new_output("stream", name="stdout", text="1\n"),
            new_output("stream", name="stdout", text="2\n"),
            new_output("stream", name="stderr", text="warning\n"),
            new_output("stream", name="stdout", text="3\n")])])
    nb.metadata.widgets = {STATE: {"version_major": 2, "version_minor": 0, "state": {
        box: model("VBoxModel", "@jupyter-widgets/controls",
                   {"children": [ref(slider), ref(out)], "layout": ref(layout)}),
        slider: model("IntSliderModel", "@jupyter-widgets/controls",
                      {"value": 3, "layout": ref(layout)}),
        layout: model("LayoutModel", "@jupyter-widgets/base", {"width": "300px"}),
        out: model("OutputModel", "@jupyter-widgets/output", {"outputs": [
            {"output_type": "display_data", "metadata": {},
             "data": {VIEW: {"model_id": button, "version_major": 2, "version_minor": 0}}}]}),
        button: model("ButtonModel", "@jupyter-widgets/controls", {"description": "go"},
                      buffers=[{"path": ["icon"], "encoding": "base64", "data": "AAAA"}]),
    }}}
    return nb, [box, slider, layout, out, button]


def test_stable_widget_ids_rename_outputs_and_state_together():
    nb, old = _executed_notebook(seed=1)
    renames = regen.stable_widget_ids(nb, "notebooks/99_x.ipynb")
    new = [regen.stable_id("notebooks/99_x.ipynb", i) for i in range(5)]
    assert renames == dict(zip(old, new))
    assert len(set(new)) == 5 and all(len(i) == 32 and int(i, 16) >= 0 for i in new)
    state = saved_state(nb)
    assert list(state) == new
    assert nb.cells[0].outputs[0].data[VIEW]["model_id"] == new[0]
    assert state[new[0]]["state"]["children"] == [regen.MODEL_REF + new[1],
                                                  regen.MODEL_REF + new[3]]
    assert state[new[1]]["state"]["layout"] == regen.MODEL_REF + new[2]
    assert state[new[3]]["state"]["outputs"][0]["data"][VIEW]["model_id"] == new[4]
    assert state[new[4]]["buffers"][0]["data"] == "AAAA"
    text = nbformat.writes(nb)
    assert not any(i in text for i in old), "an old model id survived the renaming"
    nbformat.validate(nb)


def test_stable_widget_ids_do_not_depend_on_the_kernels_ids():
    """Two runs (different random ids) store the same notebook; another notebook gets others."""
    texts = []
    for seed in (1, 2):
        nb, _ = _executed_notebook(seed)
        regen.stable_widget_ids(nb, "notebooks/99_x.ipynb")
        texts.append(nbformat.writes(nb))
    assert texts[0] == texts[1]
    other, _ = _executed_notebook(1)
    regen.stable_widget_ids(other, "solutions/99_x.ipynb")
    assert set(saved_state(other)).isdisjoint(saved_state(nbformat.reads(texts[0], 4)))
    plain = new_notebook(cells=[new_code_cell("1", id="one", execution_count=1)])
    assert regen.stable_widget_ids(plain, "notebooks/98_y.ipynb") == {}
    assert "widgets" not in plain.metadata


def test_join_streams_merges_only_neighbours_of_one_stream():
    nb, _ = _executed_notebook(seed=3)
    regen.join_streams(nb)
    assert [(o.name, o.text) for o in nb.cells[1].outputs] == [
        ("stdout", "1\n2\n"), ("stderr", "warning\n"), ("stdout", "3\n")]
    assert len(nb.cells[0].outputs) == 1
