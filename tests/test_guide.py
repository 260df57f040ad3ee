"""docs/guide.md runs as written: its Python blocks are executed in order and their results checked."""

import math
import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
DIFFUSERS_HEADING = "## The diffusers path"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def run_blocks(blocks: list[str]) -> dict:
    namespace: dict = {"__name__": "guide"}
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)
    return namespace


def sections() -> tuple[str, str]:
    text = GUIDE.read_text()
    assert DIFFUSERS_HEADING in text, f"the guide lost its '{DIFFUSERS_HEADING}' section"
    core, diffusers = text.split(DIFFUSERS_HEADING)
    return core, diffusers


def test_every_code_block_is_python():
    # Only ```python blocks are executed; any other fenced block would go untested.
    fences = re.findall(r"^```(\w*)$", GUIDE.read_text(), flags=re.M)
    languages = fences[0::2]  # opening fences; closing ones are bare
    assert languages and set(languages) == {"python"}, languages


def test_guide_core_sections_run():
    core, _ = sections()
    blocks = python_blocks(core)
    assert len(blocks) == 4
    ns = run_blocks(blocks)
    model, summary = ns["model"], ns["summary"]
    # The three lines: the controller switched to stage 2 and every block ran the sparse path.
    assert summary["stage"] == 2 and 0 < summary["switch_step"] <= 4
    assert [layer.last_path for layer in model.dsv.layers] == ["sparse:reference"] * 2
    assert all(layer["predictor_loss"] is not None and None not in layer["sparsity"]
               for layer in summary["layers"])
    # The observer measured every layer's per-head sparsity.
    assert sorted(ns["measured"]) == [0, 1]
    assert all(values.shape == (4,) and ((values >= 0) & (values <= 1)).all() for values in ns["measured"].values())
    # The cube comparison gave a mass per candidate, below 1 at the partial budget and 1 with all keys.
    assert list(ns["masses"]) == [(1, 2, 2), (2, 2, 2), (2, 4, 4)]
    assert all(0.0 < m < 0.999 for m in ns["masses"].values())
    every_key = ns["torch"].zeros(ns["q_raster"].shape[1])
    all_kept = ns["selection_mass"](ns["q_raster"], ns["k_raster"], (4, 8, 8), (2, 4, 4), every_key, ns["rows"])
    assert math.isclose(float(all_kept.mean()), 1.0, rel_tol=1e-5)


def test_guide_diffusers_section_runs():
    pytest.importorskip("diffusers", reason="the diffusers section needs `pip install 'dsv[integrations]'`")
    _, diffusers = sections()
    blocks = python_blocks(diffusers)
    assert len(blocks) == 1
    ns = run_blocks(blocks)
    controller, reloaded = ns["controller"], ns["reloaded"]
    assert controller.current_stage == 2
    assert [layer.last_path for layer in controller.layers] == ["sparse:reference"] * 2
    assert reloaded.dsv_controller.current_stage == 2
    assert reloaded.dsv_controller.summary()["layers"][0]["sparsity"] == controller.summary()["layers"][0]["sparsity"]
