"""PromptDataModule: validation errors name file and line; seeded order; resumable position; disjoint ranks."""

from __future__ import annotations

import json

import pytest

from vpo_lightning.training.datamodule import PromptDataModule, PromptStream
from vpo_lightning.training.records import read_jsonl


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def _record(i):
    return json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]})


def test_malformed_lines_name_file_and_line(tmp_path):
    f = _write(tmp_path / "bad.jsonl", [_record(0), "{not json"])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_jsonl(f)
    f = _write(tmp_path / "nofield.jsonl", [_record(0), json.dumps({"id": 1})])
    with pytest.raises(ValueError, match=r"nofield.jsonl:2: missing field 'messages'"):
        read_jsonl(f)
    f = _write(tmp_path / "role.jsonl", [json.dumps({"messages": [{"role": "bot", "content": "x"}]})])
    with pytest.raises(ValueError, match=r"role.jsonl:1: messages\[0\]"):
        read_jsonl(f)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        read_jsonl(tmp_path / "empty.jsonl")


def test_stream_is_seeded_and_resumes_at_position():
    records = [{"i": i} for i in range(10)]
    a = [b["indices"] for b in PromptStream(records, 2, seed=3)]
    assert a == [b["indices"] for b in PromptStream(records, 2, seed=3)]
    assert a != [b["indices"] for b in PromptStream(records, 2, seed=4)]
    assert sorted(i for b in a for i in b) == list(range(10))  # one epoch covers every prompt once
    resumed = PromptStream(records, 2, seed=3)
    resumed.position = 3
    assert [b["indices"] for b in resumed] == a[3:]
    resumed.position = 5  # next epoch: a new permutation
    nxt = [b["indices"] for b in resumed]
    assert nxt != a and sorted(i for b in nxt for i in b) == list(range(10))


def test_ranks_see_disjoint_prompts():
    records = [{"i": i} for i in range(12)]
    seen = []
    for rank in range(2):
        s = PromptStream(records, 3, seed=0)
        s.rank, s.world_size = rank, 2
        seen.append({i for b in s for i in b["indices"]})
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 12


def test_datamodule_state_round_trip(tmp_path):
    f = _write(tmp_path / "p.jsonl", [_record(i) for i in range(8)])
    dm = PromptDataModule(train_files=[str(f)], batch_size=2)
    dm.setup("fit")
    dm.mark_consumed(2)
    state = dm.state_dict()
    dm2 = PromptDataModule(train_files=[str(f)], batch_size=2)
    dm2.load_state_dict(state)
    dm2.setup("fit")
    first = next(iter(dm2.train_dataloader()))
    assert first["position"] == 3


def test_max_prompt_tokens_filters(tmp_path):
    long = json.dumps({"messages": [{"role": "user", "content": "word " * 500}]})
    f = _write(tmp_path / "p.jsonl", [_record(0), _record(1), long])
    dm = PromptDataModule(train_files=[str(f)], batch_size=1, max_prompt_tokens=100, tokenizer="tiny-llama")
    dm.setup("fit")
    assert len(dm.train_stream.records) == 2
