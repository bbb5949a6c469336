"""Everything an engine needs besides requests: the option groups of engine/config_groups.py, one
per concern, composed into one frozen `EngineConfig`, as vLLM composes `ModelConfig`,
`CacheConfig`, ... into `VllmConfig`.

Each option is defined once, as a field of its group; the command line's flags and the flat
keyword arguments (`EngineConfig(model=..., block_size=8)`, `LLM(...)`) are generated from those
fields, so adding an option is one new field. What spans groups is checked here.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.config_groups import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DTYPES,
    LOAD_FORMATS,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    CacheOptions,
    LoRAOptions,
    ModelOptions,
    ObservabilityOptions,
    ParallelOptions,
    SchedulerOptions,
    SpeculativeOptions,
)
from pagedserve.engine.options import Options

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DTYPES",
    "LOAD_FORMATS",
    "PREEMPTION_MODES",
    "QUANTIZATIONS",
    "CacheOptions",
    "EngineConfig",
    "LoRAOptions",
    "ModelOptions",
    "ObservabilityOptions",
    "ParallelOptions",
    "SchedulerOptions",
    "SpeculativeOptions",
]


@dataclass(frozen=True, init=False)
class EngineConfig(Options):
    """The engine's options, one frozen group per concern. Built from flat keyword arguments, one
    per option (`EngineConfig(model="x", block_size=8)`, as the command line gives them), from
    whole groups by their field name (`EngineConfig(cache=CacheOptions(...))`), or both (the
    options then change the groups'). `model=` is the model's name as a string, its group as a
    ModelOptions."""

    model: ModelOptions
    cache: CacheOptions
    scheduler: SchedulerOptions
    parallel: ParallelOptions
    speculative: SpeculativeOptions
    lora: LoRAOptions
    observability: ObservabilityOptions

    def __init__(self, **options: Any) -> None:
        groups, option_group = _groups_of(type(self))
        given = {}
        for name, cls in groups.items():
            if isinstance(options.get(name), cls):
                given[name] = options.pop(name)
        unknown = sorted(set(options) - option_group.keys())
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown options {unknown}")
        for name, cls in groups.items():
            mine = {k: v for k, v in options.items() if option_group[k] == name}
            group = dataclasses.replace(given[name], **mine) if name in given else cls(**mine)
            object.__setattr__(self, name, group)
        self._check_across_groups()

    def _check_across_groups(self) -> None:
        if self.speculative.speculative_ngram and self.scheduler.async_scheduling:
            raise ValueError(
                "speculative_ngram needs synchronous scheduling (each step's drafts come from "
                "the tokens the previous step accepted): drop --async-scheduling"
            )
        if self.observability.kv_events and not self.cache.enable_prefix_caching:
            raise ValueError(
                "KV events report the prefix cache's blocks: drop --no-enable-prefix-caching "
                "or the kv_events_config"
            )
        if self.lora.enable_lora and self.model.task == "embed":
            raise ValueError(
                "LoRA adapters apply to generation: drop --enable-lora with --task embed"
            )

    def check_encoder_model(self, family: str) -> None:
        """ValueError, naming the options to drop, for what an encoder-decoder model ("Whisper")
        or an encoder-only one ("BERT") is not served with here."""
        refused = {
            "--tensor-parallel-size > 1": self.parallel.tensor_parallel_size > 1,
            "--speculative-ngram": bool(self.speculative.speculative_ngram),
            "--quantization gguf": self.model.quantization == "gguf",
        }
        if family == "Whisper":
            refused["an fp8 --kv-cache-dtype"] = self.cache.kv_cache_dtype != "auto"
        else:
            refused["--preemption-mode swap"] = self.cache.preemption_mode == "swap"
        named = [option for option, given in refused.items() if given]
        if named:
            raise ValueError(f"a {family} model is served without {', '.join(named)}: drop them")

    def options(self) -> dict[str, Any]:
        """Every option by its flat name, as `EngineConfig(**options)` takes them back."""
        return {
            f.name: getattr(getattr(self, group), f.name) for group, f, _ in self.option_fields()
        }

    @classmethod
    def option_fields(cls) -> list[tuple[str, dataclasses.Field, Any]]:
        """Its groups' options, each in the `--help` section named as its group here."""
        return [
            (name, f, hint)
            for name, group in _groups_of(cls)[0].items()
            for _, f, hint in group.option_fields()
        ]


@functools.cache
def _groups_of(cls: type[EngineConfig]) -> tuple[dict[str, type[Options]], dict[str, str]]:
    """A config class's group classes by field name (a subclass may extend a group with options
    of its own), and the group of each option by its name."""
    hints = typing.get_type_hints(cls)
    groups = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return groups, {
        f.name: name for name, group in groups.items() for f in dataclasses.fields(group)
    }
