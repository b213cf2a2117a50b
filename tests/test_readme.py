"""The README's Python examples run as written."""

import re
from pathlib import Path

from engine.tensors import QuantizedTensor

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_every_readme_example_runs_and_makes_quantized_tensors():
    examples = readme_examples()
    assert len(examples) >= 2
    for code in examples:
        namespace: dict = {}
        exec(compile(code, str(README), "exec"), namespace)
        assert any(isinstance(v, QuantizedTensor) for v in namespace.values()), code[:80]
