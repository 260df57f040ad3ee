"""Figures are written whole or not at all."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from dsv.analysis.figures import save_figure  # noqa: E402


def test_a_figure_cut_short_leaves_the_earlier_one_and_no_leftovers(tmp_path):
    """savefig wrote in place: a crash halfway left a broken PNG beside the report it belonged to."""
    path = tmp_path / "plot.png"
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_figure(fig, path)
    earlier = path.read_bytes()
    assert earlier.startswith(b"\x89PNG")

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])

    def cut_short(target, **kwargs):
        with open(target, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    fig.savefig = cut_short
    with pytest.raises(OSError, match="No space left"):
        save_figure(fig, path)
    assert path.read_bytes() == earlier and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    assert not plt.get_fignums()  # closed either way
