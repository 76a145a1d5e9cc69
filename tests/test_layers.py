"""The layer rule, enforced: the package tree is the architecture of docs/ARCHITECTURE.md.

Layers, lowest first: core < tasks < generation < training < commands < entry. A module may import modules of its
own layer and of the layers below, never above (every import statement counts, the ones inside functions too).
The core and the tasks import neither Lightning nor transformers, peft or vLLM; generation does not import
Lightning. No modules (of the package, or benchmark scripts) import each other in a loop. Every module is listed in
docs/ARCHITECTURE.md under the heading of its layer, and every module path the docs name exists.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vpo_lightning"
LAYERS = ("core", "tasks", "generation", "training", "commands", "entry")
# vpo_lightning.<first part> -> layer. The reward registry is core (ChainProtocol composes its reward vector); the
# tasks register their rewards in it and run code in the sandbox. app.py (what every command shares: flag style, bad
# input) is plain Python that the training and commands layers both use, so it sits with the core.
PACKAGE_LAYERS = {
    "core": "core", "rewards": "core", "app": "core",
    "tasks": "tasks", "sandbox": "tasks",
    "generation": "generation",
    "training": "training", "sft": "training",
    "commands": "commands", "serve": "commands",
    "__main__": "entry", "launcher": "entry", "api": "entry", "advantages": "entry",
}
# upward imports by design, each with its reason
ALLOWED_UPWARD = {
    ("vpo_lightning.rewards", "vpo_lightning.tasks"):
        "the registry lists the built-in task folder and loads each task's reward module by name (plugins)",
}
HEAVY = {"core": ("lightning", "transformers", "peft", "vllm"), "tasks": ("lightning", "transformers", "peft", "vllm"),
         "generation": ("lightning",)}
# modules of the training layer that are the RL step without Lightning: `vpo eval` and `vpo search` sample with them
LIGHTNING_FREE = ("vpo_lightning.training.sampler", "vpo_lightning.training.records")


def module_files(root: Path = REPO) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package (in the tree at ``root``)."""
    out = {}
    for path in sorted((root / PACKAGE.name).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = module_files()


def layer_of(module: str) -> str:
    parts = module.split(".")
    return "entry" if len(parts) == 1 else PACKAGE_LAYERS[parts[1]]


def imports_of(module: str, path: Path, modules: dict[str, Path] = MODULES) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every import statement in ``path``: ``from a.b import c`` imports ``a.b.c``
    where that is a module (of ``modules``), else ``a.b``."""
    out = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((node.lineno, full if full in modules else base))
    return out


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """``{module: the modules it imports}`` over the package's modules and the benchmark scripts (named
    ``benchmarks/<file>``; they import each other by their bare names), in the tree at ``root``. Every import
    statement counts, the ones inside functions too: a circle through a function-level import is still a circle."""
    modules = module_files(root)
    scripts = {path.stem: path for path in sorted((root / "benchmarks").glob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        graph[module] = {name for _, name in imports_of(module, path, modules) if name in modules} - {module}
    for stem, path in scripts.items():
        names = {name.split(".")[0] for _, name in imports_of(stem, path, modules)}
        graph[f"benchmarks/{path.name}"] = {f"benchmarks/{scripts[n].name}" for n in names if n in scripts} - {
            f"benchmarks/{path.name}"}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def test_every_module_is_in_a_layer():
    unplaced = [m for m in MODULES if len(m.split(".")) > 1 and m.split(".")[1] not in PACKAGE_LAYERS]
    assert not unplaced, f"modules in no layer (add the package to PACKAGE_LAYERS and docs/ARCHITECTURE.md): {unplaced}"


def test_imports_go_down_the_layers():
    problems = []
    for module, path in MODULES.items():
        if len(module.split(".")) > 1 and module.split(".")[1] not in PACKAGE_LAYERS:
            continue  # reported by test_every_module_is_in_a_layer
        rank = LAYERS.index(layer_of(module))
        where = f"{path.relative_to(REPO)}"
        for line, name in imports_of(module, path):
            top = name.split(".")[0]
            if top in HEAVY.get(layer_of(module), ()) or (module in LIGHTNING_FREE and top == "lightning"):
                problems.append(f"{where}:{line} ({layer_of(module)}) imports {name}")
            if top != "vpo_lightning" or name == "vpo_lightning":
                continue
            if name.split(".")[1] not in PACKAGE_LAYERS:
                problems.append(f"{where}:{line} imports {name}, which is no module of the package")
                continue
            target = layer_of(name)
            owner = ".".join(module.split(".")[:2])
            if LAYERS.index(target) > rank and (owner, ".".join(name.split(".")[:2])) not in ALLOWED_UPWARD:
                problems.append(f"{where}:{line} ({layer_of(module)}) imports {name} ({target})")
    assert not problems, "imports against the layer order " + " < ".join(LAYERS) + ":\n" + "\n".join(problems)


def test_no_import_circles():
    """No modules of the package, and no benchmark scripts, import each other in a loop (directly or through
    others): each names one place below the other, as `farm-studio look` draws them."""
    circles = import_circles(import_graph())
    assert not circles, "modules that import each other in a loop:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_loops_through_others():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert import_circles(graph) == [["a", "b", "c"]]


def test_core_runs_without_lightning_transformers_peft_or_vllm():
    """Import every core module (and the reward registry with a task's rewards) with those packages blocked, then
    score a chain and compute VPO advantages."""
    core = sorted(m for m in MODULES if m.startswith("vpo_lightning.core."))
    code = f"""
import importlib, sys
BLOCKED = ("lightning", "lightning_fabric", "pytorch_lightning", "transformers", "peft", "vllm")

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {{name}}")

sys.meta_path.insert(0, Block())
for name in {core!r}:
    importlib.import_module(name)
import torch
from vpo_lightning.core.advantages import vpo_advantages
from vpo_lightning.core.protocol import ChainProtocol
from vpo_lightning.tasks.maze import generate_maze, make_record

protocol = ChainProtocol(["maze"], num_candidates=2, tag_family="route")
record = make_record(generate_maze(0), "test", 0)
chain = protocol.candidates("<route_1>R R</route_1><route_2>D</route_2>")
scores = protocol.score([chain, chain[::-1]], [record, record])
adv = vpo_advantages(scores.rewards.view(1, 2, 2, -1), scores.mask.view(1, 2, 2))
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED))
print("ok", tuple(scores.rewards.shape), tuple(adv.shape), loaded)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok (2, 2, 4) (1, 2) []", proc.stdout


def test_the_sampler_runs_without_lightning():
    """The RL step's sampler (and what it imports) loads with Lightning blocked, and samples, scores and computes
    advantages for one prompt with a scripted engine."""
    code = f"""
import sys
from types import SimpleNamespace
BLOCKED = ("lightning", "lightning_fabric", "pytorch_lightning")

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {{name}}")

sys.meta_path.insert(0, Block())
import importlib
for name in {LIGHTNING_FREE!r}:
    importlib.import_module(name)
from vpo_lightning.core.types import Generation
from vpo_lightning.generation.engines import SamplingSettings
from vpo_lightning.tasks.maze import generate_maze, make_record
from vpo_lightning.training.sampler import Sampler, chain_protocol

class Engine:
    def generate(self, module, prompts, group_size, sampling, seeds=None):
        texts = ["<route_1>R R</route_1><route_2>D</route_2>", "<route_1>D</route_1>"] * len(prompts)
        return Generation([[1, 2]] * len(texts), texts, 2 * len(texts))

class Tokenizer:
    pad_token_id = 0
    def apply_chat_template(self, messages, **kwargs):
        return "prompt"
    def __call__(self, text, add_special_tokens=False):
        return {{"input_ids": [1, 2, 3]}}

protocol = chain_protocol(["maze"], "vpo", 2, 2, 4, 1.0, "route", 0)
sampler = Sampler(protocol, Engine(), SamplingSettings(), group_size=2)
rnd = sampler.sample(SimpleNamespace(tokenizer=Tokenizer()), [make_record(generate_maze(0), "test", 0)], [0], step=0)
ro = sampler.rollout(rnd, pad_id=0)
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED))
print("ok", tuple(rnd.rewards.shape), tuple(ro.advantages.shape), loaded)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok (1, 2, 2, 4) (2,) []", proc.stdout


# ---- task knowledge stays in tasks/ ------------------------------------------------------------------------------
TASKS = sorted(p.name for p in (PACKAGE / "tasks").iterdir() if (p / "__init__.py").is_file())
# String literals equal to a task's name that mean something else, per file: how many, and why.
OTHER_TASK_MEANINGS = {("vpo_lightning/serve/openai_api.py", "code"): (1, "the `code` field of an OpenAI error")}


def test_task_names_appear_only_under_tasks():
    """A task's name is written under vpo_lightning/tasks/ only: what the rest needs of a task (its rewards, its
    demonstration builders, whether its prompt lists the tools) it finds through the task's registrations."""
    assert {"maze", "tooluse"} <= set(TASKS)
    problems = []
    for path in MODULES.values():
        rel = str(path.relative_to(REPO))
        if rel.startswith("vpo_lightning/tasks/"):
            continue
        found = [(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in TASKS]
        for value in sorted({v for _, v in found}):
            lines = [n for n, v in found if v == value]
            if len(lines) != OTHER_TASK_MEANINGS.get((rel, value), (0, ""))[0]:
                problems.append(f"{rel}:{','.join(map(str, lines))} writes the task name {value!r}")
    assert not problems, "task knowledge outside vpo_lightning/tasks/ (register it in the task's package):\n" + \
        "\n".join(problems)


def test_no_module_tells_our_classes_apart_by_name():
    """``type(x).__name__ == "SFTModule"`` couples a lower layer to a class it may not import: ask the object. (A
    third-party class told by name, so that its optional package is not imported, is not this.)"""
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in MODULES.values()}
    ours = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    problems = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute)
                    and node.left.attr == "__name__" and isinstance(node.left.value, ast.Call)
                    and getattr(node.left.value.func, "id", None) == "type"
                    and any(isinstance(c, ast.Constant) and c.value in ours for c in node.comparators)):
                problems.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not problems, "class-name checks: " + ", ".join(problems)


# ---- docs/ARCHITECTURE.md ----------------------------------------------------------------------------------------
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
ENTRY_PATH = re.compile(r"`(vpo_lightning/[^`\s]*)`")


def architecture_sections() -> dict[str, list[str]]:
    """``{layer: [paths named in its section]}``: a section is a ``## <layer>: ...`` heading up to the next ``## ``."""
    sections: dict[str, list[str]] = {}
    layer = None
    for line in ARCHITECTURE.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            head = line[3:].split(":")[0].strip()
            layer = head if head in LAYERS else None
            if layer:
                sections[layer] = []
        elif layer and line.startswith("| `vpo_lightning/"):
            sections[layer] += ENTRY_PATH.findall(line.split("|")[1])
    return sections


def _covers(entry: str, path: str) -> bool:
    """A file map entry names a file, a folder (``vpo_lightning/sandbox/``) or a pattern (``tasks/<name>/build.py``)."""
    if entry.endswith("/"):
        return path.startswith(entry)
    return re.fullmatch(re.sub(r"<[a-z_]+>", "[^/]+", re.escape(entry).replace(r"\<", "<").replace(r"\>", ">")),
                        path) is not None


def test_architecture_lists_every_module_under_its_layer():
    sections = architecture_sections()
    assert set(sections) == set(LAYERS), f"docs/ARCHITECTURE.md: one '## <layer>: ...' section per layer {LAYERS}"
    problems = []
    for module, path in MODULES.items():
        rel, layer = str(path.relative_to(REPO)), layer_of(module)
        if not any(_covers(e, rel) for e in sections[layer]):
            others = [name for name, entries in sections.items() if any(_covers(e, rel) for e in entries)]
            problems.append(f"{rel} ({layer}): " + (f"listed under {others}" if others else "not listed"))
    for layer, entries in sections.items():
        for entry in entries:
            covered = [str(p.relative_to(REPO)) for p in MODULES.values() if _covers(entry, str(p.relative_to(REPO)))]
            if not covered and not (REPO / entry).exists():
                problems.append(f"{entry} (under {layer}) does not exist")
            problems += [f"{entry} (under {layer}) covers {c}, which is {layer_of(m)}" for m, c in
                         ((m, str(p.relative_to(REPO))) for m, p in MODULES.items()) if c in covered
                         and layer_of(m) != layer]
    assert not problems, "docs/ARCHITECTURE.md file map:\n" + "\n".join(problems)


# ---- module paths named by the docs ------------------------------------------------------------------------------
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
DOTTED = re.compile(r"(?<![\w./-])vpo_lightning(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
SLASHED = re.compile(r"(?<![\w./-])vpo_lightning/[A-Za-z0-9_./]*[A-Za-z0-9_/]")
WRITTEN_BY_READER = {"ADDING_A_TASK.md": "tasks.addition"}  # the tutorial's task: the reader writes its files


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def dotted_problem(ref: str) -> str | None:
    """None when ``ref`` is a module of the package, or a name defined at the top of one (``module.Class``; a
    method after it is not checked); else what is wrong."""
    parts = ref.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in MODULES:
            rest = parts[cut:]
            if rest and rest[0] not in top_level_names(MODULES[module]):
                return f"{module} defines no {rest[0]}"
            return None
    return "no such module"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_module_paths_in_docs_exist(doc):
    text = doc.read_text(encoding="utf-8")
    problems = []
    own = WRITTEN_BY_READER.get(doc.name)
    for ref in sorted(set(DOTTED.findall(text))):
        if own and f".{own}." in f"{ref}.":
            continue
        if (problem := dotted_problem(ref)) is not None:
            problems.append(f"{ref}: {problem}")
    for ref in sorted(set(SLASHED.findall(text))):
        if own and f"/{own.replace('.', '/')}/" in f"/{ref}/":
            continue
        if "<" not in ref and not (REPO / ref).exists():
            problems.append(f"{ref}: no such file or folder")
    assert not problems, f"{doc.relative_to(REPO)} names module paths that do not exist:\n" + "\n".join(problems)


# ---- the old module paths ---------------------------------------------------------------------------------------
def test_old_module_paths_are_gone_and_saved_class_paths_are_renamed():
    """The modules that sat at the top of the package before the layers (``vpo_lightning.engines``) are not
    importable any more; the class paths that run configs saved before then hold are renamed to classes that
    exist (training/config.py, beside the renamed keys)."""
    import importlib

    from vpo_lightning.training.config import RENAMED_CLASS_PATHS, import_class

    # (``vpo_lightning.advantages`` stays: VPO-SPEC section 3 names it, test_the_spec_public_api_keeps_its_path)
    for old in ("engines", "models", "rollout", "progress", "evaluate"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"vpo_lightning.{old}")
    for old, new in RENAMED_CLASS_PATHS.items():
        assert old.split(".")[1] not in PACKAGE_LAYERS and isinstance(import_class(new), type), old


def test_python_m_vpo_lightning_is_the_vpo_command():
    proc = subprocess.run([sys.executable, "-m", "vpo_lightning", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: vpo COMMAND") and "\n  replicates " in proc.stdout


def test_the_spec_public_api_keeps_its_path():
    """VPO-SPEC section 3 names ``vpo_lightning/advantages.py``: its four functions import from there, and are the
    core's own (one implementation)."""
    import vpo_lightning.advantages as spec
    from vpo_lightning.core import advantages as core

    for name in ("sample_weights", "set_rewards", "vpo_advantages", "group_normalize"):
        assert getattr(spec, name) is getattr(core, name)
