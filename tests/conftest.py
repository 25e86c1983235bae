"""The main suite's session plugins: tests/suite_budget.py (time per module, the suite's budget)."""

from suite_budget import pytest_configure

__all__ = ["pytest_configure"]
