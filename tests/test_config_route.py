"""One route from a config to objects: ``vpo eval``/``search``/``plan`` parse a `vpo fit` config with the parser
``vpo fit`` uses (vpo_lightning/training/config.py), so a default lives in one signature, and the engine is told
apart by its parsed class, not by its name."""

from __future__ import annotations

import inspect
import sys
import types
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from vpo_lightning.commands import evaluate, runs
from vpo_lightning.commands import plan as vplan
from vpo_lightning.generation.engines import SamplingSettings, TransformersEngine, VLLMEngine
from vpo_lightning.training import config_check
from vpo_lightning.training.cli import VPOCLI
from vpo_lightning.training.config import apply_overrides, fit_parser, get, resolve
from vpo_lightning.training.config_keys import rename_old_flags
from vpo_lightning.training.datamodule import PromptDataModule
from vpo_lightning.training.module import VPOModule
from vpo_lightning.training.rollout import RolloutCallback
from vpo_lightning.training.sampler import EvalSettings, Sampler
from vpo_lightning.training.schema import FIT

# A config that leaves every rollout knob but the rewards to the defaults.
BARE = """\
run_name: bare
model:
  model: {name: tiny-llama}
data:
  train_files: [train.jsonl]
rollout:
  rewards: [maze]
"""


def _fit(path: Path) -> VPOCLI:
    """What `vpo fit` builds from ``path`` (parsed and instantiated, nothing run)."""
    return VPOCLI(VPOModule, PromptDataModule, args=["--config", str(path), "--trainer.accelerator=cpu",
                                                     "--trainer.devices=1"], run=False,
                  parser_kwargs={"parser_mode": "omegaconf", "default_env": False})


def _resolved_by_fit_and_eval(tmp_path: Path, monkeypatch) -> tuple[RolloutCallback, Sampler, VPOCLI]:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "bare.yaml"
    path.write_text(BARE)
    cli = _fit(path)
    fit = next(c for c in cli.trainer.callbacks if isinstance(c, RolloutCallback))
    return fit, evaluate.eval_sampler(runs.load_config(path, require=("rollout",))), cli


def _knobs(protocol) -> tuple:
    return protocol.estimator, protocol.m, protocol.num_weights, protocol.alpha, protocol.tag_family


def test_eval_and_fit_resolve_the_same_defaults(tmp_path, monkeypatch):
    fit, sampler, cli = _resolved_by_fit_and_eval(tmp_path, monkeypatch)
    assert _knobs(fit.protocol) == _knobs(sampler.protocol) == ("vpo", 3, 100, 1.0, "response")
    assert (fit.m, fit.num_weights, fit.alpha, fit.tag_family) == (3, 100, 1.0, "response")  # read from protocol
    assert fit.sampling == SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256)
    assert cli.config_init["eval"] == EvalSettings(temperature=0.7, top_p=1.0)
    assert sampler.sampling == SamplingSettings(temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=256)
    settings = runs.run_settings(runs.load_config(tmp_path / "bare.yaml"))
    assert (settings.group_size, settings.batch_size) == (fit.group_size, cli.datamodule.batch_size) == (8, 2)
    assert settings.optim == cli.model.optim_settings and settings.model == cli.model.model_settings


def _with_defaults(fn, **new) -> tuple:
    """``fn.__defaults__`` with the named parameters' defaults replaced."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.default is not inspect.Parameter.empty]
    return tuple(new.get(p.name, p.default) for p in params)


def test_a_default_lives_in_one_signature(tmp_path, monkeypatch):
    """Change RolloutCallback's and EvalSettings' defaults and both routes follow: nothing re-types 3, 100, 1.0,
    "response", 0.7."""
    monkeypatch.setattr(RolloutCallback.__init__, "__defaults__", _with_defaults(
        RolloutCallback.__init__, num_candidates=4, num_weights=7, alpha=0.5, tag_family="route"))
    monkeypatch.setattr(EvalSettings.__init__, "__defaults__", (0.9, 0.8))
    fit, sampler, _ = _resolved_by_fit_and_eval(tmp_path, monkeypatch)
    assert _knobs(fit.protocol) == _knobs(sampler.protocol) == ("vpo", 4, 7, 0.5, "route")
    assert (sampler.sampling.temperature, sampler.sampling.top_p) == (0.9, 0.8)


@pytest.fixture
def engines(monkeypatch):
    """A module of engine subclasses whose names mislead: a TransformersEngine named like vLLM, a VLLMEngine not."""
    mod = types.ModuleType("vpo_test_engines")

    class VLLMStyleTransformersEngine(TransformersEngine):
        pass

    class GpuEngine(VLLMEngine):
        pass

    for cls in (VLLMStyleTransformersEngine, GpuEngine):
        cls.__module__ = mod.__name__
        setattr(mod, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def _engine_cfg(name: str, **init_args) -> dict:
    return {"rollout": {"engine": {"class_path": f"vpo_test_engines.{name}", "init_args": init_args}}}


def test_the_engine_is_told_by_its_parsed_class(engines):
    hf = runs.run_settings(_engine_cfg("VLLMStyleTransformersEngine", max_batch_size=4))
    assert hf.engine == "VLLMStyleTransformersEngine" and hf.engine_class is engines.VLLMStyleTransformersEngine
    assert hf.engine_args["max_batch_size"] == 4 and "gpu_memory_utilization" not in hf.engine_args
    assert not vplan.plan_from_config(_engine_cfg("VLLMStyleTransformersEngine"), for_gpu=True).vllm

    gpu = runs.run_settings(_engine_cfg("GpuEngine", max_model_len=2048))
    assert gpu.engine_class is engines.GpuEngine and gpu.engine_args["gpu_memory_utilization"] == 0.3
    plan = vplan.plan_from_config(_engine_cfg("GpuEngine"), for_gpu=True)
    assert plan.vllm and plan.vllm_utilization == 0.3

    if not config_check._has_cuda():  # the pre-flight check of `vpo fit` tells them apart the same way
        assert any("VLLMEngine needs" in p for p in config_check.preflight(_engine_cfg("GpuEngine")))
        assert config_check.preflight(_engine_cfg("VLLMStyleTransformersEngine")) == []


def test_bad_values_are_refused_as_vpo_fit_refuses_them(tmp_path, caplog):
    with pytest.raises(ValueError, match=r"c\.yaml: .*rollout\.num_candidates"):
        resolve({"rollout": {"rewards": ["maze"], "num_candidates": "three"}}, "c.yaml")
    with pytest.raises(ValueError, match="rollout.estimator"):
        evaluate.eval_sampler({"rollout": {"rewards": ["maze"]}}, estimator="vpoo")
    with pytest.raises(ValueError, match="c.yaml: rollout.rewards is required"):
        resolve({"rollout": {}}, "c.yaml").rollout()
    run = resolve({"rollout": {"rewards": ["maze"], "num_candidate": 4}}, "c.yaml")  # misspelt: ignored, named
    assert run.value("rollout.num_candidates") == 3
    assert "c.yaml: rollout.num_candidate is not a `vpo fit` key (did you mean rollout.num_candidates" in caplog.text


class _Built(Exception):
    """Raised where VPOCLI would parse: carries the subcommand parsers it built."""


def _cli_parser(subcommand: str):
    class Stop(VPOCLI):
        def parse_arguments(self, parser, args):
            raise _Built(self._subcommand_parsers)

    with pytest.raises(_Built) as built:
        Stop(args=[], **FIT.cli_kwargs())
    return built.value.args[0][subcommand]


def _described(parser) -> tuple:
    actions = sorted((a.dest, tuple(a.option_strings), str(getattr(a, "_typehint", None)), repr(a.default))
                     for a in parser._actions)
    return (parser.prog, parser.parser_mode, parser.description,
            parser.dump(parser.get_defaults(), skip_check=True), actions)


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_the_resolver_parses_with_the_parser_vpo_fit_builds(subcommand):
    """One schema: VPOCLI's subcommand parser and the resolver's (built without a CLI) have the same arguments,
    types, defaults, mode and prog; configs parse to the same values."""
    cli_parser, alone = _cli_parser(subcommand), FIT.parser(subcommand)
    assert _described(cli_parser) == _described(alone)
    assert alone.exit_on_error is False and fit_parser().prog == "vpo [options] fit"
    config = str(Path(__file__).resolve().parents[1] / "configs" / "debug.yaml")
    assert cli_parser.dump(cli_parser.parse_args(["--config", config])) == alone.dump(alone.parse_args(
        ["--config", config]))


def test_settings_are_read_without_building_a_module(tmp_path, monkeypatch):
    """`vpo plan`/`eval` read model.optim, model.loss, model.model and rollout.sampling from the parsed config: no
    VPOModule or RolloutCallback is instantiated."""
    (tmp_path / "bare.yaml").write_text(BARE.replace("model: {name: tiny-llama}",
                                                     "model: {name: tiny-llama}\n  optim: {lr: 0.003}"))

    def refuse(*args, **kwargs):
        raise AssertionError("a module or callback was built")

    monkeypatch.setattr(VPOModule, "save_hyperparameters", refuse)  # VPOModule.__init__ calls these
    monkeypatch.setattr("vpo_lightning.training.rollout.chain_protocol", refuse)  # and RolloutCallback.__init__
    settings = runs.run_settings(runs.load_config(tmp_path / "bare.yaml"))
    assert settings.optim.lr == 0.003 and settings.optim.micro_batch_size == 8
    assert settings.loss.beta == 1e-3 and settings.model.lora.r == 16 and settings.sampling.max_new_tokens == 256


def test_one_apply_overrides(tmp_path):
    base = {"model": {"model": {"name": "a", "lora": {"r": 4, "alpha": 8}}}, "data": {"files": [1, 2]}}
    out = apply_overrides(base, {"model.model.lora": {"r": 16}, "data.files": [3], "rollout.group_size": 4,
                                 "run_name": "x"})
    assert out == {"model": {"model": {"name": "a", "lora": {"r": 16, "alpha": 8}}}, "data": {"files": [3]},
                   "rollout": {"group_size": 4}, "run_name": "x"}
    assert base["model"]["model"]["lora"] == {"r": 4, "alpha": 8} and base["data"]["files"] == [1, 2]
    assert apply_overrides({"a": 1}, {"a.b": 2}) == {"a": {"b": 2}}
    # --set KEY=VALUE: values read as YAML (1e-4 is a number), ${...} resolved after the overrides
    path = tmp_path / "c.yaml"
    path.write_text("run_name: a\ndata: {name: '${run_name}-data'}\nmodel: {optim: {lr: 0.1}}\n")
    cfg = runs.load_config(path, ["run_name=b", "model.optim.lr=1e-4", "model.optim.num_iterations=2"])
    assert cfg == {"run_name": "b", "data": {"name": "b-data"}, "model": {"optim": {"lr": 1e-4, "num_iterations": 2}}}


def test_one_dotted_key_reader():
    nested = {"a": {"b": {"c": 1, "none": None}}}
    assert get(nested, "a.b.c") == 1 and get(nested, "a.b.none", 5) == 5 and get(nested, "a.x.c", 2) == 2
    assert get(Namespace(a=Namespace(b=Namespace(c=1))), "a.b.c") == 1
    assert get(Namespace(a=Namespace(b=1)), "a.z", "d") == "d"
    assert get(types.SimpleNamespace(a=types.SimpleNamespace(b=3)), "a.b") == 3
    assert get({"a": "text"}, "a.b", 0) == 0


def test_load_model_types_the_model_section_as_vpo_fit_does(tmp_path, monkeypatch):
    """`vpo eval/search/serve/export` load the policy with the model settings `vpo fit` would build: the same
    defaults (from ModelSettings' signature) and the same type checks, naming the key."""
    _, _, cli = _resolved_by_fit_and_eval(tmp_path, monkeypatch)
    assert runs._model_settings({"name": "tiny-llama"}) == cli.model.model_settings
    built = runs._model_settings({"name": "tiny-llama", "lora": {"r": "4"}, "dtype": "fp32"})
    assert (built.lora.r, built.lora.alpha, built.dtype, built.attn_implementation) == (4, 32, "fp32", "sdpa")
    with pytest.raises(ValueError, match=r"model\.model\.lora\.r"):
        runs._model_settings({"name": "tiny-llama", "lora": {"r": "sixteen"}})
    with pytest.raises(ValueError, match=r"model\.model\.dtype"):
        runs._model_settings({"name": "tiny-llama", "dtype": "bfloat17"})


def test_a_renamed_engine_key_is_read_in_saved_configs_and_by_vpo_fit(tmp_path, caplog):
    """A run saved before `pack_weights` became `prepack_weights` (its config.yaml lists every engine argument)
    still evaluates, and `vpo fit`'s parser reads the old key as the new one (it is no unknown key)."""
    old = {"rollout": {"rewards": ["maze"], "engine": {
        "class_path": "vpo_lightning.generation.engines.TransformersEngine", "init_args": {"pack_weights": False}}}}
    run = resolve(old, "old/config.yaml")
    assert run.engine_args()["prepack_weights"] is False
    assert "old/config.yaml: rollout.engine.init_args.pack_weights is now rollout.engine.init_args.prepack_weights; " \
           "read as such" in caplog.text
    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  rewards: [maze]\n  engine:\n    init_args:\n      pack_weights: false\n")
    assert fit_parser().parse_path(str(path), _skip_validation=True).rollout.engine.init_args.prepack_weights is False
    assert config_check.find_unknown_keys(fit_parser(), ["--config", str(path)]) == []


def test_old_eval_keys_are_read_as_the_eval_section_on_every_route(tmp_path, caplog):
    """`rollout.eval_temperature` / `eval_top_p` (before the `eval:` section) in a config, in overrides and in a
    `vpo fit` config file are read as `eval.temperature` / `eval.top_p` with a one-line notice each; where the old
    and the new key are both given, the new one wins."""
    old = {"rollout": {"rewards": ["maze"], "eval_temperature": 0.6, "eval_top_p": 0.9}}
    run = resolve(old, "old/config.yaml")
    assert run.eval_sampling() == SamplingSettings(temperature=0.6, top_p=0.9, top_k=0, max_new_tokens=256)
    assert run.sampling() == SamplingSettings()  # training sampling is untouched
    assert "old/config.yaml: rollout.eval_temperature is now eval.temperature; read as such" in caplog.messages
    assert "old/config.yaml: rollout.eval_top_p is now eval.top_p; read as such" in caplog.messages
    assert old["rollout"]["eval_temperature"] == 0.6  # the caller's mapping is left as it was
    both = {"rollout": {"rewards": ["maze"], "eval_temperature": 0.6}, "eval": {"temperature": 0.5}}
    assert resolve(both).eval_sampling().temperature == 0.5
    new_file = {"rollout": {"rewards": ["maze"]}, "eval": {"temperature": 0.8}}  # an old key as an override wins
    assert resolve(new_file, overrides={"rollout.eval_temperature": 0.6}).eval_sampling().temperature == 0.6
    assert resolve(new_file, overrides={"rollout.eval_temperature": 0.6, "eval.temperature": 0.4}).eval_sampling(
        ).temperature == 0.4
    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  rewards: [maze]\n  eval_temperature: 0.6\n")
    parsed = fit_parser().parse_path(str(path), _skip_validation=True)
    assert (parsed.eval.temperature, parsed.eval.top_p) == (0.6, 1.0) and "eval_temperature" not in parsed.rollout
    assert f"{path}: rollout.eval_temperature is now eval.temperature; read as such" in caplog.messages
    assert config_check.find_unknown_keys(fit_parser(), ["--config", str(path)]) == []


def test_old_flags_are_spelt_as_their_new_keys(caplog):
    assert rename_old_flags(["--rollout.eval_temperature", "0.6", "--rollout.eval_top_p=0.9", "--x", "1"]) == [
        "--eval.temperature", "0.6", "--eval.top_p=0.9", "--x", "1"]
    assert caplog.messages == ["the command line: rollout.eval_temperature is now eval.temperature; read as such",
                               "the command line: rollout.eval_top_p is now eval.top_p; read as such"]
    assert rename_old_flags(["--rollout.eval_temperature", "0.6", "--eval.temperature=0.4"]) == [
        "--eval.temperature=0.4"]  # the new key wins, wherever it stands


def test_eval_settings_are_checked_naming_their_keys():
    with pytest.raises(ValueError, match=r"eval\.temperature must be > 0, got 0"):
        EvalSettings(temperature=0)
    with pytest.raises(ValueError, match=r"eval\.top_p must be in \(0, 1\], got 1.5"):
        EvalSettings(top_p=1.5)
    with pytest.raises(ValueError, match=r"eval\.top_p"):
        resolve({"eval": {"top_p": 0}}).eval_sampling()


def test_a_moved_class_path_is_read_in_saved_configs_and_named_for_vpo_fit(tmp_path, caplog, capsys):
    """A run saved before the package's layers names `vpo_lightning.engines.TransformersEngine` in its config.yaml:
    the commands read it under its new path; `vpo fit` names the new path instead of an import error."""
    from vpo_lightning.launcher import main

    old = {"rollout": {"rewards": ["maze"], "engine": {"class_path": "vpo_lightning.engines.TransformersEngine",
                                                       "init_args": {"max_batch_size": 3}}},
           "trainer": {"callbacks": [{"class_path": "vpo_lightning.progress.StepProgressBar"}]}}
    run = resolve(old, "old/config.yaml")
    assert run.engine_class() is TransformersEngine and run.engine_args()["max_batch_size"] == 3
    assert "class_path vpo_lightning.engines.TransformersEngine is now vpo_lightning.generation." in caplog.text
    assert old["trainer"]["callbacks"][0]["class_path"] == "vpo_lightning.progress.StepProgressBar"  # not mutated
    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  rewards: [maze]\n  engine:\n"
                    "    class_path: vpo_lightning.engines.TransformersEngine\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(path)])
    err = capsys.readouterr().err
    assert "class_path vpo_lightning.engines.TransformersEngine moved: use vpo_lightning.generation.engines." in err


REPO = Path(__file__).resolve().parents[1]
DATA = str(REPO / "data/tooluse/val.jsonl")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread", "tiny_model_dir")
def test_a_run_saved_with_the_old_eval_keys_evaluates_and_resumes_under_eval(tmp_path, monkeypatch, caplog):
    """A real tiny-model run: `--set rollout.eval_temperature=0.6` samples at 0.6 with a notice, the new key beats
    the old; its config.yaml rewritten to the old keys at 0.6 / 0.9 (a run saved before the `eval:` section)
    evaluates at 0.6 / 0.9 and resumes with `--ckpt_path last`, saving them under `eval:`."""
    import json

    import yaml

    from vpo_lightning.launcher import main as vpo

    monkeypatch.chdir(tmp_path)
    vpo(["fit", "--config", str(REPO / "configs/debug.yaml"), f"--data.train_files=[{DATA}]",
         f"--data.val_files=[{DATA}]", "--run_name=old", "--trainer.max_steps=1"])
    saved = tmp_path / "checkpoints" / "old" / "config.yaml"
    cfg = yaml.safe_load(saved.read_text())
    assert cfg["eval"] == {"temperature": 0.7, "top_p": 1.0} and "eval_temperature" not in cfg["rollout"]

    def evaluate(out: str, *sets: str) -> dict:
        vpo(["eval", "--ckpt", "checkpoints/old/last.ckpt", "--n", "3", "--max_prompts", "1", "--max_prompt_tokens",
             "0", "--data_file", DATA, "--out", out, *(a for s in sets for a in ("--set", s))])
        sampling = json.loads((tmp_path / out / "eval.json").read_text())["sampling"]
        return {k: sampling[k] for k in ("temperature", "top_p", "max_new_tokens")}

    caplog.clear()
    assert evaluate("e1", "rollout.eval_temperature=0.6") == {"temperature": 0.6, "top_p": 1.0, "max_new_tokens": 24}
    assert "--set: rollout.eval_temperature is now eval.temperature; read as such" in caplog.messages
    assert evaluate("e2", "rollout.eval_temperature=0.6", "eval.temperature=0.5")["temperature"] == 0.5

    del cfg["eval"]
    cfg["rollout"].update(eval_temperature=0.6, eval_top_p=0.9)
    saved.write_text(yaml.safe_dump(cfg, sort_keys=False))
    caplog.clear()
    assert evaluate("e3") == {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 24}
    assert "checkpoints/old/config.yaml: rollout.eval_top_p is now eval.top_p; read as such" in caplog.messages

    caplog.clear()
    vpo(["fit", "--config", str(saved), "--trainer.max_steps=2", "--ckpt_path=last"])
    assert f"{saved}: rollout.eval_temperature is now eval.temperature; read as such" in caplog.messages
    resaved = yaml.safe_load(saved.read_text())
    assert resaved["eval"] == {"temperature": 0.6, "top_p": 0.9} and "eval_top_p" not in resaved["rollout"]
    assert resaved["rollout"]["sampling"]["temperature"] == 1.0  # training sampling as before
    assert torch.load(saved.parent / "last.ckpt", weights_only=False)["global_step"] == 2
