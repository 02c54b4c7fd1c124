"""Engine flags are declared once, on the ``EngineArgs`` fields (engine/arg_utils.py)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

import ingot
from ingot.engine.arg_utils import (
    NOT_A_FLAG,
    EngineArgs,
    add_dataclass_args,
    add_engine_args,
    cli,
    cli_fields,
    engine_args_from,
)

# Fields kept off the command line on purpose (Python-only knobs).
NOT_FLAGS = {"skip_tokenizer_init"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_engine_args(parser)
    return parser


def _parse(*argv: str) -> EngineArgs:
    return engine_args_from(_parser().parse_args(list(argv)))


def test_every_field_is_a_flag_or_deliberately_not():
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    dests = {a.dest for a in _parser()._actions if a.dest != "help"}
    assert dests == names - NOT_FLAGS
    assert {f.name for f, _ in cli_fields()} == names - NOT_FLAGS
    # The flag is --field-name (vLLM's names), plus vLLM's short forms.
    options = {a.dest: a.option_strings for a in _parser()._actions if a.dest != "help"}
    for name in names - NOT_FLAGS:
        assert "--" + name.replace("_", "-") in options[name]
    assert options["tensor_parallel_size"] == ["-tp", "--tensor-parallel-size"]
    assert options["data_parallel_size"] == ["-dp", "--data-parallel-size"]
    assert options["pipeline_parallel_size"] == ["-pp", "--pipeline-parallel-size"]


def test_no_flags_give_the_field_defaults():
    assert _parse() == EngineArgs()


def test_flags_round_trip_to_engine_args():
    hf = '{"rope_theta": 500000}'
    got = _parse(
        "--model", "m.gguf", "--max-num-seqs", "3", "-tp", "2", "--max-model-len", "512",  # ints
        "--gpu-memory-utilization", "0.5",  # float
        "--no-enable-prefix-caching", "--enforce-eager", "--compile",  # bools, both kinds
        "--hf-overrides", hf,  # JSON: kept as typed, create_engine_config parses it
        "--runner", "pooling", "--distributed-executor-backend", "mp",  # choices
    )
    assert got == EngineArgs(
        model="m.gguf", max_num_seqs=3, tensor_parallel_size=2, max_model_len=512,
        gpu_memory_utilization=0.5, enable_prefix_caching=False, enforce_eager=True,
        compile=True, hf_overrides=hf, runner="pooling", distributed_executor_backend="mp",
    )
    assert _parse("--no-compile", "--no-async-scheduling").compile is False


@pytest.mark.parametrize("argv", [
    ["--runner", "generation"],  # not one of the choices
    ["--distributed-executor-backend", "threads"],
    ["--max-num-seqs", "many"],  # not an int
    ["--enforce-eager", "yes"],  # store_true takes no value
])
def test_bad_values_are_rejected_by_argparse(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid" in err or "unrecognized arguments" in err


def test_a_field_without_cli_metadata_is_an_error():
    @dataclasses.dataclass
    class Args:
        declared: int = dataclasses.field(default=1, metadata=cli("ok"))
        skipped: int = dataclasses.field(default=2, metadata=NOT_A_FLAG)
        forgotten: int = 3

    with pytest.raises(TypeError, match="Args.forgotten declares no command-line flag"):
        add_dataclass_args(argparse.ArgumentParser(), Args)


def test_a_list_field_needs_a_parse_hook():
    @dataclasses.dataclass
    class Args:
        sizes: list[int] | None = dataclasses.field(default=None, metadata=cli())

    with pytest.raises(TypeError, match="declare cli"):
        add_dataclass_args(argparse.ArgumentParser(), Args)

    @dataclasses.dataclass
    class Hooked:
        sizes: list[int] | None = dataclasses.field(
            default=None, metadata=cli(type=lambda s: [int(x) for x in s.split(",")]))

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, Hooked)
    assert parser.parse_args(["--sizes", "1,4"]).sizes == [1, 4]


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, function-local imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_flag_derivation_imports_no_entrypoint():
    """accuracy/cli and cli/main both take the flags from engine/arg_utils: no cycle."""
    src = Path(ingot.__file__).parent
    for rel in ("engine/arg_utils.py", "accuracy/cli.py"):
        imports = _imported_modules(src / rel)
        assert "ingot.engine.arg_utils" in imports or rel.startswith("engine")
        assert not {m for m in imports if m.startswith(("ingot.entrypoints", "ingot.cli"))}, rel


# ---- --quantization --------------------------------------------------------------------------

def test_quantization_resolves_gguf_for_a_gguf_on_cpu_else_none(tiny_llama_dir):
    def resolved(**kw) -> str:
        config = EngineArgs(device="cpu", max_model_len=256, **kw).create_engine_config()
        return config.model_config.quantization

    assert resolved() == "gguf"  # the default model, a GGUF
    assert resolved(quantization="none") == "none"
    assert resolved(compile=True) == "none"  # compiled layers run on plain weights
    assert resolved(model=str(tiny_llama_dir)) == "none"  # not a GGUF
    assert _parse("--quantization", "gguf").quantization == "gguf"


@pytest.mark.parametrize(("kw", "match"), [
    ({"model": "TINY"}, "not a .gguf model"),
    ({"dtype": "float16"}, "float32 or bf16 activations.*--quantization none"),
    ({"compile": True}, "compiled layers.*--quantization none"),
])
def test_quantization_gguf_where_it_cannot_serve_is_an_error(tiny_llama_dir, kw, match):
    kw = {k: str(tiny_llama_dir) if v == "TINY" else v for k, v in kw.items()}
    with pytest.raises(ValueError, match=match):
        EngineArgs(device="cpu", max_model_len=256, quantization="gguf",
                   **kw).create_engine_config()


def test_an_unknown_quantization_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--quantization", "awq"])
    assert "invalid choice" in capsys.readouterr().err
