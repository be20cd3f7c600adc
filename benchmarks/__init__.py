"""berth's benchmarks. The reference data they and the tests score against live in the repository,
each file with its provenance (benchmarks/data/reference/PROVENANCE.md)."""

from pathlib import Path

REFERENCE = Path(__file__).resolve().parent / "data" / "reference"
