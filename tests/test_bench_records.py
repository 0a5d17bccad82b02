"""The typed rows of a bench report (``hf_retrace.bench.records``): the JSON row format is unchanged, and the reports
published under docs/bench, including those written before a field existed, load and render."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from hf_retrace.bench.records import BenchRow, RequestDivergence, report_rows
from hf_retrace.bench.report import markdown_report
from hf_retrace.bench.summary import lossless_summary

DOCS_BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"
EVERY_JSON = sorted([*DOCS_BENCH.rglob("*.json"), *DOCS_BENCH.rglob("*.json.gz")])
PAIRED_TABLE_KEYS = {"method", "temperature", "a", "b", "sets"}  # examples/paired_tau.py --json: not a bench report
NEWER_FIELDS = ("mean_draft_length", "lookup_round_share", "policy", "guard_plain_steps")  # absent from reports written before they existed


def _report(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


PUBLISHED = [p for p in EVERY_JSON if set(_report(p)) != PAIRED_TABLE_KEYS]  # every bench report


PUBLISHED_WITH_EVERY_FIELD = [p for p in PUBLISHED if all(f in _report(p)["rows"][0] for f in NEWER_FIELDS)]


def _a_current_row() -> dict:
    """A published row with every field (the first drafting method's), given one divergence."""
    rows = _report(PUBLISHED_WITH_EVERY_FIELD[0])["rows"]
    row = dict(next(r for r in rows if r["method"] != "plain"))
    row["divergences"] = [{"prompt_id": "p0", "turn": 0, "seed": 0, "position": 3, "plain_token": 5,
                           "method_token": 6, "top2_gap": 0.0625, "chosen_gap": 0.0625, "logit_magnitude": 10.0,
                           "bf16_ulp": 0.0625, "verdict": "near-tie"}]
    return row


def test_every_json_under_docs_bench_is_a_report_or_a_paired_table():
    """A file of neither kind would leave the report tests silently; a paired table is read as one here."""
    tables = [p for p in EVERY_JSON if p not in PUBLISHED]
    assert tables, "no paired_tau table under docs/bench (the split below would test nothing)"
    for path in tables:
        for name, row in _report(path)["sets"].items():
            assert {"pairs", "tau_a", "tau_b", "diff", "se"} <= set(row), (path, name)
    for path in PUBLISHED:
        assert {"schema_version", "settings", "rows"} <= set(_report(path)), f"{path} is neither a report nor a table"


def test_docs_hold_published_reports_of_both_ages():
    assert PUBLISHED_WITH_EVERY_FIELD, "no published report with every field under docs/bench"
    assert set(PUBLISHED) - set(PUBLISHED_WITH_EVERY_FIELD), "no published report older than the newer fields"


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: str(p.relative_to(DOCS_BENCH)))
def test_published_rows_load_and_write_back_the_same_json(path):
    report = _report(path)
    for row, record in zip(report["rows"], report_rows(report), strict=True):
        written = record.to_dict()
        assert list(written) == [f.name for f in dataclasses.fields(BenchRow)]
        expected = {name: row.get(name) for name in written}  # an older report's missing fields read as None
        assert written == expected
        if all(f in row for f in NEWER_FIELDS):
            assert list(written) == list(row)  # the JSON's key order too


def test_a_published_markdown_is_rendered_again_from_its_json():
    rendered = [p for p in PUBLISHED if p.with_suffix(".md").is_file()
                and p.with_suffix(".md").read_text() == markdown_report(_report(p))]
    assert rendered, "no report under docs/bench renders back to its published Markdown"


def test_an_older_row_reads_the_newer_fields_as_none_and_renders():
    row = _a_current_row()
    for name in NEWER_FIELDS:
        del row[name]
    record = BenchRow.from_dict(row)
    assert (record.mean_draft_length, record.lookup_round_share) == (None, None)
    assert record.tau == row["tau"] and record.divergences[0].divergence.verdict == "near-tie"
    report = {"settings": _report(PUBLISHED[0])["settings"], "environment": _report(PUBLISHED[0])["environment"],
              "rows": [row], "skipped": {}, "notes": []}
    assert "| near-tie |" in markdown_report(report)


def test_divergences_and_requests_are_records_with_the_flat_json_layout():
    row = _a_current_row()
    record = BenchRow.from_dict(row)
    assert isinstance(record.divergences[0], RequestDivergence)
    assert record.divergences[0].divergence.position == 3
    assert record.per_request[0].prompt_id == row["per_request"][0]["prompt_id"]
    assert record.to_dict()["divergences"] == row["divergences"]
    assert record.to_dict()["per_request"] == row["per_request"]


@pytest.mark.parametrize("field", ["tau", "method", "divergences", "per_request"])
def test_a_row_without_a_required_field_is_refused_with_its_name(field):
    row = _a_current_row()
    del row[field]
    with pytest.raises(ValueError, match=f"lacks {field}.*hf-retrace bench --json"):
        BenchRow.from_dict(row)


def test_a_parting_of_plain_decoding_on_other_kernels_is_not_counted_as_a_drafting_bug():
    """The Xeon's report of 2026-12-07: HumanEval/15 parted at 3 bf16 ulps in `plain-no-onednn` (no drafter), and
    MATH-500's intermediate_algebra/1197 at 5 ulps under both drafting methods (identical in float32: that folder)."""
    rows = report_rows(_report(DOCS_BENCH / "2026-12-07-xeon-amx-shared-taps" / "shipped-T0.json"))
    totals = lossless_summary(rows)
    assert (totals["mismatch_bugs"], totals["kernel_partings"]) == (2, 1)
    assert totals["mismatches"] == sum(r.mismatches or 0 for r in rows)
    drafting_only = lossless_summary([r for r in rows if r.method != "plain-no-onednn"])
    assert (drafting_only["mismatch_bugs"], drafting_only["kernel_partings"]) == (2, 0)
    plain_only = lossless_summary([r for r in rows if r.method == "plain-no-onednn"])
    assert (plain_only["mismatch_bugs"], plain_only["kernel_partings"]) == (0, 1)
    rendered = markdown_report(_report(DOCS_BENCH / "2026-12-07-xeon-amx-shared-taps" / "shipped-T0.json"))
    assert "| 6/8 (1 kernel parting, 5 near-tie) |" in rendered and "| 7/8 (1 bug, 6 near-tie) |" in rendered
