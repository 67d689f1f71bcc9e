"""bench/compare_runs.py over the three real `make run` outputs kept in docs/bench/make-run-2026-12-01."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench import compare_runs

KEPT = Path(__file__).resolve().parents[2] / "docs" / "bench" / "make-run-2026-12-01"


def _run_folder(root: Path, i: int, *, after: float | None = None) -> Path:
    run = root / f"run{i}"
    (run / "trainer").mkdir(parents=True)
    summary = json.loads((KEPT / f"run{i}_summary.json").read_text())
    if after is not None:
        summary["eval_after"]["accuracy_final"] = after
    (run / "summary.json").write_text(json.dumps(summary))
    shutil.copyfile(KEPT / f"run{i}_settings.json", run / "settings.json")
    shutil.copyfile(KEPT / f"run{i}_metrics.jsonl", run / "trainer" / "metrics.jsonl")
    return run


def test_table_plot_and_copies_from_real_runs(tmp_path, capsys):
    runs = [_run_folder(tmp_path, i) for i in (1, 2, 3)]
    out, png = tmp_path / "out", tmp_path / "runs.png"
    compare_runs.main([*map(str, runs), "--out", str(out), "--png", str(png)])
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ") or line.startswith("| 3 ")]
    assert len(rows) == 3
    assert "| 0.45 [0.26, 0.66] | 0.85 [0.64, 0.95] | 0.85 | yes |" in rows[0]
    assert "0.312, 0.375, 0.500, 0.375" in rows[1]  # rollout reward per step, as the run wrote it
    assert "rose in 3 of 3 runs (20 prompts each)" in text
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert (out / "run3_metrics.jsonl").read_text() == (KEPT / "run3_metrics.jsonl").read_text()
    assert (out / "runs.md").read_text().strip() == text.split("wrote")[0].strip()


def test_a_run_whose_accuracy_fell_is_counted_as_not_rising(tmp_path, capsys):
    runs = [_run_folder(tmp_path, 1), _run_folder(tmp_path, 2, after=0.40)]
    compare_runs.main([str(r) for r in runs])
    text = capsys.readouterr().out
    assert "| 0.40 [" in text and "| no |" in text
    assert "rose in 1 of 2 runs" in text
