"""The strategy registry: names, the environment's default, strategy objects and options."""
from __future__ import annotations

import pytest

from gpukv import ArgumentError, ArgumentKindError
from gpukv.comm.registry import STRATEGIES, make_strategy, strategy_options
from gpukv.comm.tree import TreeStrategy


def test_bad_gpukv_strategy_names_the_variable(monkeypatch):
    """A malformed GPUKV_STRATEGY is an ArgumentError naming the variable and its value."""
    monkeypatch.setenv("GPUKV_STRATEGY", "bogus")
    with pytest.raises(ArgumentError, match=r"^GPUKV_STRATEGY='bogus': unknown; valid strategies"):
        make_strategy(None)


def test_bad_strategy_argument_does_not_mention_the_variable(monkeypatch):
    """A bad name given as argument is reported as the argument, not as GPUKV_STRATEGY."""
    monkeypatch.setenv("GPUKV_STRATEGY", "tree")
    with pytest.raises(ArgumentError, match=r"^strategy 'bogus'"):
        make_strategy("bogus")


def test_strategy_options_are_the_constructor_keywords():
    """`strategy_options(name)` lists the keywords the strategy's constructor takes."""
    assert {"matrix", "array_bound", "machine", "costs", "min_slice_bytes"} \
        == strategy_options("tree")
    assert strategy_options("ring") == {"matrix"}
    assert strategy_options("home") == set()
    assert all(isinstance(strategy_options(name), set) for name in STRATEGIES)


def test_make_strategy_forwards_options():
    """Options the strategy takes reach its constructor."""
    assert make_strategy("tree", array_bound=12)._bound == 12


def test_make_strategy_refuses_options_the_strategy_does_not_take():
    """An option the named strategy does not take names the option and the strategy."""
    with pytest.raises(ArgumentKindError, match=r"'array_bound'.*'ring'.*matrix"):
        make_strategy("ring", array_bound=4)
    with pytest.raises(ArgumentKindError, match=r"'matrix'.*'home'"):
        make_strategy("home", matrix=None)


def test_make_strategy_takes_a_strategy_object():
    """A Strategy instance is returned as it is, marked explicit."""
    tree = TreeStrategy()
    built = make_strategy(tree)
    assert built is tree and built.explicit


@pytest.mark.parametrize("bad", [1, 2.0, object(), TreeStrategy])
def test_make_strategy_refuses_other_kinds(bad):
    """Neither a str, None nor a Strategy instance: ArgumentKindError."""
    with pytest.raises(ArgumentKindError, match="strategy"):
        make_strategy(bad)
