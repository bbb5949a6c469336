"""The engine's options in groups (engine/config_groups.py) composed into EngineConfig
(engine/engine_config.py): how a config is built, and which groups each component reads."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

from pagedserve.engine import config_groups as groups
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.server.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
GROUPS = {
    "model": groups.ModelOptions,
    "cache": groups.CacheOptions,
    "scheduler": groups.SchedulerOptions,
    "parallel": groups.ParallelOptions,
    "speculative": groups.SpeculativeOptions,
    "lora": groups.LoRAOptions,
    "observability": groups.ObservabilityOptions,
}
ModelOptions, CacheOptions = groups.ModelOptions, groups.CacheOptions
SchedulerOptions, LoRAOptions = groups.SchedulerOptions, groups.LoRAOptions


def test_the_config_is_its_groups_in_order():
    assert [(f.name, f.type) for f in dataclasses.fields(EngineConfig)] == [
        (name, cls.__name__) for name, cls in GROUPS.items()
    ]
    config = EngineConfig()
    for name, cls in GROUPS.items():
        group = getattr(config, name)
        assert type(group) is cls and group == cls()
        with pytest.raises(dataclasses.FrozenInstanceError):
            group.__setattr__(dataclasses.fields(cls)[0].name, None)


def test_flat_options_groups_and_both_build_the_same_config():
    flat = EngineConfig(model="m", block_size=8, max_num_seqs=4, enable_lora=True)
    assert flat.model == ModelOptions(model="m")
    assert flat.cache == CacheOptions(block_size=8)
    assert flat.scheduler == SchedulerOptions(max_num_seqs=4)
    assert flat.lora == LoRAOptions(enable_lora=True)
    grouped = EngineConfig(
        model=ModelOptions(model="m"),
        cache=CacheOptions(block_size=8),
        scheduler=SchedulerOptions(max_num_seqs=4),
        lora=LoRAOptions(enable_lora=True),
    )
    assert grouped == flat
    # Options given beside their group change it; dataclasses.replace takes either.
    both = EngineConfig(cache=CacheOptions(block_size=8, swap_space=1), block_size=32)
    assert (both.cache.block_size, both.cache.swap_space) == (32, 1)
    assert dataclasses.replace(flat, block_size=64).cache == CacheOptions(block_size=64)
    assert EngineConfig(**flat.options()) == flat
    assert pickle.loads(pickle.dumps(flat)) == flat  # as the core process receives it
    with pytest.raises(TypeError, match=r"EngineConfig got unknown options \['blocksize'\]"):
        EngineConfig(blocksize=8)


def test_each_option_is_in_one_group_and_one_help_section(capsys):
    names = [f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(EngineConfig().options()) == 36
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    # Each flag's own line ("  --block-size BLOCK_SIZE ...") by the section it stands in (the
    # server's flags join the engine's sections: --data-parallel-size in parallel's).
    section_of = {}
    for section in capsys.readouterr().out.split("\n\n"):
        title = section.splitlines()[0]
        for line in section.splitlines()[1:]:
            if line.startswith("  --"):
                section_of[line.split()[0].rstrip(",")] = title
    for name, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            assert section_of[f"--{f.name.replace('_', '-')}"] == f"{name} options:"


# Each component with the groups it reads: those it is handed (a parameter of a group's type)
# and those it reads of a whole EngineConfig (`config.<group>`). The engine core and the worker
# build everything on their side of the process boundary; the others get their groups alone.
COMPONENTS = {
    ("engine/core/engine_core.py", "EngineCore"): {
        "model", "cache", "scheduler", "parallel", "speculative", "lora", "observability",
    },
    ("engine/worker/worker.py", "Worker"): {
        "model", "cache", "scheduler", "parallel", "speculative", "lora",
    },
    ("engine/worker/model_loader.py", "load_model"): {"model"},
    ("engine/core/scheduler_limits.py", "scheduler_config"): {
        "scheduler", "cache", "speculative", "lora",
    },
    ("engine/frontend/process_client.py", "front_end_inputs"): {"model", "lora"},
    ("engine/frontend/llm_engine.py", "LLMEngine"): {"lora"},
    ("engine/frontend/data_parallel.py", "core_configs"): {"model", "parallel"},
    ("engine/worker/tp_worker.py", "run_worker"): {"model"},
    ("server/api_server.py", "start_client"): {"model", "lora"},
    ("server/api_server.py", "server_app"): {"model"},
}  # fmt: skip


def groups_read(path: str, name: str) -> set[str]:
    (node,) = [
        n for n in ast.parse((ROOT / path).read_text()).body if getattr(n, "name", "") == name
    ]
    group_of = {cls.__name__: group for group, cls in GROUPS.items()}
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.arg) and isinstance(n.annotation, ast.Name):
            found.update({group_of.get(n.annotation.id)} - {None})
        if isinstance(n, ast.Attribute) and n.attr in GROUPS:
            holder = n.value
            if isinstance(holder, ast.Name) and holder.id == "config":
                found.add(n.attr)
            if isinstance(holder, ast.Attribute) and holder.attr == "config":
                found.add(n.attr)
    return found


@pytest.mark.parametrize(("path", "name"), list(COMPONENTS))
def test_each_component_reads_the_groups_the_table_says(path, name):
    assert groups_read(path, name) == COMPONENTS[path, name]
