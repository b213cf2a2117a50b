"""The README's Python examples run as written."""

import re
from pathlib import Path

import torch

from engine.inference import QuantizedWeight
from engine.modules import FP8Module
from engine.tensors import QuantizedTensor

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def made_fp8_things(value) -> bool:
    if isinstance(value, QuantizedTensor):
        return True
    return isinstance(value, torch.nn.Module) and (any(isinstance(m, FP8Module) for m in value.modules())
                                                   or any(isinstance(p, QuantizedWeight) for p in value.parameters()))


def test_every_readme_example_runs_and_makes_quantized_tensors_or_fp8_modules():
    examples = readme_examples()
    assert len(examples) >= 3
    for code in examples:
        namespace: dict = {}
        exec(compile(code, str(README), "exec"), namespace)
        assert any(made_fp8_things(v) for v in namespace.values()), code[:80]
