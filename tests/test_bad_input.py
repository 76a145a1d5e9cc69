"""Bad input is answered by a short, actionable ``vpo: error: ...`` (exit code 2, no traceback), end to end.

Every case goes through ``vpo_lightning.launcher.main([...])`` as the ``vpo`` command would, with stderr captured.
Machine-dependent cases (a GPU accelerator, vLLM) pretend there is no CUDA so that they behave alike everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vpo_lightning.launcher import main
from vpo_lightning.training import config_check

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "tooluse" / "val.jsonl"
CONFIG = REPO / "configs" / "debug.yaml"


def _base(train: Path | str = DATA) -> list[str]:
    return ["fit", "--config", str(CONFIG), f"--data.train_files=[{train}]", f"--data.val_files=[{DATA}]"]


def _error(args: list[str], capsys) -> str:
    """Run ``vpo`` with ``args``; it must exit with code 2 and a short error block. Returns that block, one line."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert "vpo: error:" in err, err[-2000:]
    block = err[err.index("vpo: error:"):].strip().splitlines()
    assert len(block) <= 4, "\n".join(block)  # one-line-ish: the message, maybe a hint, where to look
    assert "usage:" not in err  # no page of usage text
    return " ".join(line.strip() for line in block)


@pytest.fixture(autouse=True)
def _tmp_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outputs (checkpoints/) land in the test's directory


@pytest.fixture()
def no_cuda(monkeypatch):
    monkeypatch.setattr(config_check, "_has_cuda", lambda: False)


# ---------------------------------------------------------------------------------------- unknown keys, types


def test_misspelled_key_on_the_command_line_suggests_the_closest(capsys):
    msg = _error([*_base(), "--rollout.group_sise", "4"], capsys)
    assert "unknown key 'rollout.group_sise'" in msg and "command line" in msg
    assert "Did you mean 'rollout.group_size'?" in msg and "vpo fit --help" in msg


@pytest.fixture(scope="module")
def fit_parser():
    """The ``fit`` subcommand's parser, built once (parsing is what costs time here, not the checks)."""
    from vpo_lightning.training.cli import VPOCLI
    from vpo_lightning.training.datamodule import PromptDataModule
    from vpo_lightning.training.module import VPOModule

    holder = {}

    class Capture(VPOCLI):
        def parse_arguments(self, parser, args):
            holder["fit"] = self._subcommand_parsers["fit"]
            raise SystemExit(0)

    with pytest.raises(SystemExit):
        Capture(VPOModule, PromptDataModule, args=["fit"], parser_kwargs={"parser_mode": "omegaconf",
                                                                          "default_env": False})
    return holder["fit"]


@pytest.mark.parametrize(("key", "expected"), [
    ("trainer.max_stepz=3", "trainer.max_steps"),
    ("rolout.num_candidates=3", "rollout.num_candidates"),  # misspelled section
    ("model.lora.r", "model.model.lora.r"),  # right name, wrong section
    ("rollout.max_new_tokens=8", "rollout.sampling.max_new_tokens"),
    ("model.optim.max_grad_nrom", "model.optim.max_grad_norm"),
    ("checkpoint.every_n_steps", "checkpoint.every_n_train_steps"),
])
def test_unknown_keys_get_the_closest_valid_key(fit_parser, key, expected):
    [found] = config_check.find_unknown_keys(fit_parser, ["--" + key])
    assert found.suggestions[0] == expected, found


def test_known_keys_are_not_reported(fit_parser):
    argv = ["--config", str(CONFIG), "--rollout.group_size", "4", "--trainer.callbacks+=LearningRateMonitor",
            "--rollout.engine.init_args.max_batch_size=2", "--trainer.logger.init_args.save_dir=x", "--ckpt_path=last"]
    assert config_check.find_unknown_keys(fit_parser, argv) == []


def test_misspelled_key_in_a_yaml_file_names_the_file_and_suggests(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_size: 4\n  sampling:\n    max_new_tokns: 8\nmodel:\n  optim:\n    lr: 1.0e-4\n")
    msg = _error([*_base(), "--config", str(bad)], capsys)
    assert "unknown key 'rollout.sampling.max_new_tokns'" in msg and str(bad) in msg
    assert "Did you mean 'rollout.sampling.max_new_tokens'?" in msg


def test_misspelled_subcommand(capsys):
    msg = _error(["fti", "--config", str(CONFIG)], capsys)
    assert "unknown command 'fti'" in msg and "Did you mean 'fit'?" in msg


@pytest.mark.parametrize(("args", "expected"), [
    (["--rollout.group_size=many"], 'rollout.group_size": Expected a <class \'int\'>. Got value: many'),
    (["--rollout.estimator=vpoo"], "'grpo'"),  # lists the accepted values
])
def test_wrong_types_name_the_key_and_what_it_expects(args, expected, capsys):
    msg = _error([*_base(), *args], capsys)
    assert expected in msg


def test_wrong_type_in_a_yaml_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_size: many\n")
    assert "rollout.group_size" in _error([*_base(), "--config", str(bad)], capsys)


def test_config_check_keys_are_those_of_the_parser(fit_parser):
    """No false positives: every key of every shipped config is known (class-typed values are not looked into)."""
    import yaml

    leaves, sections = config_check.known_keys(fit_parser)
    assert {"rollout.group_size", "model.model.lora.r", "trainer.max_steps", "data.batch_size"} <= leaves
    for path in sorted((REPO / "configs").glob("*.yaml")):
        if path.name.endswith("_sft.yaml"):
            continue  # `vpo sft` configs have the SFT parser's keys; tests/test_sft.py parses them with it
        data = yaml.safe_load(path.read_text())
        assert config_check.config_file_keys(data, leaves, sections) == [], path.name


# ------------------------------------------------------------------------------------------------ bad values


@pytest.mark.parametrize(("args", "expected"), [
    (["--rollout.num_candidates=0"], "rollout.num_candidates (m) must be >= 1, got 0"),
    (["--rollout.group_size=1"], "rollout.group_size (G) must be >= 2"),
    (["--rollout.estimator=grpo", "--rollout.group_size=1"], "rollout.group_size (G) must be >= 2"),
    (["--rollout.num_weights=0"], "rollout.num_weights (K) must be >= 1, got 0"),
    (["--rollout.alpha=0"], "rollout.alpha (Dirichlet concentration) must be > 0"),
])
def test_out_of_range_values(args, expected, capsys):
    assert expected in _error([*_base(), *args], capsys)


def test_more_out_of_range_values():
    """The same checks without a CLI round trip each (they run in the constructors the CLI calls)."""
    from vpo_lightning.generation.engines import SamplingSettings
    from vpo_lightning.training.datamodule import PromptDataModule
    from vpo_lightning.training.sampler import validate_settings as _validate

    for kwargs, match in (({"alpha": -1.0}, "alpha"), ({"alpha": float("nan")}, "alpha"), ({"m": -3}, "num_candidates"),
                          ({"group_size": 0}, "group_size"), ({"num_weights": -1}, "num_weights")):
        args = {"estimator": "vpo", "m": 3, "group_size": 4, "num_weights": 8, "alpha": 1.0, **kwargs}
        with pytest.raises(ValueError, match=match):
            _validate(**args)
    with pytest.raises(ValueError, match="data.batch_size must be >= 1"):
        PromptDataModule(train_files=[str(DATA)], batch_size=0)
    for kwargs, match in (({"temperature": 0}, "temperature"), ({"top_p": 0}, "top_p"),
                          ({"max_new_tokens": 0}, "max_new_tokens")):
        with pytest.raises(ValueError, match=match):
            SamplingSettings(**kwargs)


def test_unregistered_reward_lists_the_registered_ones(capsys):
    msg = _error([*_base(), "--rollout.rewards=[format,tool_nam]"], capsys)
    assert "unknown reward 'tool_nam'" in msg and "Did you mean 'tool_name'?" in msg
    assert "Registered rewards:" in msg and "arg_value" in msg and "maze" in msg


# ------------------------------------------------------------------------------------------------- bad data


GOOD = '{"messages": [{"role": "user", "content": "hi"}]}\n'


@pytest.mark.parametrize(("content", "expected"), [
    (None, "does not exist (check data.train_files"),
    ("", "is empty: it needs one JSON record per line"),
    (GOOD + "{oops\n", "train.jsonl:2: not valid JSON"),
    (GOOD + '{"question": "hi"}\n', "train.jsonl:2: missing field 'messages'"),  # TRL's 'prompt' is read
    (GOOD + '{"prompt": 3}\n', "train.jsonl:2: 'prompt' must be a string"),
])
def test_bad_data_files_name_the_file_and_line(content, expected, tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    if content is not None:
        path.write_text(content)
    assert expected in _error(_base(path), capsys)


@pytest.mark.parametrize(("content", "expected"), [
    ("\n\n", "is empty"),
    ('["a list"]\n', "train.jsonl:1: expected a JSON object"),
    ('{"messages": [{"role": "user"}]}\n', "train.jsonl:1: messages[0] must be"),
    ('{"messages": [{"role": "robot", "content": "x"}]}\n', "train.jsonl:1: messages[0] must be"),
    ('{"messages": "hi"}\n', "train.jsonl:1: 'messages' must be a non-empty list"),
    ('{"messages": []}\n', "train.jsonl:1: 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "train.jsonl:1: the last message must have role"),
    (GOOD + GOOD + '{"messages": [{"role": "user", "content": 3}]}\n', "train.jsonl:3: messages[0]"),
    (GOOD + "\x00\n", "train.jsonl:2: not valid JSON"),
])
def test_more_bad_records(content, expected, tmp_path):
    from vpo_lightning.training.records import read_jsonl

    path = tmp_path / "train.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError) as err:
        read_jsonl(path)
    assert expected in str(err.value)


def test_not_utf8_names_the_file(tmp_path):
    from vpo_lightning.training.records import read_jsonl

    path = tmp_path / "train.jsonl"
    path.write_bytes(GOOD.encode() + b'{"messages": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match=r"train.jsonl:2: not UTF-8 text \(byte 0xff at column 15\)"):
        read_jsonl(path)


def test_fewer_prompts_than_a_batch(tmp_path):
    from vpo_lightning.training.datamodule import PromptDataModule

    path = tmp_path / "train.jsonl"
    path.write_text(GOOD)
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptDataModule(train_files=[str(path)], batch_size=2).setup("fit")


def test_data_path_that_is_a_directory_says_so(tmp_path, capsys):
    folder = tmp_path / "tooluse"
    folder.mkdir()
    (folder / "train.jsonl").write_text(GOOD)
    msg = _error(_base(folder), capsys)
    assert f"data file '{folder}' is a directory" in msg and "does not exist" not in msg
    assert "train.jsonl" in msg  # the JSONL files inside, as the fix


# ---------------------------------------------------------------------------------------- YAML syntax errors


@pytest.mark.parametrize(("text", "line", "expected"), [
    ("trainer:\n  max_steps: [1\n", 3, "expected ',' or ']'"),
    ("trainer:\n\tmax_steps: 1\n", 2, "a tab character: YAML indents with spaces"),
    ("trainer:\n  max_steps: 1\n  max_steps: 2\n", 3, "key 'max_steps' is given twice (first on line 2)"),
    ("trainer: {max_steps: 1\n", 2, "expected ',' or '}'"),
])
def test_bad_yaml_names_the_file_and_line(text, line, expected, tmp_path, capsys):
    path = tmp_path / "my run.yaml"
    path.write_text(text)
    msg = _error([*_base(), "--config", str(path)], capsys)
    assert f"config file {str(path)!r}, line {line}" in msg, msg
    assert expected in msg, msg
    assert "<unicode string>" not in msg and "<file>" not in msg


def test_missing_config_file_is_named(tmp_path, capsys):
    msg = _error(["fit", "--config", str(tmp_path / "nope.yaml")], capsys)
    assert f"config file {str(tmp_path / 'nope.yaml')!r} does not exist" in msg, msg


# ------------------------------------------------------------------------------------------ models, machines


def test_model_path_that_does_not_exist(capsys):
    msg = _error([*_base(), "--model.model.name=/nonexistent/model"], capsys)
    assert "no such file or directory" in msg and "tiny-llama" in msg  # and names what would work


def test_model_directory_without_config(tmp_path):
    from vpo_lightning.generation.models import resolve_model_path

    (tmp_path / "empty_model").mkdir()
    with pytest.raises(FileNotFoundError, match="without config.json"):
        resolve_model_path(str(tmp_path / "empty_model"))
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        resolve_model_path(str(tmp_path / "model.gguf"))


def test_hub_id_while_offline(monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time otherwise
    msg = _error([*_base(), "--model.model.name=vpo-test/not-a-cached-model"], capsys)
    assert "cannot fetch it from the Hugging Face hub" in msg and "Offline, use the built-in alias" in msg


def test_flash_attention_without_the_package_or_a_gpu(no_cuda, capsys):
    msg = _error([*_base(), "--model.model.attn_implementation=flash_attention_2"], capsys)
    assert "flash_attention_2 needs" in msg and "--model.model.attn_implementation=sdpa" in msg


def test_vllm_engine_without_the_package_or_a_gpu(no_cuda, capsys):
    msg = _error([*_base(), "--rollout.engine=vpo_lightning.generation.engines.VLLMEngine"], capsys)
    assert "VLLMEngine needs" in msg and "TransformersEngine" in msg


def test_gpu_accelerator_without_a_gpu(no_cuda, capsys):
    msg = _error([*_base(), "--trainer.accelerator=gpu"], capsys)
    assert "trainer.accelerator=gpu but torch sees no CUDA GPU" in msg and "--trainer.accelerator=cpu" in msg


def test_lightning_misconfiguration_is_a_clean_error(capsys):
    """Lightning's own configuration errors (MisconfigurationException) end as a one-line error too."""
    msg = _error([*_base(), "--trainer.enable_progress_bar=false"], capsys)
    assert "enable_progress_bar=False" in msg


# --------------------------------------------------------- Lightning's trainer keys that the project does not use


@pytest.mark.parametrize(("flag", "expected"), [
    ("--trainer.precision=bf16-mixed", "trainer.precision=bf16-mixed: mixed precision is not supported here (the "
                                       "policy is loaded in one dtype, which the rollout engine shares, and its LoRA "
                                       "weights train in fp32); set --model.model.dtype bf16"),
    ("--trainer.precision=16-mixed", "set --model.model.dtype fp16"),
    ("--trainer.gradient_clip_val=0.5", "set --model.optim.max_grad_norm 0.5"),
    ("--trainer.accumulate_grad_batches=4", "raise --data.batch_size (x4)"),
])
def test_lightning_keys_the_project_does_not_use_fail_up_front_with_its_key(flag, expected, capsys):
    """Issue 53: ``vpo fit --help`` lists Lightning's trainer keys; these three used to fail mid-run (a 147-line
    error for bf16-mixed) or do nothing. Now: one line before the model loads, naming the project's key."""
    msg = _error([*_base(), flag], capsys)
    assert expected in msg, msg
    assert not Path("checkpoints").exists()  # nothing loaded, nothing written


def test_lightning_keys_at_their_defaults_pass(fit_parser):
    cfg = fit_parser.parse_args(["--config", str(CONFIG), "--trainer.precision=32-true",
                                 "--trainer.accumulate_grad_batches=1"])
    assert config_check.lightning_only_keys(cfg) == []


@pytest.mark.parametrize(("trl", "ours"), [
    ("report_to", "trainer.logger"), ("warmup_ratio", "model.optim.warmup_steps"),
    ("lr_scheduler_type", "model.optim.schedule"), ("eval_steps", "trainer.val_check_interval"),
    ("save_total_limit", "checkpoint.keep_last"), ("scale_rewards", "rollout.estimator"),
    ("log_completions", "rollout.log_samples_every"),
])
def test_more_trl_names_get_our_key(fit_parser, trl, ours):
    [found] = config_check.find_unknown_keys(fit_parser, [f"--{trl}=1"])
    assert found.suggestions == (ours,) and f"({trl} is TRL's name: " in found.message(), found.message()


# ------------------------------------------------------------------ push_to_hub: checked before training (issue 53)


@pytest.fixture()
def no_hub_login(tmp_path, monkeypatch):
    """No token anywhere: an empty HF_HOME, no HF_TOKEN."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


def test_push_to_hub_without_a_token_fails_before_training(no_hub_login, capsys):
    msg = _error([*_base(), "--checkpoint.push_to_hub=true", "--checkpoint.hub_model_id=me/tiny"], capsys)
    assert "checkpoint.push_to_hub: pushing to the Hugging Face hub needs a token with write access: run " \
           "`huggingface-cli login` or set HF_TOKEN" in msg
    assert not Path("checkpoints").exists()  # nothing trained, nothing written


def test_push_to_hub_with_the_hub_out_of_reach_fails_before_training(no_hub_login, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    msg = _error([*_base(), "--checkpoint.push_to_hub=true", "--checkpoint.hub_model_id=me/tiny"], capsys)
    assert "http://127.0.0.1:9 cannot be reached" in msg and not Path("checkpoints").exists()


def test_export_push_to_hub_without_a_token_fails_before_merging(no_hub_login, tmp_path, capsys):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    with pytest.raises(SystemExit) as exc:  # dashes, as in every other command (issue 53: export took only _)
        main(["export", "--adapter", str(adapter), "--push-to-hub", "--hub-model-id", "me/tiny"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--push_to_hub: pushing to the Hugging Face hub needs a token" in err
