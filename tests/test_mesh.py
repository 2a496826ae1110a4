"""Device meshes: the rank arithmetic, hand-made groups equal DeviceMesh's on real ranks,
collectives along one dimension, the picture, the widget and the chapter's checkers."""
import math

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import mesh as M

# (shape, names) run on real ranks: 2D both ways round, 3D, 1D, a size-1 dimension, odd sizes.
REAL_MESHES = [
    ((2, 4), ("dp", "tp")),
    ((4, 2), ("dp", "tp")),
    ((4, 2), ("tp", "dp")),
    ((2, 2, 2), ("dp", "pp", "tp")),
    ((2, 2, 2), ("tp", "dp", "pp")),
    ((8,), ("dp",)),
    ((1, 8), ("dp", "tp")),
    ((3, 1), ("dp", "tp")),
    ((3, 1, 2), ("pp", "dp", "tp")),
]
IDS = [f"{'x'.join(map(str, s))}-{'.'.join(n)}" for s, n in REAL_MESHES]


def torch_groups(shape, d):
    """An independent reference: move dimension d last in an arange grid; each row is a group."""
    grid = torch.arange(math.prod(shape)).reshape(shape)
    return grid.movedim(d, -1).reshape(-1, shape[d]).tolist()


# ---- the arithmetic ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (5,), (2, 4), (4, 2), (3, 1), (2, 3, 4), (3, 1, 2),
                                   (2, 2, 2, 2)])
def test_coordinate_and_rank_at_match_a_torch_grid(shape):
    grid = torch.arange(math.prod(shape)).reshape(shape)
    for index in torch.cartesian_prod(*[torch.arange(s) for s in shape]).reshape(-1, len(shape)):
        coord = tuple(int(i) for i in index)
        rank = int(grid[coord])
        assert M.coordinate(rank, shape) == coord
        assert M.rank_at(coord, shape) == rank


@pytest.mark.parametrize("shape", [(6,), (2, 4), (4, 2), (3, 1), (1, 3), (2, 3, 4), (3, 1, 2)])
def test_groups_along_every_dimension_match_a_torch_grid(shape):
    names = tuple(f"d{i}" for i in range(len(shape)))
    groups = M.all_groups(shape, names)
    for d, name in enumerate(names):
        expected = sorted(torch_groups(shape, d))
        assert groups[name] == expected
        assert M.groups_along(shape, name, names) == expected
        # Every rank is in exactly one group along each dimension, and it is its peer group.
        assert sorted(r for g in expected for r in g) == list(range(math.prod(shape)))
        for g in expected:
            for r in g:
                assert M.peers(r, shape, d) == g
                assert M.peer_groups(r, shape, names)[name] == g


def test_the_two_groups_of_four_example():
    # 8 ranks, TP inside each group of 4, DP across the two groups.
    groups = M.all_groups((2, 4), ("dp", "tp"))
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # The same 8 ranks with the order swapped: TP peers are no longer neighbours.
    swapped = M.all_groups((4, 2), ("tp", "dp"))
    assert swapped["tp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert swapped["dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_peer_table_lists_every_rank():
    table = M.peer_table((2, 4), ("dp", "tp")).splitlines()
    assert table[0].split() == ["rank", "coordinate", "dp", "group", "tp", "group"]
    assert len(table) == 2 + 8
    assert table[2 + 5].startswith("5") and "[1, 5]" in table[2 + 5] and "[4, 5, 6, 7]" in table[7]


@pytest.mark.parametrize("call, phrase", [
    (lambda: M.check_mesh((2, 0)), "positive whole numbers"),
    (lambda: M.check_mesh((2, 4), ("dp",)), "needs 2 dimension name"),
    (lambda: M.check_mesh((2, 4), ("dp", "dp")), "must be different"),
    (lambda: M.check_mesh((2, 4), ("dp", "tp"), world_size=6), "world_size is 6"),
    (lambda: M.peers(0, (2, 4), "pp", ("dp", "tp")), "no dimension 'pp'"),
    (lambda: M.coordinate(8, (2, 4)), "rank 8 is not in"),
])
def test_bad_meshes_are_refused_in_one_sentence(call, phrase):
    with pytest.raises(ValueError, match=phrase) as info:
        call()
    assert "\n" not in str(info.value)


# ---- real ranks: hand-made groups are DeviceMesh's groups ----------------------------------------

def hand_and_device_mesh(rank, world_size, shape, names):
    hand = M.HandMesh(shape, names)
    mesh = M.device_mesh(shape, names)
    mine = M.mesh_peer_groups(mesh)
    return {
        "hand": hand.ranks, "device_mesh": mine,
        "hand_all": M.gather_all_groups(hand.ranks), "device_mesh_all": M.gather_all_groups(mine),
        "hand_coord": hand.get_coordinate(), "mesh_coord": tuple(mesh.get_coordinate()),
        "hand_local": [hand.get_local_rank(n) for n in names],
        "mesh_local": [mesh.get_local_rank(n) for n in names],
        "submesh": {n: mesh[n].mesh.tolist() for n in names} if len(names) > 1 else
                   {names[0]: mesh.mesh.tolist()},
    }


@pytest.mark.parametrize("shape, names", REAL_MESHES, ids=IDS)
def test_hand_made_groups_are_device_mesh_groups(shape, names):
    results = distlab.run(hand_and_device_mesh, math.prod(shape), shape, names, timeout=120)
    expected_all = {n: sorted(torch_groups(shape, d)) for d, n in enumerate(names)}
    for rank, got in enumerate(results):
        assert got["hand"] == got["device_mesh"] == M.peer_groups(rank, shape, names), rank
        assert got["hand_all"] == got["device_mesh_all"] == expected_all, rank
        assert got["hand_coord"] == got["mesh_coord"] == M.coordinate(rank, shape), rank
        assert got["hand_local"] == got["mesh_local"] == list(M.coordinate(rank, shape)), rank
        assert got["submesh"] == got["device_mesh"], rank


# ---- real ranks: collectives along one dimension ---------------------------------------------

def collectives_along_each_dim(rank, world_size, shape, names):
    hand = M.HandMesh(shape, names)
    mesh = M.device_mesh(shape, names)
    out = {}
    for n in names:
        for label, group in (("hand", hand.get_group(n)), ("mesh", mesh.get_group(n))):
            x = torch.tensor([float(rank), 10.0 * rank + 1])
            dist.all_reduce(x, group=group)
            size = dist.get_world_size(group)
            gathered = [torch.empty(1) for _ in range(size)]
            dist.all_gather(gathered, torch.tensor([float(rank)]), group=group)
            out[label, n] = (x, torch.cat(gathered))
    return out


@pytest.mark.parametrize("shape, names", [REAL_MESHES[0], REAL_MESHES[2], REAL_MESHES[4],
                                          REAL_MESHES[8]],
                         ids=[IDS[0], IDS[2], IDS[4], IDS[8]])
def test_collectives_along_one_dimension(shape, names):
    results = distlab.run(collectives_along_each_dim, math.prod(shape), shape, names,
                          timeout=120)
    for rank, got in enumerate(results):
        for n in names:
            group = M.peer_groups(rank, shape, names)[n]
            expected_sum = torch.tensor([float(sum(group)), sum(10.0 * p + 1 for p in group)])
            expected_gather = torch.tensor(group, dtype=torch.float32)
            for label in ("hand", "mesh"):
                total, gathered = got[label, n]
                assert torch.equal(total, expected_sum), (rank, n, label, total)
                assert torch.equal(gathered, expected_gather), (rank, n, label, gathered)


def only_my_own_groups(rank, world_size):
    # Each rank creates only the group it belongs to: legal with local synchronisation.
    group = dist.new_group(M.peers(rank, (2, 4), "tp", ("dp", "tp")),
                           use_local_synchronization=True)
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=group)
    return x.item()


def test_local_synchronisation_lets_each_rank_build_only_its_groups():
    assert distlab.run(only_my_own_groups, 8, timeout=120) == [6.0] * 4 + [22.0] * 4


# ---- the picture and the widget ------------------------------------------------------------

@pytest.mark.parametrize("shape, names, dim", [((2, 4), ("dp", "tp"), "dp"),
                                               ((2, 2, 2), ("dp", "pp", "tp"), "pp"),
                                               ((8,), ("dp",), "dp"),
                                               ((3, 1, 2), ("pp", "dp", "tp"), "tp")])
def test_picture_colours_each_group_alike_and_groups_apart(shape, names, dim):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    from distlab.viz import mesh as vm
    fig = vm.draw_mesh(shape, names, dim, highlight=1)
    squares = [p for p in fig.axes[0].patches if isinstance(p, FancyBboxPatch)]
    assert len(squares) == math.prod(shape)
    by_rank = {}
    for p in squares:
        x, y = p.get_x(), p.get_y()
        rank = next(r for r in range(math.prod(shape)) if vm.cell_xy(r, shape) == (x, y))
        by_rank[rank] = p
    groups = M.groups_along(shape, dim, names)
    colours = [{tuple(by_rank[r].get_facecolor()[:3]) for r in g} for g in groups]
    assert all(len(c) == 1 for c in colours)             # one colour inside a group
    assert len({next(iter(c)) for c in colours}) == len(groups)  # a different one per group
    outlined = {r for r, p in by_rank.items() if p.get_linewidth() > 1}
    assert outlined == set(M.peers(1, shape, dim, names))
    plt.close(fig)


def test_picture_labels_machines_as_launchers_number_them():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from distlab.viz import mesh as vm
    fig = vm.draw_mesh((4, 2), ("tp", "dp"), "tp", ranks_per_machine=4)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "(1,1)\nm0" in labels and "(2,0)\nm1" in labels   # ranks 3 and 4
    plt.close(fig)


def test_picture_refuses_four_dimensions():
    from distlab.viz import mesh as vm
    with pytest.raises(ValueError, match="1 to 3 dimensions"):
        vm.draw_mesh((2, 2, 2, 2), ("a", "b", "c", "d"), "a")


def test_widget_redraws_when_the_learner_changes_it():
    from distlab.viz import mesh as vm
    w = vm.MeshExplorer(dp=2, pp=1, tp=4, color_by="tp")
    assert w.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tp groups: [0, 1, 2, 3]  [4, 5, 6, 7]" in w.groups.value
    first = w.image.value
    w.color_by.value = "dp"
    assert "dp groups: [0, 4]  [1, 5]  [2, 6]  [3, 7]" in w.groups.value
    assert w.image.value != first
    w.highlight.value = 6
    assert "rank 6: coordinate (1, 0, 2), dp peers [2, 6]" in w.groups.value
    w.order.value = ("tp", "pp", "dp")   # now dp runs across neighbouring ranks
    assert w.mesh == ((4, 1, 2), ("tp", "pp", "dp"))
    assert "dp groups: [0, 1]  [2, 3]  [4, 5]  [6, 7]" in w.groups.value
    w.sizes["tp"].value = 1              # 2 ranks left: the outlined rank 6 is gone
    assert w.highlight.value == -1 and len(w.highlight.options) == 3
    assert "dp groups: [0, 1]" in w.groups.value
    assert repr(w) == "MeshExplorer(tp=1 × pp=1 × dp=2, colour by dp)"


# (workbook 04's checkers are tested in test_ch04.py)


def test_widget_answers_a_front_end_over_the_comm_protocol():
    """Play JupyterLab's part: open the widget in a kernel, move a slider as the browser does
    (a comm_msg 'update'), and receive the redrawn picture and group list back."""
    import queue
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        run_id = kc.execute("from distlab.viz import mesh as vm\ndisplay(vm.MeshExplorer())")
        models, shown = {}, None
        while True:
            m = kc.get_iopub_msg(timeout=120)
            if m["parent_header"].get("msg_id") != run_id:
                continue
            if m["msg_type"] == "comm_open":
                state = m["content"]["data"]["state"]
                models[m["content"]["comm_id"]] = (state["_model_name"], state.get("description"))
            elif m["msg_type"] == "display_data":
                shown = m["content"]["data"]
            elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                break
        view = shown["application/vnd.jupyter.widget-view+json"]["model_id"]
        assert models[view][0] == "VBoxModel"
        assert shown["text/plain"] == "MeshExplorer(dp=2 × pp=1 × tp=4, colour by tp)"
        slider = next(k for k, v in models.items() if v == ("IntSliderModel", "pp"))
        msg = kc.session.msg("comm_msg", {"comm_id": slider, "data": {
            "method": "update", "state": {"value": 2}, "buffer_paths": []}})
        kc.shell_channel.send(msg)
        png, text = None, None
        while png is None or text is None:
            try:
                m = kc.get_iopub_msg(timeout=60)
            except queue.Empty:
                break
            if m["msg_type"] != "comm_msg":
                continue
            kind = models.get(m["content"]["comm_id"], ("?",))[0]
            if kind == "ImageModel" and m["buffers"]:
                png = bytes(m["buffers"][0])
            elif kind == "HTMLModel":
                text = m["content"]["data"]["state"]["value"]
        assert png is not None and png[:4] == b"\x89PNG"
        assert text is not None and "[12, 13, 14, 15]" in text   # 2 × 2 × 4 = 16 ranks now
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
