"""MXNet's KVStore tutorial, run as written, prints and holds exactly what MXNet 1.9.1 does."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import gpukv

TUTORIAL = json.loads(
    (pathlib.Path(__file__).parent / "data" / "mxnet_reference.json").read_text())["tutorial"]
TUTORIAL_PRINTED = ["update on key: 3", "update on key: 5", "update on key: 7",
                    "update on key: 9", "update on key: 5", "update on key: 7",
                    "update on key: 9"]


def run_tutorial(name):
    """The tutorial's program (store name aside), returning what it observed."""
    seen = {}
    kv = gpukv.create(name)
    shape = (2, 3)
    kv.init(3, np.ones(shape) * 2)
    a = np.zeros(shape); kv.pull(3, out=a)                  # noqa: E702
    seen["after_init"] = a.tolist()
    kv.push(3, np.ones(shape) * 8); kv.pull(3, out=a)        # noqa: E702
    seen["after_push"] = a.tolist()
    b = [np.ones(shape) for _ in range(4)]
    kv.push(3, b); kv.pull(3, out=a)                         # noqa: E702
    seen["after_device_push"] = a.tolist()

    def update(key, input, stored):
        print(f"update on key: {key}")
        stored += input * 2

    kv.set_updater(update)
    kv.pull(3, out=a)
    seen["after_set_updater"] = a.tolist()
    kv.push(3, np.ones(shape)); kv.pull(3, out=a)            # noqa: E702
    seen["after_updater_push"] = a.tolist()
    b = [np.ones(shape) for _ in range(4)]; kv.pull(3, out=b)   # noqa: E702
    seen["pull_to_devices"] = [x.tolist() for x in b]
    keys = [5, 7, 9]
    kv.init(keys, [np.ones(shape)] * len(keys))
    kv.push(keys, [np.ones(shape)] * len(keys))
    b = [np.zeros(shape) for _ in keys]; kv.pull(keys, out=b)   # noqa: E702
    seen["list_pull"] = [x.tolist() for x in b]
    b = [[np.ones(shape) for _ in range(4)] for _ in keys]
    kv.push(keys, b); kv.pull(keys, out=b)                   # noqa: E702
    seen["list_device_pull"] = [[x.tolist() for x in row] for row in b]
    return seen


@pytest.mark.parametrize("name", ["local", "device", "local_allreduce_cpu"])
def test_tutorial_values_match_mxnet(name, capsys):
    """Every value the tutorial pulls equals MXNet's, and it prints MXNet's lines."""
    seen = run_tutorial(name)
    assert seen == TUTORIAL["values"]
    assert capsys.readouterr().out.splitlines() == TUTORIAL["printed"] == TUTORIAL_PRINTED


def test_tutorial_numbers(capsys):
    """The numbers the tutorial states (2, 8, 4, 4, 6, 6, 3, 11) hold."""
    seen = run_tutorial("local")
    capsys.readouterr()
    expect = {"after_init": 2, "after_push": 8, "after_device_push": 4,
              "after_set_updater": 4, "after_updater_push": 6}
    for step, number in expect.items():
        assert (np.array(seen[step]) == number).all(), step
    assert (np.array(seen["pull_to_devices"]) == 6).all()
    assert (np.array(seen["list_pull"][1]) == 3).all()
    assert (np.array(seen["list_device_pull"][1][1]) == 11).all()
    assert (np.array(seen["list_device_pull"]) == 11).all()


def test_tutorial_with_set_updater_alias(capsys):
    """The tutorial's `_set_updater` alias is the same method as set_updater."""
    kv = gpukv.create("local")
    kv.init(3, np.ones((2, 3)) * 4)

    def update(key, input, stored):
        print(f"update on key: {key}")
        stored += input * 2

    kv._set_updater(update)
    kv.push(3, np.ones((2, 3)))
    a = np.zeros((2, 3))
    kv.pull(3, out=a)
    assert (a == 6).all()
    assert capsys.readouterr().out == "update on key: 3\n"
