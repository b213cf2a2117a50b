"""Tests by contract: every recipe `engine.recipes` exports meets each contract (one file each).

recipes.py lists the cases; bounds.py derives the module contract's bound from the element formats; harness.py
launches the gloo processes of the distributed contracts. Run as part of `make test`, or alone with
`python -m pytest tests/conformance`.
"""
