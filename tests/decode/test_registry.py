"""The method registry and the decode package's layers: a name registers once, the registry knows no method,
every decoder shares one `generate`, and no module of draftforge.decode imports itself back through others."""

import ast
from pathlib import Path

import pytest

import draftforge.decode as decode
from draftforge.decode import HFAssistedDecoder, HFPromptLookupDecoder, SpeculativeDecoder, methods
from draftforge.decode.base import DecodeStats
from draftforge.decode.engine import Decoder

PACKAGE = Path(decode.__file__).parent


def decode_imports(path: Path) -> set[str]:
    """The draftforge.decode modules a file imports (function-level imports included), by file stem."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "draftforge.decode":
            found |= {a.name for a in node.names if (PACKAGE / f"{a.name}.py").is_file()}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("draftforge.decode."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("draftforge.decode.")}
    return found - {path.stem}


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="registered already"):
        methods.register_method(methods.METHODS["chain"])


def test_an_option_means_one_thing_across_methods():
    """Two methods may read one option (chain and eesd: chain_length) only with the same flag and type."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Clash(methods.MethodOptions):
        chain_length: float = methods.option(5.0, "another meaning", flag="--chain-length")

    with pytest.raises(ValueError, match="another method has it"):
        methods.register_method(methods.Method("clash", "", True, lambda t, d, o: None, Clash))

    @dataclass(frozen=True)
    class SameFlag(methods.MethodOptions):
        chain_len: int = methods.option(5, "a second name for one flag", flag="--chain-length")

    with pytest.raises(ValueError, match="is option 'chain_length' already"):
        methods.register_method(methods.Method("same_flag", "", True, lambda t, d, o: None, SameFlag))
    assert "clash" not in methods.METHODS and "same_flag" not in methods.METHODS


def test_method_options_are_typed_checked_once_and_named_on_error():
    from draftforge.decode.methods.core import ChainOptions, TreeOptions
    from draftforge.errors import RecipeError

    assert methods.resolve_options("chain", {"chain_length": 3}) == ChainOptions(chain_length=3)
    assert methods.resolve_options("chain", {"chain_length": None}) == ChainOptions()  # None = the default
    given = TreeOptions(tree="3,1")  # text is read as --tree reads it
    assert given.tree.widths == (3, 1) and methods.resolve_options("tree", given) is given
    with pytest.raises(RecipeError, match="unknown option 'chain_lenght' for method 'chain': did you mean 'chain_length'"):
        methods.resolve_options("chain", {"chain_lenght": 3})
    with pytest.raises(RecipeError, match="--beta-update must be one of resolved, literal"):  # a Literal field
        methods.resolve_options("beta_ts", {"beta_update": "both"})
    with pytest.raises(RecipeError, match="takes TreeOptions, got ChainOptions"):
        methods.resolve_options("tree", ChainOptions())
    with pytest.raises(RecipeError, match="did you mean 'chain'"):
        methods.get_method("chian")


def test_the_registry_knows_no_method():
    # the Drafter contract (no method); options and checks come from draftforge.options
    assert decode_imports(PACKAGE / "methods" / "__init__.py") == {"drafters"}  # drafters.base
    assert set(decode.METHODS) == set(methods.METHODS) >= {"ar", "chain", "tree", "ucb", "eagle2", "c2t", "eesd"}


def test_no_import_circle_inside_decode():
    from tests.fixtures.imports import in_circles

    assert in_circles({p.stem: decode_imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}) == []


def test_every_decoder_shares_one_generate():
    assert SpeculativeDecoder.generate is HFAssistedDecoder.generate is HFPromptLookupDecoder.generate
    assert SpeculativeDecoder.generate is Decoder.generate


def test_add_round_keeps_the_per_round_lists_in_step():
    stats = DecodeStats()
    stats.add_round(2, 5, 3, "3x1x1")
    stats.add_round(0, 1, 1, "1")
    stats.add_round(0, 0, 0, "ar")
    assert stats.target_forwards == 3 and stats.chosen_configs == ["3x1x1", "1", "ar"]
    assert stats.accepted_per_round == [2, 0, 0] and stats.drafted_per_round == [5, 1, 0]
    assert stats.proposed_by_position == [2, 1, 1] and stats.accept_by_position == [1, 1, 0]
