"""The roofline picture (chapter 00) draws the course's own hardware numbers."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from distlab import hardware as hw  # noqa: E402
from distlab.hardware.overview import flop_per_byte  # noqa: E402
from distlab.viz.roofline import example_kernels, ridge_points, roofline  # noqa: E402


@pytest.mark.parametrize("preset", ["h100-cluster", "a100-cluster"])
def test_ridge_points_are_the_hardware_tables(preset):
    cluster = hw.PRESETS[preset]
    ridges, achieved = ridge_points(cluster)
    want_achieved, want = flop_per_byte(cluster.device, cluster.intra, cluster.inter)
    assert achieved == want_achieved
    assert list(ridges.values()) == want
    assert ridges["HBM"] == pytest.approx(achieved / cluster.device.memory_bandwidth)


def test_default_is_the_h100_with_nvlink4_and_one_ndr_nic():
    ridges, achieved = ridge_points(hw.PRESETS["h100-cluster"])
    assert achieved == flop_per_byte(hw.H100, hw.NVLINK4, hw.IB_NDR)[0]
    assert list(ridges.values()) == flop_per_byte(hw.H100, hw.NVLINK4, hw.IB_NDR)[1]
    ax = roofline()
    assert "H100" in ax.get_title()
    # each roof turns flat at its ridge point: the first x where the line reaches the top
    roofs = [line for line in ax.get_lines() if len(line.get_xdata()) > 2]
    assert len(roofs) == 3
    for line, ridge in zip(roofs, ridges.values()):
        xs, ys = line.get_xdata(), line.get_ydata()
        flat = xs[ys >= achieved]
        assert flat[0] >= ridge and xs[list(xs).index(flat[0]) - 1] < ridge
    plt.close("all")


def test_kernels_sit_under_the_roof():
    device = hw.H100
    ridges, achieved = ridge_points(hw.PRESETS["h100-cluster"])
    kernels = {label: (i, rate) for label, i, rate in example_kernels(device)}
    for intensity, rate in kernels.values():
        assert rate <= min(achieved, intensity * device.memory_bandwidth) * (1 + 1e-9)
    assert kernels["GEMM 8192³"][0] > ridges["HBM"] > kernels["64 tokens"][0]
    assert kernels["elementwise add"][0] == pytest.approx(1 / 6)
