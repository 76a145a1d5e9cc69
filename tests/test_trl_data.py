"""TRL's datasets and reward functions: record formats and files (records.py), the TRL reward signature (rewards)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from vpo_lightning.rewards import RewardRangeError, RewardVector, get_reward
from vpo_lightning.training.records import read_records, template_tools

STANDARD = [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "What is 3+3?", "answer": "6"}]
CONVERSATIONAL = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
                   "answer": "hello"}]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trl_standard_and_conversational_prompts_become_messages(tmp_path):
    std = read_records(_jsonl(tmp_path / "std.jsonl", STANDARD))
    assert std[0]["messages"] == [{"role": "user", "content": "What is 2+2?"}]
    assert std[0]["prompt"] == "What is 2+2?" and std[0]["answer"] == "4"  # extra columns stay for the rewards
    conv = read_records(_jsonl(tmp_path / "conv.jsonl", CONVERSATIONAL))
    assert conv[0]["messages"] == CONVERSATIONAL[0]["prompt"]
    ours = read_records(_jsonl(tmp_path / "ours.jsonl", [{"messages": [{"role": "user", "content": "x"}]}]))
    assert ours[0]["messages"] == [{"role": "user", "content": "x"}] and ours[0]["_derived"] == ["id"]
    assert std[0]["_derived"] == ["messages", "id"]  # what vpo added, kept from the TRL reward functions' kwargs


def test_parquet_json_csv_and_saved_dataset_read_alike(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(STANDARD)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_json(str(tmp_path / "d.json"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    want = [(r["messages"], r["answer"]) for r in read_records(_jsonl(tmp_path / "d.jsonl", STANDARD))]
    for source in ("d.parquet", "d.json", "d.csv", "saved"):
        got = read_records(tmp_path / source)
        assert [(r["messages"], str(r["answer"])) for r in got] == want, source  # CSV infers 4 as an int
    conv = datasets.Dataset.from_list(CONVERSATIONAL)
    conv.to_parquet(str(tmp_path / "c.parquet"))
    assert read_records(tmp_path / "c.parquet")[0]["messages"] == CONVERSATIONAL[0]["prompt"]


def test_bad_rows_name_file_and_row(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"prompt": "ok"}, {"prompt": ""}]).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match=r"bad.parquet: row 2: 'prompt' is empty"):
        read_records(tmp_path / "bad.parquet")
    with (tmp_path / "bad.csv").open("w", newline="") as fh:
        csv.writer(fh).writerows([["question"], ["a"], ["b"]])
    with pytest.raises(ValueError, match=r"bad.csv:2: missing field 'messages' \(each record needs 'messages', or "
                                         r"TRL's 'prompt'"):
        read_records(tmp_path / "bad.csv")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(STANDARD)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"saved DatasetDict with splits \['train'\]: name one split's folder"):
        read_records(tmp_path / "dd")
    assert len(read_records(tmp_path / "dd" / "train")) == 2
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"unknown format '.txt'"):
        read_records(tmp_path / "x.txt")
    _jsonl(tmp_path / "tools.jsonl", [{"prompt": "x", "tools": "{not json"}])
    with pytest.raises(ValueError, match=r"tools.jsonl:1: 'tools' is a string but not valid JSON"):
        read_records(tmp_path / "tools.jsonl")


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"not a local file or folder, and it cannot be loaded as a Hugging Face Hub "
                                         r"dataset: HF_HUB_OFFLINE .*save_to_disk"):
        read_records("no-such-owner/no-such-dataset")


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")


def test_record_tools_reach_the_chat_template(tmp_path):
    from vpo_lightning.generation.models import load_tokenizer, prompt_token_ids

    tok = load_tokenizer("tiny-llama")
    tok.chat_template = TOOLS_TEMPLATE
    rows = [{"prompt": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [TOOL]},
            {"prompt": [{"role": "user", "content": "Weather in Oslo?"}], "tools": json.dumps([TOOL])}]
    for record in read_records(_jsonl(tmp_path / "t.jsonl", rows)):
        text = tok.decode(prompt_token_ids(tok, record["messages"], template_tools(record)))
        assert text.startswith("TOOLS:get_weather;"), text
    # the built-in tool-use prompts list their tools in the system message already (ToolRL format)
    assert template_tools({"task": "tooluse", "tools": [TOOL], "messages": []}) is None


# ---- TRL reward functions ------------------------------------------------------------------------------------------
CALLS: list[dict] = []


def trl_correct(prompts, completions, answer, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "answer": answer, "kwargs": sorted(kwargs)})
    return [1.0 if answer[i] in _text(c) else 0.0 for i, c in enumerate(completions)]


def trl_maybe(completions, **kwargs):
    return [None if _text(c).startswith("skip") else 0.5 for c in completions]


def trl_out_of_range(prompts, completions, **kwargs):
    return [-1.0 for _ in completions]


def ours_short(candidate, sample):
    return float(len(candidate) < 10)


def trl_bad(completions):
    return [0.0] * len(completions)


def not_a_reward(a, b, c):
    return 0.0


def _text(c):
    return c if isinstance(c, str) else c[0]["content"]


def test_trl_reward_is_called_once_per_batch_with_the_columns(tmp_path):
    CALLS.clear()
    records = read_records(_jsonl(tmp_path / "std.jsonl", STANDARD)) + read_records(
        _jsonl(tmp_path / "conv.jsonl", CONVERSATIONAL))
    vec = RewardVector([f"{__name__}.trl_correct", f"{__name__}.trl_maybe", f"{__name__}.ours_short"])
    assert vec.dim_names == ["trl_correct", "trl_maybe", "ours_short"]  # one dimension per function
    cands = [["the answer is 4", "skip"], ["6", None], ["hello there, long answer"]]
    scores = vec.score(cands, records)
    assert len(CALLS) == 1  # one call for the whole batch, absent candidates left out
    call = CALLS[0]
    assert call["answer"] == ["4", "4", "6", "hello"]  # the extra column, one entry per completion
    assert call["prompts"][0] == "What is 2+2?" and call["prompts"][3] == CONVERSATIONAL[0]["prompt"]
    assert call["completions"][0] == "the answer is 4"  # standard format: strings
    assert call["completions"][3] == [{"role": "assistant", "content": "hello there, long answer"}]  # conversational
    assert "messages" not in call["kwargs"] and "id" not in call["kwargs"]  # added by vpo, not dataset columns
    assert scores.rewards[0, 0].tolist() == [1.0, 0.5, 0.0]
    assert scores.rewards[0, 1].tolist() == [0.0, 0.0, 1.0]  # None from trl_maybe counts 0, as TRL's nansum
    assert scores.rewards[1, 0].tolist() == [1.0, 0.5, 1.0] and scores.num_errors == 0
    assert not scores.mask[1, 1]


def test_trl_reward_outside_unit_interval_stops_at_the_first_batch():
    """Issue 53: a TRL reward in [-1, 1] is refused with its name, the value, the record and the fix; never a
    silent 0 (it used to score 0 and train on)."""
    vec = RewardVector([f"{__name__}.trl_out_of_range"])
    with pytest.raises(RewardRangeError, match=r"reward 'test_trl_data.trl_out_of_range' returned -1.0 for record "
                                               r"'r-7'.*outside \[0, 1\].*\(r \+ 1\) / 2"):
        vec.score([["a"]], [{"prompt": "p", "messages": [{"role": "user", "content": "p"}], "id": "r-7"}])


def test_signature_mismatches_are_refused_at_start_up():
    with pytest.raises(ValueError, match=r"takes prompts and completions as keyword arguments"):
        get_reward(f"{__name__}.trl_bad")
    with pytest.raises(ValueError, match=r"fits neither accepted signature: fn\(candidate: str, sample: Mapping\).*"
                                         r"TRL's fn\(prompts: list, completions: list, \*\*kwargs\)"):
        RewardVector([f"{__name__}.not_a_reward"])


def test_dotted_reward_imports_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_trl_rewards.py").write_text(
        "def brevity(prompts, completions, **kwargs):\n    return [1.0 / (1 + len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    entry = get_reward("my_trl_rewards.brevity")
    assert entry.batch and entry.dims == ("brevity",)


def test_api_refuses_an_existing_run_before_touching_its_inputs(tmp_path, monkeypatch):
    """The notebook entry point writes its data into the run folder: an existing run is refused first (as by
    `vpo fit`), and the entry point's own inputs do not make a fresh folder count as a run."""
    from vpo_lightning import api
    from vpo_lightning.training import cli
    from vpo_lightning.training.run_folders import claim

    monkeypatch.setattr(cli, "OUTPUT_ROOT", str(tmp_path))
    run = tmp_path / "old"
    (run / "data").mkdir(parents=True)
    (run / "data" / "train.jsonl").write_text("keep", encoding="utf-8")
    (run / "last.ckpt").write_bytes(b"x")
    with pytest.raises(ValueError, match="already holds a run"):
        api.train("tiny-llama", ["format"], [{"prompt": "hi"}], run_name="old")
    assert (run / "data" / "train.jsonl").read_text(encoding="utf-8") == "keep"
    fresh = tmp_path / "fresh"
    (fresh / "data").mkdir(parents=True)
    (fresh / "api_config.yaml").write_text("run_name: fresh\n", encoding="utf-8")
    assert claim(fresh, None, overwrite=False).path == fresh  # only the entry point's inputs: not refused


def test_dotted_reward_imports_from_the_configs_folder(tmp_path, monkeypatch):
    """Issue 53: ``my_rewards.py`` beside the config imports with the run started from another folder."""
    from vpo_lightning.commands.runs import load_config
    from vpo_lightning.rewards import _CONFIG_DIRS

    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "beside_config_rewards.py").write_text(
        "def short(prompts, completions, **kwargs):\n    return [1.0 / (1 + len(c)) for c in completions]\n")
    (folder / "run.yaml").write_text("rollout:\n  rewards: [beside_config_rewards.short]\n")
    monkeypatch.chdir(tmp_path)  # not the config's folder
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), str(folder))])
    monkeypatch.setattr("vpo_lightning.rewards._CONFIG_DIRS", list(_CONFIG_DIRS))
    monkeypatch.delitem(sys.modules, "beside_config_rewards", raising=False)
    with pytest.raises(ValueError, match="cannot import it as a dotted path"):
        get_reward("beside_config_rewards.short")
    load_config(folder / "run.yaml")  # what every command and `vpo fit` do with --config
    assert get_reward("beside_config_rewards.short").dims == ("short",)
