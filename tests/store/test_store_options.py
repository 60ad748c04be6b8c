"""Store options: the strategy (a name or an object), its own options, and the package's
logging and environment as a new user meets them."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gpukv
from gpukv.comm import HostStrategy
from gpukv.comm.tree import TreeStrategy


@pytest.fixture(autouse=True)
def _no_env_strategy(monkeypatch):
    monkeypatch.delenv("GPUKV_STRATEGY", raising=False)


def _push_pull(kv, n_devices=3):
    """The value pulled after pushing arange(6) from `n_devices` devices onto zeros."""
    kv.init("w", np.zeros(6, np.float32))
    kv.push("w", [np.arange(6, dtype=np.float32)] * n_devices)
    out = np.zeros(6, np.float32)
    kv.pull("w", out=out)
    return out


# ---------------------------------------------------------------- strategy options
def test_tree_array_bound_reaches_the_tree_strategy():
    """`create('device', strategy='tree', array_bound=n)` builds the tree with that bound."""
    kv = gpukv.create("device", strategy="tree", array_bound=1000)
    assert kv.strategy == "tree"
    assert kv._strategy._bound == 1000
    np.testing.assert_array_equal(_push_pull(kv), np.arange(6) * 3)


def test_strategy_option_follows_gpukv_strategy(monkeypatch):
    """Strategy options go to the strategy GPUKV_STRATEGY picks when none is named."""
    monkeypatch.setenv("GPUKV_STRATEGY", "tree")
    kv = gpukv.create("device", array_bound=7)
    assert kv.strategy == "tree" and kv._strategy._bound == 7


@pytest.mark.parametrize("bound, error", [
    (0, gpukv.ArgumentError), (-3, gpukv.ArgumentError), (2.5, gpukv.ArgumentKindError),
    ("1000", gpukv.ArgumentKindError), (True, gpukv.ArgumentKindError)])
def test_bad_tree_array_bound_is_refused_at_create(bound, error):
    """A tree `array_bound` that is not a positive int is refused when the store is made."""
    with pytest.raises(error, match=r"tree option array_bound=.*: expected a positive int"):
        gpukv.create("device", strategy="tree", array_bound=bound)


@pytest.mark.parametrize("strategy", ["home", "ring", "cpu", "nccl", "auto"])
def test_option_of_another_strategy_names_option_and_strategy(strategy):
    """An option the chosen strategy does not take is an ArgumentKindError naming both."""
    with pytest.raises(gpukv.ArgumentKindError,
                       match=f"array_bound.*{strategy!r}|{strategy!r}.*array_bound"):
        gpukv.create("device", strategy=strategy, array_bound=1000)


def test_option_for_default_auto_strategy_names_auto():
    """With no strategy named, a 'device' store's options are checked against 'auto'."""
    with pytest.raises(gpukv.ArgumentKindError, match="'auto'"):
        gpukv.create("device", array_bound=1000)


def test_option_for_local_host_sum_is_refused():
    """A 'local' store without a named strategy takes no strategy options."""
    with pytest.raises(gpukv.ArgumentKindError, match="'array_bound'.*host sum"):
        gpukv.create("local", array_bound=1000)


def test_unknown_option_still_lists_the_valid_ones():
    """An option no strategy takes is 'unknown', and the message lists the valid options."""
    with pytest.raises(gpukv.ArgumentKindError,
                       match="'frobnicate': unknown; valid options are .*array_bound.*strategy"):
        gpukv.create("device", frobnicate=1)


# ---------------------------------------------------------------- strategy objects
def test_strategy_object_is_used_as_given():
    """A Strategy instance passed as `strategy=` is the store's strategy, run explicitly."""
    tree = TreeStrategy(array_bound=4)
    kv = gpukv.create("device", strategy=tree)
    assert kv._strategy is tree and kv.strategy == "tree" and kv._route_host
    np.testing.assert_array_equal(_push_pull(kv), np.arange(6) * 3)


def test_strategy_object_with_options_is_refused():
    """Options next to a strategy object are refused: the object is already built."""
    with pytest.raises(gpukv.ArgumentKindError, match="'array_bound'.*already built"):
        gpukv.create("device", strategy=TreeStrategy(), array_bound=4)


@pytest.mark.parametrize("bad", [3, b"tree", TreeStrategy, HostStrategy, ["tree"]])
def test_strategy_neither_name_nor_object_is_a_kind_error(bad):
    """A `strategy=` that is neither a str nor a Strategy instance is an ArgumentKindError."""
    with pytest.raises(gpukv.ArgumentKindError, match="strategy"):
        gpukv.create("device", strategy=bad)


# ---------------------------------------------------------------- logging
def test_host_fallback_notice_is_silent_without_logging_config():
    """A program that configured no logging sees nothing on stderr from a 'device' store
    with host arrays (the notice is INFO: only warnings reach logging's last resort)."""
    code = textwrap.dedent("""
        import numpy as np, gpukv
        kv = gpukv.create('device')
        kv.init(1, np.ones(3))
        kv.push(1, [np.ones(3)] * 2)
        out = np.zeros(3)
        kv.pull(1, out=out)
        assert (out == 2).all()
        print('ok')
    """)
    assert _unconfigured(code) == ""


def test_a_warning_reaches_stderr_without_logging_config():
    """What the docs call a warning is seen by a program that configured no logging:
    saving a function schedule with dump_optimizer says on stderr that it is left out."""
    code = textwrap.dedent("""
        import os, tempfile, numpy as np, gpukv
        kv = gpukv.create('local')
        kv.init(1, np.ones(3))
        kv.set_optimizer(gpukv.optim.SGD(lr_scheduler=lambda n: 0.1))
        kv.push(1, np.ones(3))
        kv.save_optimizer_states(os.path.join(tempfile.mkdtemp(), 's'), dump_optimizer=True)
        print('ok')
    """)
    stderr = _unconfigured(code)
    assert "lr_scheduler" in stderr and "cannot be saved" in stderr, stderr


def _unconfigured(code: str) -> str:
    """The stderr of `code` (which prints 'ok' at its end) run in a fresh Python that
    configures no logging and sets no GPUKV_ variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUKV_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    return done.stderr
