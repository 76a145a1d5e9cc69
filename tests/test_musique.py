"""MuSiQue: builder output from hand-made records in the public shape, the D = 5 reward worked by hand per dimension,
malformed answers, the scalar f in best@k, and the offline error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vpo_lightning.core import metrics
from vpo_lightning.rewards import RewardVector
from vpo_lightning.tasks.musique import (
    best_f1,
    build,
    make_record,
    musique_reward,
    parse_answer,
    scalar_f,
    token_f1,
)
from vpo_lightning.tasks.public_data import DataUnavailable
from vpo_lightning.training.records import read_jsonl

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "public" / "musique"
GT2 = {"ground_truth": {"answer": "Brightwater College", "answer_aliases": [], "support": [4, 6]}}
GT4 = {"ground_truth": {"answer": "the Sable River", "answer_aliases": ["Sable"], "support": [1, 3, 5, 0]}}


def _public() -> dict:
    return build.load_public(FIXTURES)


def test_builder_writes_train_stratified_test_and_val(tmp_path):
    assert build.main(["--source", str(FIXTURES), "--out", str(tmp_path), "--per_hop", "1", "--val_per_hop", "1"]) == 0
    splits = {name: read_jsonl(tmp_path / f"{name}.jsonl") for name in ("train", "val", "test")}
    assert [r["id"] for r in splits["train"]] == [ex["id"] for ex in _public()["train"]]  # all of train, in order
    for name in ("val", "test"):  # one question of each hop count, in hop order
        assert [r["meta"]["num_hops"] for r in splits[name]] == [2, 3, 4]
    assert not {r["id"] for r in splits["val"]} & {r["id"] for r in splits["test"]}
    dev = {ex["id"]: ex for ex in _public()["validation"]}
    for record in splits["test"]:
        example = dev[record["id"]]
        assert record["task"] == "musique" and record["messages"][-1]["role"] == "user"
        assert record["ground_truth"]["support"] == [s["paragraph_support_idx"] for s in
                                                     example["question_decomposition"]]
        assert record["ground_truth"]["answer"] == example["answer"]
        prompt = record["messages"][-1]["content"]
        assert example["question"] in prompt and "<support>" in prompt and "<answer>" in prompt
        for p in example["paragraphs"]:
            assert f"[{p['idx']}] {p['title']}: {p['paragraph_text']}" in prompt


def test_stratified_sample_is_seeded_and_checks_counts():
    dev = _public()["validation"]
    one = build.build_splits(_public(), per_hop=2, val_per_hop=0, seed=42)["test"]
    again = build.build_splits(_public(), per_hop=2, val_per_hop=0, seed=42)["test"]
    assert [r["id"] for r in one] == [r["id"] for r in again]
    assert [r["meta"]["num_hops"] for r in one] == [2, 2, 3, 3, 4, 4]  # the fixtures have 3, 2 and 2 of each
    assert len({r["id"] for r in one}) == 6 and {r["id"] for r in one} <= {ex["id"] for ex in dev}
    with pytest.raises(ValueError, match="fewer than the 3 asked for"):
        build.build_splits(_public(), per_hop=3, val_per_hop=0)


def test_offline_without_a_copy_names_the_files(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(build, "from_hub", lambda *a: (_ for _ in ()).throw(DataUnavailable(
        build.missing_data_message("musique", ["musique_ans_v1.0_train.jsonl"], build.URL, build.DEFAULT_RAW,
                                   "the hub is unreachable"))))
    assert build.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "musique_ans_v1.0_train.jsonl" in err and "data/musique/raw" in err and "--source" in err
    assert build.main(["--source", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    assert "musique_ans_v1.0_dev.jsonl" in capsys.readouterr().err


def test_real_offline_path_without_datasets(tmp_path, monkeypatch, capsys):
    """No monkeypatching of the builder: this machine has no `datasets`, so the real hub check refuses at once."""
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert build.main([]) == 2
    err = capsys.readouterr().err
    assert "musique_ans_v1.0_dev.jsonl" in err and "data/musique/raw/" in err


def test_bad_example_is_a_clear_error():
    example = json.loads((FIXTURES / "musique_ans_v1.0_dev.jsonl").read_text().splitlines()[0])
    del example["question_decomposition"]
    with pytest.raises(ValueError, match="has no 'question_decomposition'"):
        make_record(example, "test")


# ------------------------------------------------------------------------------------------------ reward


@pytest.mark.parametrize(("answer", "expected"), [
    ("<support>4, 6</support><answer>Brightwater College</answer>", [1, 1, 1, 1, 1]),
    # hop 1 missed; F1 of "brightwater" vs "brightwater college": P = 1, R = 1/2, F1 = 2/3
    ("reasoning...\n<support>6</support>\n<answer>brightwater</answer>", [0, 1, 1, 1, 2 / 3]),
    # only the first 4 distinct indices count: {0, 1, 2, 3}; hops 3 and 4 do not exist (score 1)
    ("<support>0, 1, 2, 3, 4, 6</support><answer>Kestrel</answer>", [0, 0, 1, 1, 0]),
    ("<support>0 0 0 0 4</support><answer>The Brightwater College!</answer>", [1, 0, 1, 1, 1]),  # dup + articles
    ("<answer>Brightwater College</answer>", [0, 0, 1, 1, 1]),  # no citations
    ("<support>[6], [4]</support><answer>College Brightwater</answer>", [1, 1, 1, 1, 1]),  # bag of tokens
])
def test_reward_per_dimension_two_hops(answer, expected):
    assert musique_reward(answer, GT2) == pytest.approx(expected)


def test_reward_four_hops_and_aliases():
    assert musique_reward("<support>1, 3</support><answer>Sable</answer>", GT4) == [1, 1, 0, 0, 1]  # alias match
    # F1 vs "the Sable River" -> "sable river": pred "river" gives P 1, R 1/2; the alias "sable" gives 0
    assert musique_reward("<support>5, 0, 3, 1</support><answer>river</answer>", GT4) == pytest.approx(
        [1, 1, 1, 1, 2 / 3])


@pytest.mark.parametrize("answer", [
    "", "Brightwater College", "<support>4, 6</support>", "<support>4, 6</support><answer>   </answer>",
    "<support>4, 6</support><answer>Brightwater College", "<answer></answer>", "</answer>x<answer>",
    "\x00\udcff<support>4</support><answer>\n</answer>",
])
def test_no_answer_scores_all_zeros(answer):
    assert musique_reward(answer, GT2) == [0.0] * 5  # hops included: a cite-only answer earns nothing


@pytest.mark.parametrize("answer", [
    "<support>4,6<answer>x</support>", "<support>" + "9" * 5000 + "</support><answer>a</answer>",
    "\x00\udcff<answer>\u0130</answer>", "<answer><answer>x</answer></answer>",
    "<support>-4</support><answer>!</answer>",
])
def test_malformed_answers_stay_in_range(answer):
    values = musique_reward(answer, GT2)
    assert len(values) == 5 and all(0.0 <= v <= 1.0 for v in values)


def test_parse_answer_and_f1_helpers():
    assert parse_answer("<support>12, 3, 12, 7, 8, 9</support><answer> x </answer>") == ([12, 3, 7, 8], "x")
    assert parse_answer(None) == ([], None)  # type: ignore[arg-type]
    assert token_f1("the cat sat", "a cat sat down") == pytest.approx(2 * 1 * (2 / 3) / (1 + 2 / 3))
    assert token_f1("the", "a") == 1.0 and token_f1("the", "cat") == 0.0
    assert best_f1("cat", "dog", ["the cat"]) == 1.0


def test_scalar_f_weights_best_at_k():
    assert scalar_f([1, 0, 1, 1, 0.5]) == pytest.approx((3 + 1.5) / 7)
    vector = RewardVector(["musique"])
    assert vector.dim_names == ["hop_1", "hop_2", "hop_3", "hop_4", "answer_f1"]
    assert vector.f_weights == [1.0, 1.0, 1.0, 1.0, 3.0]
    pool = torch.tensor([[[1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0, 1.0]]])  # [P=1, n=2, D=5]
    # f: 4/7 and 5/7; the plain mean would rank them 0.8 and 0.6
    curve = metrics.best_at_k_curve(pool, seed=0, num_seeds=200, f_weights=vector.f_weights)
    assert float(curve[-1]) == pytest.approx(5 / 7)
    assert float(curve[0]) == pytest.approx((4 / 7 + 5 / 7) / 2, abs=0.04)
    assert float(metrics.best_at_k_curve(pool, seed=0)[-1]) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="f_weights"):
        metrics.best_at_k_curve(pool, f_weights=[1.0, 2.0])


def test_vpo_eval_uses_the_weighted_f(tmp_path, monkeypatch, tiny_model_dir):
    """`vpo eval` on built records with a scripted engine: best@k follows f = (hops + 3 F1) / 7, not the mean."""
    import yaml

    from vpo_lightning.core.types import Generation
    from vpo_lightning.generation.engines import TransformersEngine
    from vpo_lightning.launcher import main as vpo

    assert build.main(["--source", str(FIXTURES), "--out", str(tmp_path / "data"), "--per_hop", "1",
                       "--val_per_hop", "0"]) == 0
    records = read_jsonl(tmp_path / "data" / "test.jsonl")  # one 2-, 3- and 4-hop question

    def scripted(self, module, prompt_ids, group_size, sampling):
        texts = []
        for row in prompt_ids:
            prompt = module.tokenizer.decode(row)
            gt = next(r for r in records if r["messages"][-1]["content"] in prompt)["ground_truth"]
            all_hops = ", ".join(map(str, gt["support"]))
            texts += [f"<response_1><support>{all_hops}</support><answer>nobody</answer></response_1>"
                      f"<response_2><answer>{gt['answer']}</answer></response_2>"] * group_size  # G chains a prompt
        ids = [module.tokenizer(t)["input_ids"] for t in texts]
        return Generation(ids, texts, sum(map(len, ids)))

    monkeypatch.setattr(TransformersEngine, "generate", scripted)
    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "musique.yaml").read_text())
    cfg["model"]["model"] = {"name": "tiny-llama", "dtype": "fp32", "lora": {"r": 4, "alpha": 8}}
    cfg["rollout"].pop("engine")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    vpo(["eval", "--config", str(tmp_path / "c.yaml"), "--data_file", str(tmp_path / "data" / "test.jsonl"),
         "--n", "6", "--max_prompts", "3", "--max_prompt_tokens", "0", "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    agg = report["aggregate"]
    # answer 1: every hop, wrong answer = [1, 1, 1, 1, 0], f 4/7 (mean 0.8); answer 2: right answer, no citations:
    # 2 hops [0, 0, 1, 1, 1] f 5/7, 3 hops [0, 0, 0, 1, 1] f 4/7, 4 hops [0, 0, 0, 0, 1] f 3/7.
    by_hops = {r["meta"]["num_hops"]: r["id"] for r in records}
    best = {p["id"]: p["best_at_k"][-1] for p in report["prompts"]}
    assert best[by_hops[2]] == pytest.approx(5 / 7, abs=1e-6)
    assert best[by_hops[3]] == pytest.approx(4 / 7, abs=1e-6) and best[by_hops[4]] == pytest.approx(4 / 7, abs=1e-6)
    assert agg["best_at_k"][-1] == pytest.approx(13 / 21, abs=1e-6)
    assert report["f_weights"] == [1.0, 1.0, 1.0, 1.0, 3.0]
    assert agg["mean_reward"]["answer_f1"] == pytest.approx(2 / 6)  # 2 answers of 6 solutions are right


def test_grpo_trains_on_the_weighted_f():
    """GRPO's scalar is the task's f: all hops + a wrong answer (f 4/7, mean 0.8) ranks below the right answer
    without citations (f 5/7, mean 0.6); VPO still sees the reward vectors."""
    from types import SimpleNamespace

    from vpo_lightning.core.types import Generation
    from vpo_lightning.generation.engines import Engine
    from vpo_lightning.generation.models import load_tokenizer
    from vpo_lightning.training.rollout import RolloutCallback

    cites = "<support>4, 6</support><answer>nobody</answer>"
    answers = "<answer>Brightwater College</answer>"

    class Scripted(Engine):
        def generate(self, module, prompt_ids, group_size, sampling, seeds=None):
            texts = [cites, answers] * (len(prompt_ids) * group_size // 2)
            ids = [module.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            return Generation(ids, texts, sum(map(len, ids)))

    module = SimpleNamespace(tokenizer=load_tokenizer("tiny-llama"), device=torch.device("cpu"))
    batch = {"records": [{"id": "q", "messages": [{"role": "user", "content": "Q?"}], **GT2}], "indices": [0],
             "position": 0}
    grpo = RolloutCallback(rewards=["musique"], estimator="grpo", group_size=4, engine=Scripted())
    ro = grpo.rollout(module, batch, step=0)
    assert ro.rewards[:, 0].tolist() == [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]] * 2  # the logged vectors stay 5-D
    # f = [4/7, 5/7] * 2: deviations +-1/14 over the sample std (ddof 1, as the reference) sqrt(4 / 3) / 14
    assert ro.advantages.tolist() == pytest.approx([-(3 / 4) ** 0.5, (3 / 4) ** 0.5] * 2, abs=1e-4)
    assert grpo.sampler.scalar_view(ro.rewards.view(1, 4, 1, 5)).shape == (1, 4, 1, 1)
    vpo_cb = RolloutCallback(rewards=["musique"], estimator="vpo", group_size=4, engine=Scripted())
    assert vpo_cb.sampler.scalar_view(ro.rewards.view(1, 4, 1, 5)).shape == (1, 4, 1, 5)
