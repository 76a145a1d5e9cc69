"""`vpo eval` and `vpo compare` end to end on the tiny random Llama: eval.json structure, curve sanity, adapters,
Lightning checkpoints, a scripted engine with known answers (exact metric values), and the comparison report."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from vpo_lightning.commands import evaluate, runs
from vpo_lightning.generation.models import LoraSettings, ModelSettings, load_base_model, wrap_lora
from vpo_lightning.launcher import main as vpo

REPO = Path(__file__).resolve().parents[1]
TINY = {"name": "tiny-llama", "dtype": "fp32", "lora": {"r": 4, "alpha": 8}}


def _config(folder: Path, **rollout) -> Path:
    """configs/debug.yaml with the full train file (so the test split resolves to test.jsonl) and 8 new tokens."""
    cfg = yaml.safe_load((REPO / "configs/debug.yaml").read_text())
    cfg["data"]["train_files"] = [str(REPO / "data/tooluse/train.jsonl")]
    cfg["data"]["max_prompt_tokens"] = 300
    cfg["rollout"]["sampling"]["max_new_tokens"] = 8
    cfg["rollout"].update(rollout)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "eval_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _lora_model(seed: int = 1) -> torch.nn.Module:
    """A LoRA-wrapped tiny model whose adapter is non-trivial (lora_B is zero at init)."""
    model = wrap_lora(load_base_model(ModelSettings(**TINY)), LoraSettings(r=4, alpha=8))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def _run(*args: str) -> dict:
    vpo(["eval", *args])
    out = Path(args[args.index("--out") + 1])
    return json.loads((out / "eval.json").read_text())


@pytest.fixture(scope="module")
def base_eval(tmp_path_factory, tiny_model_dir) -> dict:
    folder = tmp_path_factory.mktemp("base")
    return _run("--config", str(_config(folder)), "--n", "6", "--max_prompts", "2", "--out", str(folder / "out"),
                "--seed", "3")


@pytest.fixture(scope="module")
def adapter_eval(tmp_path_factory, tiny_model_dir) -> dict:
    folder = tmp_path_factory.mktemp("adapter")
    _lora_model().save_pretrained(folder / "adapter")
    return _run("--config", str(_config(folder)), "--adapter", str(folder / "adapter"), "--estimator", "grpo",
                "--n", "3", "--max_prompts", "2", "--out", str(folder / "out"), "--label", "tiny-adapter")


def _check_curves(report: dict) -> None:
    agg, n = report["aggregate"], report["n"]
    for rows in [agg, *report["prompts"]]:
        for key, length in (("best_at_k", n), ("pass_at_k", n), ("chain_pass_at_k", report["chains_per_prompt"])):
            curve = torch.tensor(rows[key])
            assert len(curve) == length, key
            assert bool(((curve >= 0) & (curve <= 1)).all()), (key, curve)
            assert bool((curve[1:] >= curve[:-1] - 1e-6).all()), f"{key} decreases: {curve}"


def test_eval_base_model_writes_report(base_eval):
    r = base_eval
    assert r["format"] == evaluate.FORMAT and r["model"] == "tiny-llama" and r["adapter"] is None
    assert (r["estimator"], r["m"], r["n"], r["chains_per_prompt"]) == ("vpo", 3, 6, 2)
    assert r["dim_names"] == ["format", "tool_name", "arg_key", "arg_value"] and r["seed"] == 3
    assert r["data_file"].endswith("data/tooluse/test.jsonl") and r["max_prompt_tokens"] == 300
    assert r["num_prompts"] == len(r["prompts"]) == 2 and r["timestamp"] and r["config"].endswith(".yaml")
    for p in r["prompts"]:
        assert len(p["rewards"]) == len(p["present"]) == 6 and all(len(v) == 4 for v in p["rewards"])
    for key in ("pairwise_l1_diversity", "within_chain_diversity", "expected_best_weighted", "pareto_fraction",
                "generated_tokens", "tokens_per_solution", "mean_reward", "parse_rate", "time_s"):
        assert key in r["aggregate"], key
    assert 0 < r["aggregate"]["generated_tokens"] <= 2 * 2 * 8  # P * chains * max_new_tokens
    _check_curves(r)
    out = Path(r["config"]).parent / "out"
    for name in ("eval.json", "samples.jsonl", "best_at_k.png", "pass_at_k.png", "diversity.png"):
        assert (out / name).stat().st_size > 0, name
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2 * 2  # one line per chain


def test_eval_same_prompts_for_every_model(base_eval, adapter_eval):
    assert [p["id"] for p in base_eval["prompts"]] == [p["id"] for p in adapter_eval["prompts"]]
    assert len({p["category"] for p in base_eval["prompts"]}) >= 1


def test_eval_adapter_single_answer_budget(adapter_eval, tmp_path):
    r = adapter_eval
    assert (r["estimator"], r["m"], r["n"], r["chains_per_prompt"]) == ("grpo", 1, 3, 3)
    assert r["label"] == "tiny-adapter"
    assert r["aggregate"]["within_chain_diversity"] is None  # single answers have no chains
    weights = Path(r["adapter"]) / "adapter_model.safetensors"
    assert r["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    _check_curves(r)


def test_ckpt_weights_load_into_the_lora_policy(tmp_path, tiny_model_dir):
    """A Lightning checkpoint's policy.* adapter weights end up in the rebuilt policy, bit for bit."""
    trained = _lora_model(seed=7)
    state = {f"policy.{k}": v for k, v in trained.named_parameters() if v.requires_grad}
    run = tmp_path / "checkpoints" / "run"
    run.mkdir(parents=True)
    torch.save({"state_dict": state, "global_step": 5, "hyper_parameters": {"model": TINY}}, run / "last.ckpt")
    cfg = yaml.safe_load(_config(tmp_path).read_text())
    cfg["model"]["model"]["lora"] = {"r": 2, "alpha": 4}  # the checkpoint's own settings win
    args = evaluate.build_parser().parse_args(["--ckpt", str(run / "last.ckpt")])
    model, settings, info = runs.load_model(cfg, torch.device("cpu"), ckpt=args.ckpt, adapter=args.adapter)
    assert settings.lora.r == 4 and info["global_step"] == 5 and len(info["weights_sha256"]) == 64
    loaded = dict(model.named_parameters())
    for key, value in state.items():
        assert torch.equal(loaded[key.removeprefix("policy.")], value), key
    assert evaluate.default_out_dir(args, Path("x.yaml")) == run / "eval-last"

    torch.save({"state_dict": state, "global_step": 5}, run / "bare.ckpt")  # no hparams: the config's r=2 is wrong
    args = evaluate.build_parser().parse_args(["--ckpt", str(run / "bare.ckpt")])
    with pytest.raises(ValueError, match="do not fit"):
        runs.load_model(cfg, torch.device("cpu"), ckpt=args.ckpt)


def _gold_answer(record: dict) -> str:
    from vpo_lightning.tasks.tooluse.reward import gold_calls

    calls = []
    for name, args in gold_calls(record):
        params = {}
        for key, alternatives in args.items():
            values = [a for a in (alternatives if isinstance(alternatives, list) else [alternatives]) if a != ""]
            if values:
                params[key] = values[0]
        calls.append(json.dumps({"name": name, "parameters": params}))
    return "<think>use the tool</think>\n<tool_call>\n" + "\n".join(calls) + "\n</tool_call>"


def _solvable_records(count: int) -> list[dict]:
    """Test records with gold calls whose first acceptable values score [1, 1, 1, 1]."""
    from vpo_lightning.tasks.tooluse.reward import tooluse_rewards

    out = []
    for line in (REPO / "data/tooluse/test.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["ground_truth"] and tooluse_rewards(_gold_answer(record), record) == [1.0] * 4:
            out.append(record)
        if len(out) == count:
            return out
    raise AssertionError("not enough solvable records")


def _gold_then_wrong(tmp_path: Path) -> tuple[list[dict], Path, Callable[[str, int], str]]:
    """Two solvable test records written to a JSONL, and a script answering each prompt's chain with the gold call,
    then a well-tagged wrong answer (the third answer missing)."""
    records = _solvable_records(2)
    data = tmp_path / "picked.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))

    def answer(prompt: str, row: int) -> str:
        record = next(r for r in records if r["messages"][-1]["content"] in prompt)
        return f"<response_1>{_gold_answer(record)}</response_1>\n<response_2>no idea</response_2>"

    return records, data, answer


def test_eval_metrics_with_a_scripted_engine(tmp_path, script_generation, tiny_model_dir):
    """Each chain: answer 1 = the gold call (solves), answer 2 = well-tagged but wrong (zero vector), 3 missing."""
    records, data, answer = _gold_then_wrong(tmp_path)

    script_generation(answer)
    r = _run("--config", str(_config(tmp_path)), "--data_file", str(data), "--n", "6", "--max_prompts", "2",
             "--max_prompt_tokens", "0", "--out", str(tmp_path / "out"))
    agg = r["aggregate"]
    assert {p["id"] for p in r["prompts"]} == {rec["id"] for rec in records}
    assert agg["best_at_k"][0] == pytest.approx(2 / 6, abs=0.1)  # 100 random orders: close to the mean
    assert agg["best_at_k"][-1] == 1.0 and agg["best_at_k"][4] == 1.0  # 5 of 6 always include a solver
    assert agg["pass_at_k"][0] == pytest.approx(2 / 6) and agg["pass_at_k"][-1] == 1.0
    assert agg["pass_at_k"][1] == pytest.approx(1 - (4 * 3) / (6 * 5))  # 1 - C(4,2)/C(6,2)
    assert agg["chain_pass_at_k"] == [1.0, 1.0]
    assert agg["within_chain_diversity"] == pytest.approx(4.0)  # [1,1,1,1] vs [0,0,0,0]
    assert agg["pairwise_l1_diversity"] == pytest.approx(16 / 6)  # 4 present: 4 of 6 pairs differ by 4
    assert agg["pareto_fraction"] == pytest.approx(0.5) and agg["expected_best_weighted"] == pytest.approx(1.0)
    assert agg["present_fraction"] == pytest.approx(4 / 6) and agg["parse_rate"] == 1.0
    _check_curves(r)


def test_compare_writes_a_row_per_input(base_eval, adapter_eval, tmp_path):
    paths = [Path(base_eval["config"]).parent / "out", Path(adapter_eval["config"]).parent / "out" / "eval.json"]
    out = tmp_path / "docs" / "report.md"
    vpo(["compare", *map(str, paths), "--out", str(out), "--labels", "base,adapter"])
    text = out.read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert any(line.startswith("| base | vpo | 3 | 6 |") for line in table)
    assert any(line.startswith("| adapter | grpo | 1 | 3 |") for line in table)
    assert "best@1" in table[0] and "E_w best" in table[0] and "Pareto" in table[0]
    assert "different solution budgets" in text  # n = 6 vs n = 3
    assert (out.parent / "report_best_at_k.png").stat().st_size > 0


def test_clear_errors(tmp_path, base_eval):
    config = base_eval["config"]
    with pytest.raises(SystemExit) as err:
        vpo(["eval", "--config", config, "--n", "4"])  # 4 solutions are not a whole number of 3-answer chains
    assert err.value.code == 2
    with pytest.raises(SystemExit):
        vpo(["compare", str(tmp_path / "missing.json"), "--out", str(tmp_path / "r.md")])
    assert evaluate.default_data_file({"data": {"train_files": ["d/train.jsonl"]}}, "test") == "d/test.jsonl"
    assert evaluate.default_data_file({"data": {"train_files": ["d/x.jsonl"], "val_files": ["d/v.jsonl"]}},
                                      "val") == "d/v.jsonl"
    cfg = runs.load_config(Path(config), ["rollout.sampling.max_new_tokens=3", "rollout.estimator=grpo"])
    assert cfg["rollout"]["sampling"]["max_new_tokens"] == 3 and cfg["rollout"]["estimator"] == "grpo"


def test_eval_prefills_each_prompt_once_per_record(script_generation):
    """A record whose chains share one prompt is one engine group (G = chains, prefilled once); goal-conditioned
    records (a different prompt per chain) go row by row. Completions come back in the same order either way."""
    from types import SimpleNamespace

    from vpo_lightning.core.protocol import ChainProtocol
    from vpo_lightning.training.sampler import Sampler

    class Tok:  # what ScriptedEngine uses of a tokenizer
        def decode(self, ids: list[int]) -> str:
            return " ".join(map(str, ids))

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            return {"input_ids": [len(text)]}

    engine = script_generation(lambda prompt, row: f"row {row}")
    ns = SimpleNamespace(tokenizer=Tok())
    run = Sampler(ChainProtocol(["maze"], "vpo", 3), engine, None)
    shared = [[[1, 2, 3]] * 4, [[4, 5]] * 4]  # 2 records x 4 chains, one prompt each
    gen = run.generate_rows(ns, shared)
    assert engine.prompts[-1] == [[1, 2, 3], [4, 5]]  # each prompt passed once, as a group of 4
    assert gen.texts == [f"row {i}" for i in range(8)]
    conditioned = [[[1, 2, 3], [1, 2, 4]], [[4, 5], [4, 6]]]  # a different shown weight per chain
    gen = run.generate_rows(ns, conditioned)
    assert engine.prompts[-1] == [[1, 2, 3], [1, 2, 4], [4, 5], [4, 6]]
    assert gen.texts == [f"row {i}" for i in range(4)]


def test_from_samples_equals_a_smaller_evaluation(tmp_path, script_generation, tiny_model_dir, capsys):
    """`--from_samples` on a 6-solution evaluation at --n 3 gives the metrics a 3-solution evaluation of the same
    samples gives (the scripted engine answers the same whatever the budget), without sampling anything."""
    records, data, answer = _gold_then_wrong(tmp_path)

    engine = script_generation(answer)
    common = ("--config", str(_config(tmp_path)), "--data_file", str(data), "--max_prompts", "2",
              "--max_prompt_tokens", "0")
    _run(*common, "--n", "6", "--out", str(tmp_path / "six"))
    direct = _run(*common, "--n", "3", "--out", str(tmp_path / "three"))
    calls = len(engine.prompts)
    sub = _run("--from_samples", str(tmp_path / "six"), "--n", "3", "--out", str(tmp_path / "sub"))
    assert len(engine.prompts) == calls  # nothing sampled
    assert sub["n"] == 3 and sub["chains_per_prompt"] == 1 and sub["subsampled_from"] == str(tmp_path / "six")
    drop = ("generated_tokens", "tokens_per_solution", "time_s")
    for a, b in zip(sub["prompts"], direct["prompts"], strict=True):
        assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}
    assert {k: v for k, v in sub["aggregate"].items() if k not in drop} == {
        k: v for k, v in direct["aggregate"].items() if k not in drop}
    with pytest.raises(SystemExit) as err:  # asks for more solutions than the source has
        vpo(["eval", "--from_samples", str(tmp_path / "six"), "--n", "9", "--out", str(tmp_path / "x")])
    assert err.value.code == 2 and "more than the 6 solutions" in capsys.readouterr().err


def test_metrics_read_a_records_real_dimensions_only():
    """A 3-test code record in a 4-column batch: a solution passing its 3 tests solves it (the padding column does
    not count as a failed test), best@k's f is the mean over 3, and per-dimension means skip the padded prompt."""
    from vpo_lightning.commands.evaluate import PromptPool, aggregate_metrics, prompt_metrics

    three = PromptPool({"id": "three"}, torch.tensor([[[1.0, 1.0, 1.0, 0.0]], [[1.0, 0.0, 0.0, 0.0]]]),
                       torch.ones(2, 1, dtype=torch.bool), ["a", "b"], 2, 0, torch.tensor([True, True, True, False]))
    four = PromptPool({"id": "four"}, torch.tensor([[[1.0, 1.0, 1.0, 1.0]], [[0.0, 0.0, 0.0, 1.0]]]),
                      torch.ones(2, 1, dtype=torch.bool), ["a", "b"], 2, 0, None)
    per = [prompt_metrics(p, seed=0, orders=4) for p in (three, four)]
    assert per[0]["num_solved"] == 1 and per[0]["pass_at_k"] == [0.5, 1.0]
    assert per[0]["best_at_k"][1] == 1.0 and sorted(per[0]["rewards"][1]) == [0.0, 0.0, 0.0, 1.0]
    assert per[0]["real_dims"] == [True, True, True, False] and per[1]["real_dims"] is None
    agg = aggregate_metrics([three, four], per, ["t0", "t1", "t2", "t3"], seed=0)
    assert agg["solved_fraction"] == 0.5  # one solver in each pool of 2
    # t0: (1 + 1) / 2 and (1 + 0) / 2 -> mean .75; t3 is real only for "four": (1 + 1) / 2 = 1
    assert agg["mean_reward"] == {"t0": 0.75, "t1": 0.5, "t2": 0.5, "t3": 1.0}
    assert agg["expected_best_weighted"] == pytest.approx((per[0]["expected_best_weighted"]
                                                           + per[1]["expected_best_weighted"]) / 2)


def test_eval_on_custom_data_without_a_test_file_names_data_file(tmp_path, tiny_model_dir, capsys):
    """Issue 53: a custom task's train file has no test file beside it; the error named data.train_files (wrong
    fix), and came after the model loaded. Now: before, naming --data_file."""
    cfg = yaml.safe_load(_config(tmp_path).read_text())
    (tmp_path / "my_prompts.jsonl").write_text((REPO / "data/tooluse/val.jsonl").read_text())
    cfg["data"]["train_files"] = [str(tmp_path / "my_prompts.jsonl")]
    (tmp_path / "custom.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as err:
        vpo(["eval", "--config", str(tmp_path / "custom.yaml"), "--n", "3", "--out", str(tmp_path / "out")])
    msg = capsys.readouterr().err
    assert err.value.code == 2 and "give the prompts to evaluate with --data_file FILE" in msg, msg
    assert f"no {tmp_path / 'test.jsonl'}" in msg and "--split val" in msg
