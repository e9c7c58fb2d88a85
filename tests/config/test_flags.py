"""Every CLI flag is one config field: one name, one default, defined once."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from mmserve.cli import build_parser
from mmserve.config.engine import EngineConfig, keyword_owners, section_types
from mmserve.config.flags import FLAG_KEY, field_default, flag_fields
from mmserve.config.media import MediaConfig
from mmserve.config.parallel import ParallelConfig
from mmserve.config.server import ServerConfig
from mmserve.disaggregation.encode_args import ENCODE_MEDIA_TOPICS, EncodeServerConfig

# DESIGN.md §2: the public flags users and tests depend on.
PUBLIC_FLAGS = [
    "--allowed-local-media-path",
    "--allowed-media-domains",
    "--api-key",
    "--block-size",
    "--device",
    "--disable-chunked-mm-input",
    "--dtype",
    "--enable-prefix-caching",
    "--encoder-cache-size",
    "--limit-mm-per-prompt",
    "--max-model-len",
    "--max-num-batched-tokens",
    "--max-num-seqs",
    "--mm-processor-cache-gb",
    "--mm-processor-kwargs",
    "--model",
    "--no-enable-prefix-caching",
    "--seed",
]
SERVE_CONFIGS = (*section_types().values(), ServerConfig)


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser(with_bench=False)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _fields(configs) -> dict[str, list[tuple[type, dataclasses.Field]]]:
    by_name: dict[str, list[tuple[type, dataclasses.Field]]] = {}
    for cls in configs:
        for field, _ in flag_fields(cls):
            by_name.setdefault(field.name, []).append((cls, field))
    return by_name


@pytest.mark.parametrize(
    ("command", "configs", "topics"),
    [
        ("serve", SERVE_CONFIGS, None),
        ("encode", (EncodeServerConfig, MediaConfig), ENCODE_MEDIA_TOPICS),
    ],
)
def test_every_flag_is_exactly_one_field_with_its_default(command, configs, topics) -> None:
    fields = _fields(configs)
    assert all(len(owners) == 1 for owners in fields.values()), {
        name: [cls.__name__ for cls, _ in owners]
        for name, owners in fields.items()
        if len(owners) > 1
    }
    actions = _flag_actions(_subparser(command))
    dests = [a.dest for a in actions]
    assert len(dests) == len(set(dests))  # one flag per value (aliases are option strings)
    for action in actions:
        assert action.dest in fields, f"{action.option_strings}: no config field"
        cls, field = fields[action.dest][0]
        assert action.option_strings[0] == "--" + field.name.replace("_", "-")
        if field.default is not dataclasses.MISSING:
            assert action.default == field.default, action.dest
        else:  # computed (the bundled model) or required: argparse holds no default
            assert action.default is None
    expected = {
        name
        for name, owners in fields.items()
        if topics is None
        or owners[0][0] is not MediaConfig
        or owners[0][1].metadata[FLAG_KEY].topic in topics
    }
    assert set(dests) == expected  # and every flag field is on the command line


def test_help_texts_take_their_defaults_from_the_fields() -> None:
    """A default written into a help text would be a second definition of it. (A field whose
    default is None, "not given", documents what is computed then, from a named constant.)"""
    for cls in (*SERVE_CONFIGS, EncodeServerConfig):
        for field, spec in flag_fields(cls):
            if field_default(field) is None:
                continue
            assert not re.search(r"[Dd]efault:? [0-9]", spec.help), f"{cls.__name__}.{field.name}"
    help_text = " ".join(_subparser("serve").format_help().split())
    assert "Default 64 MiB." in help_text  # --max-video-bytes, from the field
    assert "Default 8192." in help_text  # --max-num-batched-tokens
    assert "Default 8100." in " ".join(_subparser("encode").format_help().split())


def test_the_public_flags_are_kept() -> None:
    options = {s for a in _subparser("serve")._actions for s in a.option_strings}
    missing = [flag for flag in PUBLIC_FLAGS if flag not in options]
    assert not missing


def test_offline_keywords_are_the_flags_field_names() -> None:
    owners = keyword_owners()
    serve_dests = {a.dest for a in _flag_actions(_subparser("serve"))}
    server_fields = {f.name for f, _ in flag_fields(ServerConfig)}
    assert set(owners) - {"encoder_secret"} == serve_dests - server_fields
    config = EngineConfig.from_kwargs(max_num_seqs=3, max_video_seconds=5.0, block_size=32)
    assert config.scheduler.max_num_seqs == 3 and config.cache.block_size == 32
    assert config.media.max_video_seconds == 5.0
    with pytest.raises(TypeError, match="HTTP server setting"):
        EngineConfig.from_kwargs(port=9000)
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_seq'"):
        EngineConfig.from_kwargs(max_num_seq=3)


def test_the_engine_process_gets_no_server_setting() -> None:
    engine_fields = {f.name for cls in section_types().values() for f in dataclasses.fields(cls)}
    assert not engine_fields & {f.name for f in dataclasses.fields(ServerConfig)}
    assert field_default(dataclasses.fields(ServerConfig)[0]) == "127.0.0.1"


@pytest.mark.parametrize("flag", ["--pipeline-parallel-size"])
def test_parallel_sizes_above_one_are_refused_not_ignored(flag: str) -> None:
    from tests.support.config_args import args_of

    assert args_of(flag, "1").engine.parallel == ParallelConfig()
    with pytest.raises(ValueError, match="does not run pipeline stages yet"):
        args_of(flag, "2")
    with pytest.raises(ValueError, match="must be a positive integer"):
        ParallelConfig(data_parallel_size=0)


def test_data_parallel_size_is_accepted_with_engine_processes_and_refused_without() -> None:
    from tests.support.config_args import args_of

    parallel = args_of("-dp", "2").engine.parallel
    assert parallel.data_parallel_size == 2 and parallel.uses_engine_processes
    assert parallel.data_parallel_load_slack == 0.5
    assert args_of("--data-parallel-load-slack", "0").engine.parallel.data_parallel_load_slack == 0
    with pytest.raises(ValueError, match="--no-multiprocess"):
        args_of("-dp", "2", "--no-multiprocess")
    with pytest.raises(ValueError, match="--data-parallel-load-slack"):
        ParallelConfig(data_parallel_load_slack=-0.1)
    with pytest.raises(ValueError, match="must be a positive integer"):
        ParallelConfig(data_parallel_size=0)
