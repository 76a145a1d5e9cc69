"""The schema of a run: which classes ``vpo fit`` and ``vpo sft`` build, their sections, links and defaults.

One :class:`Schema` per command (:data:`FIT` here, ``vpo_lightning.sft.cli.SFT``). Both consumers are built from it:
:class:`~vpo_lightning.training.cli.VPOCLI` builds its parsers through the schema's hooks, and the config resolver
(:func:`vpo_lightning.training.config.resolve`, used by ``vpo eval``/``search``/``serve``/``plan``/``export``) calls
:meth:`Schema.parser`, which builds the same ``fit`` parser with the same calls, without a CLI and without parsing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from jsonargparse import ActionConfigFile, ActionYesNo
from lightning.pytorch import Trainer
from lightning.pytorch import __version__ as lightning_version
from lightning.pytorch.cli import LightningArgumentParser

from vpo_lightning.training.checkpointing import AdapterCheckpoint
from vpo_lightning.training.config_keys import rename_old_keys
from vpo_lightning.training.datamodule import PromptDataModule
from vpo_lightning.training.module import VPOModule
from vpo_lightning.training.rollout import RolloutCallback
from vpo_lightning.training.sampler import EvalSettings

OUTPUT_ROOT = "checkpoints"
SEED_DEFAULT = 0  # seed_everything of a config that sets none: reproducible, and no "No seed found" warning
# the main parser's keyword arguments: ${...} interpolation in configs, no environment variables
PARSER_KWARGS: dict[str, Any] = {"parser_mode": "omegaconf", "default_env": False, "prog": "vpo"}
# ``fit`` and ``validate`` only (LightningCLI's ``test``/``predict`` have no meaning here: ``vpo eval``), each with
# the arguments of its Trainer method that are not set from the command line
SUBCOMMANDS: dict[str, set[str | int]] = {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
                                          "validate": {"model", "dataloaders", "datamodule"}}

# Trainer defaults of `vpo fit` and `vpo sft`: TensorBoard under checkpoints/<run_name>/, the step progress bar.
TRAINER_DEFAULTS: dict[str, Any] = {
    "trainer.max_steps": 100,
    "trainer.log_every_n_steps": 1,
    "trainer.num_sanity_val_steps": 0,
    "trainer.enable_model_summary": False,
    # no epoch (a function of the step), hp_metric (a constant -1) or LearningRateMonitor (its lr-AdamW repeats
    # train/lr): tags that say nothing; docs/TRAINING.md lists the rest
    "trainer.logger": {"class_path": "vpo_lightning.training.tensorboard_logger.TensorBoardLogger",
                       "init_args": {"save_dir": OUTPUT_ROOT, "name": "", "version": "", "default_hp_metric": False}},
    "trainer.callbacks": [{"class_path": "vpo_lightning.training.progress.StepProgressBar"}],
    "trainer.check_val_every_n_epoch": None,
    "trainer.val_check_interval": 50,
}


class ConfigParser(LightningArgumentParser):
    """The parser of ``vpo fit``/``vpo sft`` and their subcommands: a config it loads (a ``--config`` file, a saved
    ``config.yaml`` resumed with ``--ckpt_path last``, a mapping the resolver parses) has its renamed keys read as
    their new ones (:func:`~vpo_lightning.training.config_keys.rename_old_keys`), each with a one-line notice."""

    _source = "the config"  # the file being loaded, for the notice

    def parse_path(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        saved, self._source = self._source, str(path)
        try:
            return super().parse_path(path, *args, **kwargs)
        finally:
            self._source = saved

    def _apply_actions(self, cfg: Any, parent_key: str = "", prev_cfg: Any = None, skip_fn: Any = None) -> Any:
        # every loaded config reaches the parser's actions here as one plain mapping (jsonargparse 4.x)
        if isinstance(cfg, dict) and not parent_key:
            cfg = rename_old_keys(cfg, self._source)
        return super()._apply_actions(cfg, parent_key, prev_cfg, skip_fn)


@dataclass(frozen=True)
class Schema:
    """What one command's configuration holds.

    Args:
        model: the LightningModule (``model:``).
        data: the LightningDataModule (``data:``).
        run_name: the default of ``--run_name``.
        sections: further class sections, ``(key, class)``, e.g. ``("rollout", RolloutCallback)``.
        progs: what each subcommand's ``--help`` calls itself.
        settings: settings dataclasses of their own section, ``(key, dataclass)``, e.g. ``("eval", EvalSettings)``:
            parsed, saved in ``config.yaml`` and read by the commands beside ``vpo fit``; no training object
            takes them.
    """

    model: type
    data: type
    run_name: str
    sections: tuple[tuple[str, type], ...] = ()
    progs: Mapping[str, str] = field(default_factory=dict)
    settings: tuple[tuple[str, type], ...] = ()

    # ---- the steps LightningCLI takes to build a subcommand's parser (VPOCLI's hooks call these) ------------------
    @staticmethod
    def new_parser(**kwargs: Any) -> ConfigParser:
        """An empty parser with ``--config`` (LightningCLI's ``init_parser``)."""
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={lightning_version}"])
        parser = ConfigParser(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile,
                            help="Path to a configuration file in json or yaml format.")
        return parser

    @staticmethod
    def add_seed(parser: LightningArgumentParser) -> None:
        """``--seed_everything`` (default :data:`SEED_DEFAULT`)."""
        parser.add_argument("--seed_everything", type=Union[bool, int], default=SEED_DEFAULT,  # noqa: UP007
                            help="Set to an int to run seed_everything with this value before classes instantiation."
                                 "Set to True to use a random seed.")

    def add_core(self, parser: LightningArgumentParser) -> None:
        """The ``trainer:``, ``model:`` and ``data:`` sections."""
        parser.add_lightning_class_args(Trainer, "trainer")
        parser.add_lightning_class_args(self.model, "model", subclass_mode=False)
        parser.add_lightning_class_args(self.data, "data", subclass_mode=False)

    def add_sections(self, parser: LightningArgumentParser) -> None:
        """``--run_name``, ``--overwrite``, the further sections, the tokenizer link and the trainer defaults."""
        parser.add_argument("--run_name", type=str, default=self.run_name, help="outputs go to checkpoints/<run_name>/")
        parser.add_argument("--overwrite", action=ActionYesNo, default=False,
                            help="replace a non-empty checkpoints/<run_name>/ (else refused unless resuming)")
        for key, cls in self.sections:
            parser.add_lightning_class_args(cls, key)
        for key, cls in self.settings:
            parser.add_class_arguments(cls, key, sub_configs=True)
        parser.link_arguments("model.model.name", "data.tokenizer")
        parser.set_defaults(TRAINER_DEFAULTS)

    # ---- the parser alone, and the CLI's arguments ----------------------------------------------------------------
    def parser(self, subcommand: str = "fit") -> LightningArgumentParser:
        """The parser of ``subcommand`` (what ``vpo fit --config X`` parses X with), built by the same steps as the
        CLI's and placed under a main parser as the CLI places it (which gives it the main parser's mode and prog);
        nothing is parsed, instantiated or run. Errors raise instead of exiting."""
        from lightning.pytorch.cli import _get_short_description

        description = _get_short_description(getattr(Trainer, subcommand))
        parser = self.new_parser(description=description)
        self.add_seed(parser)
        self.add_core(parser)
        self.add_sections(parser)
        parser.add_method_arguments(Trainer, subcommand, skip=set(SUBCOMMANDS[subcommand]))
        self.new_parser(**PARSER_KWARGS).add_subcommands().add_subcommand(subcommand, parser, help=description)
        parser.exit_on_error = False
        return parser

    def cli_kwargs(self) -> dict[str, Any]:
        """The keyword arguments a :class:`~vpo_lightning.training.cli.VPOCLI` over this schema is built with."""
        return {"model_class": self.model, "datamodule_class": self.data, "parser_kwargs": dict(PARSER_KWARGS),
                "save_config_kwargs": {"overwrite": True}, "subclass_mode_model": False, "subclass_mode_data": False,
                "auto_configure_optimizers": False,  # the module's optimizer settings are model.optim.*
                "seed_everything_default": SEED_DEFAULT}


# `vpo fit` / `vpo validate`: the policy module, the prompts, the rollout and the checkpoints
FIT = Schema(VPOModule, PromptDataModule, "vpo", (("rollout", RolloutCallback), ("checkpoint", AdapterCheckpoint)),
             {"fit": "vpo fit", "validate": "vpo validate"}, (("eval", EvalSettings),))
