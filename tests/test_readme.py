"""The README's code example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    model = namespace["model"]
    assert model.dsv.current_stage == 2
    assert {layer.last_path for layer in model.dsv.layers} == {"sparse:reference"}
