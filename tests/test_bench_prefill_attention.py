"""benchmarks/bench_prefill_attention.py on small CPU cases: its paths agree, and the
report and JSON hold every case (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_prefill_attention as bpa


@pytest.mark.parametrize("geometry", ["tiny", "llama3.2-1b"])
def test_paths_agree_and_every_case_is_reported(geometry: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prefill.json"
    bpa.main(["--geometries", geometry, "--cases", "0+40", "37+21", "--repeats", "1",
              "--page-size", "8", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prefix"], r["extend"]) for r in rows] == [(0, 40), (37, 21)]
    for r in rows:  # bfloat16 where a GPU runs the 1B geometry
        tol = 1e-4 if r["dtype"] == "float32" else 3e-2
        assert r["engine_max_err"] < tol and r["masked_max_err"] < tol
        assert r.get("kernel_max_err", 0.0) < tol  # the CPU kernel, where it builds
        assert min(r["engine_s"], r["masked_s"], r["contiguous_s"]) > 0
    assert "| 37 + 21 |" in capsys.readouterr().out
