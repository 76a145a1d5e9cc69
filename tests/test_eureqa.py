"""EUREQA: the mixed split built from hand-made records in the public shape, the exact-match reward per entity,
malformed answers, and the offline error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from vpo_lightning.rewards import RewardVector
from vpo_lightning.tasks.eureqa import build, entity_match, eureqa_reward, make_record, normalize_entity, parse_entities
from vpo_lightning.training.records import read_jsonl

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "public" / "eureqa"
GOLD = {"ground_truth": {"entities": ["Mira_Okafor", "Paper_Lanterns_(film)", "Studio_Meridian", "Oskar_Linde",
                                      "Farrow_Isle"]}}


def test_mixed_split_seed_0(tmp_path):
    assert build.main(["--source", str(FIXTURES), "--out", str(tmp_path)]) == 0
    train, test = read_jsonl(tmp_path / "train.jsonl"), read_jsonl(tmp_path / "test.jsonl")
    assert not (tmp_path / "val.jsonl").exists()
    # 3 normal + 5 hard; numpy default_rng(0).permutation(5) = [2, 4, 3, 0, 1] (what datasets' shuffle(seed=0)
    # applies): train = normal + hard[2], hard[4]; test = hard[3], hard[0], hard[1]
    assert [r["id"] for r in train] == ["questions_normal_5-0", "questions_normal_5-1", "questions_normal_5-2",
                                        "questions_hard_5-102", "questions_hard_5-104"]
    assert [r["id"] for r in test] == ["questions_hard_5-103", "questions_hard_5-100", "questions_hard_5-101"]
    record = test[0]
    assert record["task"] == "eureqa" and record["meta"]["category"] == "questions_hard_5"
    assert record["ground_truth"]["entities"] == GOLD["ground_truth"]["entities"]
    prompt = record["messages"][-1]["content"]
    assert "Person A starred in Film B.\nFilm B was produced by Studio C." in prompt
    assert all(f"<entity_{x}>...</entity_{x}>" in prompt for x in "ABCDE")


def test_val_moves_seeded_training_questions():
    splits = build.build_splits(build.load_public(FIXTURES), seed=0, val=2)
    assert (len(splits["train"]), len(splits["val"]), len(splits["test"])) == (3, 2, 3)
    assert not {r["id"] for r in splits["train"]} & {r["id"] for r in splits["val"]}
    with pytest.raises(ValueError, match="--val 9"):
        build.build_splits(build.load_public(FIXTURES), val=9)


def test_offline_error_names_the_files(tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("datasets") is not None:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert build.main([]) == 2
    err = capsys.readouterr().err
    assert "questions_normal_5.jsonl, questions_hard_5.jsonl" in err and "data/eureqa/raw/" in err
    assert "vincentleebang/EUREQA" in err


def test_short_example_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 5 entity_masks"):
        make_record({"idx": 7, "question": ["x"], "entity_masks": ["A"], "entities": ["a"]}, "train", "q")


@pytest.mark.parametrize(("answer", "expected"), [
    ("<entity_A>Mira Okafor</entity_A><entity_B>Paper Lanterns (film)</entity_B><entity_C>Studio_Meridian</entity_C>"
     "<entity_D>oskar linde</entity_D><entity_E>Farrow Isle.</entity_E>", [1, 1, 1, 1, 1]),
    ("<entity_A>Mira_Okafor</entity_A><entity_B>Paper Lanterns</entity_B><entity_C>Meridian</entity_C>",
     [1, 0, 0, 0, 0]),  # B lacks the (film) qualifier, C is partial, D and E are missing
    ("<entity_E>Farrow Isle</entity_E> then <entity_A>the Mira Okafor</entity_A>", [1, 0, 0, 0, 1]),  # any order
    ("<entity_A>Oskar Linde</entity_A><entity_D>Mira Okafor</entity_D>", [0, 0, 0, 0, 0]),  # swapped entities
    ("<entity_a>Mira Okafor</entity_a>", [0, 0, 0, 0, 0]),  # tags are case-sensitive
])
def test_reward_per_entity(answer, expected):
    assert eureqa_reward(answer, GOLD) == expected


@pytest.mark.parametrize("answer", ["", "Mira Okafor", "<entity_A>Mira Okafor", "<entity_A></entity_A>",
                                    "<entity_A>  ...  </entity_A>", "<entity_A>\udcff\x00</entity_A>", "</entity_A>"])
def test_malformed_answers_score_zero(answer):
    assert eureqa_reward(answer, GOLD) == [0.0] * 5


def test_normalisation():
    assert normalize_entity("From_Dusk_till_Dawn:_The_Series") == normalize_entity("from dusk till dawn the series")
    assert normalize_entity("Ｍira＿Okafor") == "mira okafor"  # NFKC folds full-width letters and underscores
    assert entity_match("...", "...") == 0.0  # nothing left after normalisation never matches
    assert parse_entities("<entity_C> x </entity_C>") == [None, None, "x", None, None]
    assert RewardVector(["eureqa"]).dim_names == ["entity_A", "entity_B", "entity_C", "entity_D", "entity_E"]
    assert RewardVector(["eureqa"]).f_weights == [1.0] * 5  # f = mean
