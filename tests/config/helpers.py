"""Paths shared by the config tests."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
REPO_ROOT = Path(__file__).resolve().parents[2]


def fixture_files(group: str) -> list[Path]:
    return sorted((FIXTURES / group).glob("*.json"))
