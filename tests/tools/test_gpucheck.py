"""`python -m gpukv gpucheck`: the one command a lent GPU runs, kept working on the CUDA
emulation: every section written, kernels against their goldens, failures and cuts of
the test section named, and a clear line when there is no GPU at all."""
from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpukv.tools.gpucheck import cli, goldens, isolated, kernel_cases, suite
from gpukv.tools.gpucheck.budget import Budget
from gpukv.tools.gpucheck.section import Section

from .. import gpu_env
from ..bfloat16 import BF16, needs_bfloat16

SECTIONS = ("environment", "kernels", "bandwidth", "store", "trainer", "tests")


def _env(**extra):
    env = gpu_env.subprocess_env(gpus=False)
    env.update(extra)
    return env


# ------------------------------------------------------------------ the command
@pytest.fixture(scope="module")
def quick_out(tmp_path_factory):
    return tmp_path_factory.mktemp("gpucheck")


@pytest.fixture(scope="module")
def quick_run(quick_out):
    """One `gpucheck --quick` on the CUDA emulation: (exit status, output, JSON, seconds)."""
    out = quick_out
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gpukv", "gpucheck", "--quick", "--out",
                           str(out)], capture_output=True, text=True, timeout=300,
                          env=_env(GPUKV_CUDA_EMULATION="1"), cwd=out)
    seconds = time.monotonic() - start
    (path,) = out.glob("gpucheck_*.json")
    return proc.returncode, proc.stdout + proc.stderr, json.loads(path.read_text()), seconds


def test_quick_run_on_the_emulation_writes_every_section(quick_run):
    """Each section runs, passes and says what it found; the record names the device."""
    status, output, record, _ = quick_run
    assert status == 0, output
    assert record["gpucheck"]["device"] == "CUDA emulation" and record["gpucheck"]["ok"]
    with_torch = importlib.util.find_spec("torch") is not None
    for name in SECTIONS:
        if name == "trainer" and not with_torch:  # (the README's test extra has no torch)
            assert "PyTorch is not installed" in record[name]["skipped"], record[name]
            continue
        assert record[name]["ok"] is True, (name, record[name])
        assert record[name]["summary"], name
        assert f"  {name}" in output
    # without ml_dtypes, only the bfloat16 tests skip and the bfloat16 kernel cases stay unrun
    bf16_skipped = sum(r["tests"] for r in record["tests"]["skip_reasons"]
                       if r["reason"] == needs_bfloat16.kwargs["reason"])
    assert record["tests"]["passed"] + bf16_skipped == record["tests"]["collected"] > 100
    assert record["environment"]["first_compile"]["ok"] is True
    assert record["environment"]["ml_dtypes"]["installed"] is (BF16 is not None)
    cases = kernel_cases.all_cases()
    bf16_cases = 0 if BF16 is not None else sum(map(kernel_cases.needs_bfloat16, cases))
    assert record["kernels"]["identical"] + bf16_cases == record["kernels"]["cases"] == len(cases)
    kernels = {r["kernel"] for r in record["bandwidth"]["rows"]}
    assert {"device-to-device memcpy", "sum of 2 terms", "canonical tree sum of 4 leaves",
            "2bit encode", "adam step", "lamb step"} <= kernels
    assert all(r["copy_fraction"] > 0 for r in record["bandwidth"]["rows"])
    assert {r["operation"] for r in record["store"]["small"]} == {"push", "pull", "pushpull"}
    profiles = [record["store"]["pushpull_host_profile"]]
    if with_torch:
        assert record["trainer"]["first_update_max_rounding_steps"] <= 2
        assert record["trainer"]["loss_scaling_bitwise"] is True
        assert record["trainer"]["loss_scaling_scale"] == 512
        profiles += [record["trainer"]["gpukv_update_host_profile"],
                     record["trainer"]["torch_update_host_profile"]]
    for found in profiles:
        assert found["python_calls_per_call"] > 0 and found["top"], found
    assert record["store"]["pushpull_host_profile"]["own_us_per_call"]["gpukv"] > 0
    assert "pushpull's host time:" in record["store"]["summary"]
    # four values on one GPU: per call one event of the caller's stream, one of each
    # other as the home waits for it before and after, one for the whole call
    events = record["store"]["events_per_call"]
    assert 0 < events["pushpull"] <= 16 and events["push"] + events["pull"] <= 16, events


def test_a_host_profile_gives_calls_and_own_time_per_call_by_library():
    """The profile of a call counts its Python calls per call exactly, puts the time of
    gpukv's functions under gpukv and lists the functions that took the most."""
    from gpukv.device.codecs import packed_nbytes
    from gpukv.tools.gpucheck import host_profile

    def call():
        for n in range(3):
            packed_nbytes(n, 2)
    found = host_profile.profile(call, 7)
    assert found["calls"] == 7
    assert found["python_calls_per_call"] == 1 + 3  # call() and its three calls
    assert set(found["own_us_per_call"]) <= {*host_profile.LIBRARIES, "other"}
    assert found["own_us_per_call"]["gpukv"] > 0
    (row,) = [r for r in found["top"] if r["function"].endswith(" packed_nbytes")]
    assert row["function"].startswith("gpukv/device/host_codecs.py:")
    assert row["calls_per_call"] == 3
    assert "4 Python calls per call (" in host_profile.summary(found)
    assert host_profile.library("/x/site-packages/cupy/_core/core.py") == "cupy"
    assert host_profile.library("/x/y/z.py") == "other"


def test_quick_run_keeps_to_its_budget(quick_run):
    """--quick on the emulation has a 90 s budget and ends within it."""
    _, _, record, _ = quick_run
    assert record["gpucheck"]["elapsed_s"] <= record["gpucheck"]["budget_s"] == 90


def _files_under(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_out_holds_the_record_the_summary_and_one_archive(quick_run, quick_out):
    """A copy that takes back only a few files gets them all: --out holds the JSON, the
    text and one archive of the sections' logs, whose folder is gone."""
    _, output, record, _ = quick_run
    files = _files_under(quick_out)
    assert len(files) == 3 and "gpucheck-work.tar.gz" in files, files  # 8 come back
    with tarfile.open(quick_out / "gpucheck-work.tar.gz") as tar:
        names = tar.getnames()
    for name in ("kernels.log", "trainer.json", "tests/collect.jsonl", "tests/shard-0.log"):
        assert f"gpucheck-work/{name}" in names, names
    assert record["tests"]["logs"].endswith("gpucheck-work.tar.gz: gpucheck-work/tests/")
    assert "gpucheck-work.tar.gz" in output


def test_goals_on_the_emulation_are_listed_but_not_judged(quick_run):
    """The emulation's speeds say nothing of a GPU's: every goal is shown, none judged."""
    _, output, record, _ = quick_run
    goals = [g for name in SECTIONS for g in record[name]["goals"]]
    assert goals and all(g["met"] is None for g in goals)
    assert "none judged" in output


def test_without_any_gpu_it_says_so_in_one_line(tmp_path):
    """No GPU visible and no emulation asked for: one line, exit status 2, and the record
    under --out says the same."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "gpukv", "gpucheck", "--out", str(out)],
                          capture_output=True, text=True, timeout=120,
                          env=_env(GPUKV_CUDA_EMULATION="0", CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no GPU here" in lines[0], proc.stdout
    assert "GPUKV_CUDA_EMULATION=1" in lines[0]
    assert _files_under(out) == ["gpucheck-work.tar.gz", "gpucheck_unknown-gpu.json",
                                 "gpucheck_unknown-gpu.txt"]
    record = json.loads((out / "gpucheck_unknown-gpu.json").read_text())
    assert record["gpucheck"]["finished"] and record["gpucheck"]["ok"] is False
    assert record["environment"]["ok"] is False
    assert lines[0].endswith(record["environment"]["failed"][0])
    assert "no GPU here" in (out / "gpucheck_unknown-gpu.txt").read_text()


def test_a_cupy_that_cannot_compile_is_named_in_the_environment(monkeypatch):
    """The first kernel's compile error (CuPy 14 without CUDA headers, no NVRTC) fails the
    environment section with CuPy's words, once."""
    from gpukv.device.cuda import probe
    from gpukv.tools.gpucheck import machine

    def uncompilable(physical):
        raise RuntimeError("Failed to find CUDA headers")

    monkeypatch.setattr(probe, "first_compile", uncompilable)
    section = Section("environment")
    assert machine.first_compile(section, 0) == {
        "ok": False, "error": "RuntimeError: Failed to find CUDA headers"}
    assert section.ok is False
    assert "cannot compile gpukv's kernels: RuntimeError: Failed to find CUDA headers" in str(
        section.to_dict())


@pytest.mark.parametrize("version, flagged", [("0.5.1", False), ("0.6.0", False),
                                              ("0.7.0", True), ("1.0", True)])
def test_ml_dtypes_from_0_7_is_flagged(monkeypatch, version, flagged):
    import types

    from gpukv.tools.gpucheck import machine
    monkeypatch.setitem(sys.modules, "ml_dtypes", types.SimpleNamespace(__version__=version))
    facts = machine.ml_dtypes_facts()
    assert facts["installed"] and facts["version"] == version
    assert ("below 0.7" in facts.get("note", "")) is flagged


def test_a_malformed_emulation_choice_is_named_not_read_as_off():
    """'yes' is neither 1 nor 0: refused in one line, nothing measured."""
    proc = subprocess.run([sys.executable, "-m", "gpukv", "gpucheck"], capture_output=True,
                          text=True, timeout=120, env=_env(GPUKV_CUDA_EMULATION="yes"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.strip() == ("gpukv gpucheck: GPUKV_CUDA_EMULATION='yes': expected 1 "
                                   "(on) or 0 (off)"), proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--jobs", "0"], "--jobs 0"),
    (["--sections", "tests,bogus"], "bogus"),
    (["--budget", "-3"], "-3"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    """A wrong option stops before anything runs, naming the value."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_an_out_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    """--out naming a file stops before anything runs (it was a FileExistsError once the
    first section had run)."""
    file = tmp_path / "results"
    file.write_text("")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--quick", "--out", str(file)])
    assert exc.value.code == 2
    assert f"--out {file}: is a file" in capsys.readouterr().err


# -------------------------------------------------------------------- the goldens
def test_every_case_has_one_golden_and_no_golden_is_stale():
    """The goldens file holds exactly the cases gpucheck runs."""
    assert set(goldens.load()) == {c.name for c in kernel_cases.all_cases()}


def test_the_cases_reach_every_kernel_gpukv_launches():
    """Every dtype the sum kernels are made for, every compression kernel (every
    compressor's but PowerSGD's, which runs on the host), every optimizer rule (with its
    row-sparse form where it has one) is among the cases."""
    from gpukv.device.cuda import codec_kernels, kernels
    from gpukv.optim import registered
    names = [c.name for c in kernel_cases.all_cases()]
    summed = {t for t, _ in kernel_cases.SUM_PAIRS}
    assert summed == set(kernels._CTYPES)
    for family in ("sum", "tree sum"):
        assert {n.split()[-1].split("->")[0] for n in names if n.startswith(family + " ")} \
            == summed
    for entry in ("quantize_2bit", "dequantize_2bit", "quantize_1bit", "dequantize_1bit"):
        assert f"gpukv_{entry}" in codec_kernels.CUDA_SOURCE
    from gpukv.encoding.compressors import make_compressor, type_names
    on_gpu = [t for t in type_names()  # PowerSGD's sums run on the host: no kernel
              if t != "none" and not make_compressor({"type": t}).low_rank]
    assert {f"compression {t}" for t in on_gpu} <= set(names)
    configs = {type(make()) for make in kernel_cases.optimizer_configs().values()}
    assert configs == set(registered())
    sparse = {cls().name for cls in registered()
              if cls().lazy_rows() or cls().sparse_cuda_body != cls().cuda_body}
    rows = {kernel_cases.optimizer_configs()[c]().name for c in kernel_cases.ROW_CONFIGS}
    assert sparse <= rows


def test_inputs_are_the_same_for_the_same_name_and_carry_special_values():
    """A case's inputs depend only on its name, and float inputs hold NaNs, infinities,
    subnormals and signed zeros."""
    a = kernel_cases.values(kernel_cases.Stream("x"), 5000, np.float32)
    b = kernel_cases.values(kernel_cases.Stream("x"), 5000, np.float32)
    c = kernel_cases.values(kernel_cases.Stream("y"), 5000, np.float32)
    assert a.tobytes() == b.tobytes() != c.tobytes()
    bits = a.view(np.uint32)
    assert np.isnan(a).sum() >= 3 and np.isinf(a).sum() >= 2
    assert ((bits & 0x7F800000) == 0).sum() >= 3  # zeros and subnormals
    assert len(set((bits[np.isnan(a)] & 0x007FFFFF).tolist())) >= 2  # several payloads


# any bit pattern, and often one near the special values (NaNs, infinities, subnormals,
# the smallest normal, zeros), where two draws must meet for the rule to be tested
F32 = st.one_of(
    st.integers(0, 2**32 - 1),
    st.sampled_from(kernel_cases.SPECIAL_BITS["float32"]
                    + [0x00400000, 0x807FFFFF, 0x00800001, 0x7FFFFFFF]),
).map(lambda b: np.array([b], np.uint32).view(np.float32))


@given(F32, F32)
def test_canonical_float32_bits_forget_only_nan_payloads_and_flushed_values(x, y):
    """Two float32 values are canonically equal exactly when they are the same bits, both
    NaN, or both of magnitude at most the smallest normal."""
    tiny = np.float32(np.finfo(np.float32).tiny)
    same = x.view(np.uint32)[0] == y.view(np.uint32)[0]
    nan = np.isnan(x[0]) and np.isnan(y[0])
    flushed = abs(x[0]) <= tiny and abs(y[0]) <= tiny
    canonical = goldens.canonical_bits(x)[0] == goldens.canonical_bits(y)[0]
    assert canonical == (same or nan or flushed)


def test_float16_subnormals_stay_and_integers_are_untouched():
    """float16 keeps its subnormals (its arithmetic runs in float32); integers are bits."""
    h = np.array([0x0001, 0x0000], np.uint16).view(np.float16)
    assert goldens.canonical_bits(h).tolist() == [1, 0]
    assert goldens.canonical_bits(np.array([-1, 7], np.int32)).tolist() == \
        np.array([-1, 7], np.int32).view(np.uint32).tolist()


CASES = kernel_cases.all_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    pytest.param(c, marks=needs_bfloat16) if kernel_cases.needs_bfloat16(c) else c for c in CASES],
    ids=[c.name for c in CASES])
def test_every_kernel_gives_its_golden(case):
    """Each case on GPU 0 gives its golden digest: exactly on the emulation (which made
    them), on a GPU within the documented exceptions (NaN payloads, flush-to-zero edges)."""
    from gpukv.device.cuda.device import cuda_device
    golden = goldens.load()[case.name]
    got = goldens.run_case(case, cuda_device(0))
    if gpu_env.EMULATED:
        assert goldens.digest(got) == golden["exact"]
    else:
        assert goldens.digest(got, canonical=True) == golden["canonical"]


def _fake_case(name, gpu_outputs, host_outputs):
    return kernel_cases.KernelCase(
        name, "fake", lambda device: dict(host_outputs if device.host_memory else gpu_outputs))


@pytest.mark.gpu
def test_kernels_section_tells_documented_differences_from_mismatches():
    """Outputs equal to a golden but for a NaN payload are reported as within the
    exceptions; outputs that differ in a normal value fail, naming the case and the
    output and first element that differ from the host twin."""
    nan = np.array([1.0, np.nan], np.float32)
    other_nan = nan.copy()
    other_nan.view(np.uint32)[1] = 0x7FC0BEEF
    want = {"out": np.array([1.0, 2.0, 5.0], np.float32)}
    cases = [_fake_case("payload", {"out": other_nan}, {"out": nan}),
             _fake_case("wrong", {"out": np.array([1.0, 3.0, 5.0], np.float32)}, want)]
    made = {"payload": goldens.record({"out": nan}), "wrong": goldens.record(want)}
    section = goldens.run(Budget(60).share(1.0), cases, made)
    assert section.data["documented"] == [{"case": "payload", "exceptions": ["NaN payloads"]}]
    assert section.ok is False and section.failed == [
        "wrong: differs from the emulation's golden; against the host twin: out: 1 of 3 "
        "elements, first at 1: np.float32(3.0) against np.float32(2.0)"]
    assert section.data["mismatches"][0]["case"] == "wrong"


@pytest.mark.gpu
def test_kernels_section_keeps_each_case_as_it_goes(monkeypatch):
    """Before each case the kernels section hands on what it has found and the case it
    is about to run, so a case that hangs is named and the ones before it are kept."""
    from gpukv.tools.gpucheck import section as section_module
    out = {"out": np.array([1.0, 2.0], np.float32)}
    cases = [_fake_case(name, out, out) for name in ("a", "b", "c")]
    kept = []
    monkeypatch.setattr(section_module, "_progress_sinks", [])
    section_module.keep_progress(lambda s, running: kept.append(
        (running, s.data["identical"], s.line)))
    section = goldens.run(Budget(60).share(1.0), cases,
                          {name: goldens.record(out) for name in ("a", "b", "c")})
    assert section.ok is True and section.line.startswith("3 cases: 3 bit-identical")
    assert [(running, identical) for running, identical, _ in kept] == [
        ("a", 0), ("b", 1), ("c", 2)]
    assert kept[-1][2].startswith("2 of 3 cases run: 2 bit-identical")


def test_bfloat16_bit_patterns_compare_as_bfloat16():
    """The bf16 codec's uint16 payload named as bfloat16 bits forgets NaN payloads; the
    same bits under another name are plain integers."""
    a = np.array([0x7FC1, 0x3F80], np.uint16)
    b = np.array([0x7FFF, 0x3F80], np.uint16)
    named = "payload " + goldens.BFLOAT16_BITS

    def canonical(outputs):
        return goldens.digest(outputs, canonical=True)
    assert canonical({named: a}) == canonical({named: b})
    assert canonical({"payload": a}) != canonical({"payload": b})


@pytest.mark.gpu
def test_kernels_section_out_of_time_is_cut_not_passed():
    """A section whose deadline has passed runs no case and says it was cut."""
    section = goldens.run(Budget(0).share(1.0), kernel_cases.all_cases()[:3], {})
    assert section.ok is False and section.cut and len(section.data["not_run"]) == 3


# ------------------------------------------------------------------ the test section
def test_shards_keep_files_whole_and_balance():
    """Tests are shared out file by file, the largest files first to the emptiest shard."""
    ids = [f"tests/a.py::t{i}" for i in range(6)] + [f"tests/b.py::t{i}" for i in range(3)] \
        + [f"tests/c.py::t{i}" for i in range(3)]
    groups = suite.shards(ids, 2)
    assert sorted(len(g) for g in groups) == [6, 6]
    for g in groups:
        assert len({i.split("::")[0] for i in g}) in (1, 2)
    assert sorted(i for g in groups for i in g) == sorted(ids)
    assert suite.shards(ids, 10) and len(suite.shards(ids, 10)) == 3


def test_outcomes_read_every_kind_of_result():
    """Passed, failed, errored, skipped and interrupted tests are told apart."""
    def report(nodeid, when, outcome, message=""):
        return {"event": "report", "id": nodeid, "when": when, "outcome": outcome,
                "message": message}
    events = [{"event": "start", "id": "p"}, report("p", "setup", "passed"),
              report("p", "call", "passed"), report("p", "teardown", "passed"),
              {"event": "start", "id": "f"}, report("f", "setup", "passed"),
              report("f", "call", "failed", "assert 1 == 2"),
              report("f", "teardown", "passed"),
              {"event": "start", "id": "e"}, report("e", "setup", "failed", "boom"),
              report("e", "teardown", "passed"),
              {"event": "start", "id": "s"}, report("s", "setup", "skipped", "no NCCL"),
              report("s", "teardown", "passed"),
              {"event": "start", "id": "i"}, report("i", "setup", "passed")]
    found = suite.outcomes(events)
    assert {k: v["outcome"] for k, v in found.items()} == {
        "p": "passed", "f": "failed", "e": "error", "s": "skipped", "i": "interrupted"}
    assert found["f"]["message"] == "call: assert 1 == 2"
    assert found["s"]["message"] == "no NCCL"


FAKE_TESTS = {
    "conftest.py": """
        def pytest_configure(config):
            config.addinivalue_line("markers", "gpu: a GPU test")
            config.addinivalue_line("markers", "multi_gpu(n): several GPUs")
    """,
    "test_one.py": """
        import pytest

        @pytest.mark.gpu
        def test_passes():
            assert True

        @pytest.mark.gpu
        def test_fails():
            print("adding one and one")
            assert 1 + 1 == 3, "arithmetic is broken"

        @pytest.mark.multi_gpu(4)
        def test_skips():
            pytest.skip("needs NCCL")

        def test_not_a_gpu_test():
            raise AssertionError("never selected")
    """,
    "test_two.py": """
        import time
        import pytest

        @pytest.mark.gpu
        def test_hangs():
            time.sleep(300)

        @pytest.mark.gpu
        def test_after_the_hang():
            assert True
    """,
    "test_three.py": """
        import os
        import pytest

        @pytest.mark.gpu
        def test_crashes():
            os.abort()  # faulthandler prints where, the process ends

        @pytest.mark.gpu
        def test_after_the_crash():
            assert True
    """,
}


@pytest.fixture
def fake_checkout(tmp_path):
    """A checkout whose tests/ holds GPU tests that pass, fail, skip and hang."""
    (tmp_path / "tests").mkdir()
    for name, text in FAKE_TESTS.items():
        (tmp_path / "tests" / name).write_text(textwrap.dedent(text))
    return tmp_path


def test_test_section_names_failures_crashes_and_what_the_deadline_cut(fake_checkout,
                                                                       tmp_path):
    """Each failure is listed with its test id and message, a skip with its reason, a
    test that took its process down as a failure and the tests that never ran after it;
    at the deadline the hanging test is cut while running and the section is cut."""
    seen = []
    section = suite.run(fake_checkout, False, Budget(15).share(1.0), quick=False, jobs=3,
                        work_dir=tmp_path / "work",
                        on_progress=lambda s, running: seen.append(s.to_dict()))
    data = section.data
    # meanwhile, the outcomes so far went to the record, the hanging test not a failure
    assert seen and all(s["cut"].startswith("still running when this record was written")
                        and "test_hangs" not in str(s["failed"]) for s in seen), seen
    assert seen[-1]["passed"] == 1 and seen[-1]["failed"] == 1
    assert data["collected"] == 7 and data["jobs"] == 3
    assert (data["passed"], data["failed"], data["skipped"]) == (1, 1, 1)
    assert (data["interrupted"], data["not_run"]) == (2, 2)
    failed = "\n".join(section.failed)
    assert "tests/test_one.py::test_fails: call: AssertionError: arithmetic is broken" in failed
    assert "tests/test_three.py::test_crashes: the process running it ended" in failed
    assert "exited with status -6" in failed
    assert "test_hangs" not in failed
    assert "1 collected tests never ran" in failed  # the one after the crash
    assert data["skip_reasons"] == [{"reason": "needs NCCL", "tests": 1}]
    assert "1 cut while running (tests/test_two.py::test_hangs)" in section.cut
    assert section.ok is False
    # the record alone says why: the traceback's tail and what the test printed
    details = {f["id"]: f["details"] for f in data["failures"]}
    fails = details["tests/test_one.py::test_fails"]
    assert "assert 1 + 1 == 3" in fails and "test_one.py:11: AssertionError" in fails
    assert "Captured stdout call -----\nadding one and one" in fails
    assert "Fatal Python error: Aborted" in details["tests/test_three.py::test_crashes"]
    assert data["details_cut"] is None


def test_failure_details_stop_at_their_cap():
    """Past MAX_DETAILS_CHARS in all, failures keep their message and the record says
    how many lost their details."""
    entry = {"outcome": "failed", "message": "call: boom", "details": "x" * 6000}
    bad = [(f"t{i}", entry) for i in range(40)]
    records, note = suite.failure_records(bad, {})
    kept = [r for r in records if r["details"]]
    assert len(records) == 40 and len(kept) == suite.MAX_DETAILS_CHARS // 6000
    assert sum(len(r["details"]) for r in records) <= suite.MAX_DETAILS_CHARS
    assert all(r["message"] == "call: boom" for r in records)
    assert note.startswith(f"the details of {40 - len(kept)} failures left out")


def test_details_keep_the_end_of_a_long_traceback_and_output():
    """A long traceback keeps its last lines, a long captured output its end, and the
    whole stays within the per-failure cap."""
    from types import SimpleNamespace

    from gpukv.tools.gpucheck import pytest_plugin
    report = SimpleNamespace(
        longreprtext="\n".join(f"frame {i}" for i in range(500)) + "\nE   AssertionError",
        sections=[("Captured stderr call", "noise\n" * 5000 + "the last words\n")])
    text = pytest_plugin.details(report)
    assert len(text) <= pytest_plugin._DETAIL_CHARS + 20
    assert "frame 0\n" not in text and "frame 499\nE   AssertionError" in text
    assert text.count("[... cut]") == 2 and text.endswith("the last words")


def test_sigterm_lets_the_running_test_end_what_it_started(tmp_path):
    """gpucheck ends a pytest process at its deadline with SIGTERM: under the plugin the
    running test's `finally` runs (where it ends the MPI job or GPU work it started)
    and the session still records its end."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_holds.py").write_text(textwrap.dedent("""
        import time
        from pathlib import Path

        def test_holds_a_job():
            try:
                time.sleep(60)
            finally:
                Path(__file__).with_name("ended").write_text("")
    """))
    report = tmp_path / "events.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", suite.PLUGIN, "-p",
                             "no:cacheprovider", "tests/test_holds.py"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(GPUCHECK_REPORT=str(report)))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            e["event"] == "start" for e in suite.read_events(report)):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    assert (tmp_path / "tests" / "ended").exists(), output
    assert suite.read_events(report)[-1]["event"] == "finish", output


def test_test_section_without_a_checkout_is_skipped_not_failed():
    """An installed gpukv without tests/ beside it skips the section, saying why."""
    section = suite.run(None, False, Budget(5).share(1.0), quick=True, jobs=1)
    assert section.ok is None and "checkout" in section.skipped


def test_pytest_without_the_timeout_plugin_still_starts(monkeypatch):
    """setup.cfg's `timeout` needs pytest-timeout, which a bare GPU machine may lack:
    the command then drops --strict-config, which would stop pytest before any test."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pytest_timeout" else real(name, *a))
    command = suite.pytest_command(["tests/device"])
    assert command[-2:] == ["-o", "addopts=--strict-markers -ra"]
    proc = subprocess.run(command[:3] + ["-p", "no:timeout"] + command[3:] + ["--co", "-q"],
                          capture_output=True, text=True, timeout=120,
                          cwd=gpu_env.ROOT, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------- sections in their processes
@pytest.mark.parametrize("script, words", [
    ("import time; time.sleep(300)", ["still running", "ended", 'File "<string>"']),
    ("import os; os.abort()", ["SIGABRT", "without a result"]),
    ("raise SystemExit(3)", ["exit status 3", "without a result"]),
], ids=["hangs", "crashes", "exits"])
def test_a_section_that_hangs_or_dies_fails_alone(script, words, tmp_path, monkeypatch):
    """A section's process that outlives its deadline and grace is ended, with the
    Python frames it was in; one that dies says how; either way the section fails and
    the run goes on."""
    monkeypatch.setattr(isolated, "GRACE_S", 3.0)
    dump = "import faulthandler; faulthandler.dump_traceback_later(2)\n"
    monkeypatch.setattr(isolated, "child_command",
                        lambda *a: [sys.executable, "-c", dump + script])
    start = time.monotonic()
    section = isolated.run("store", Budget(1).share(1.0), quick=True, work=tmp_path)
    assert time.monotonic() - start < 60
    assert section.ok is False
    for word in words:
        assert word in section.failed[0], section.failed


#: a section's process (the real child side, on a made-up GPU) that measures three rows,
#: keeping each as it goes; the section named in $FAKE_ENDS_IN hangs or dies at the third
FAKE_CHILD = textwrap.dedent("""
    import os, sys, time
    from gpukv.tools.gpucheck import isolated, machine
    from gpukv.tools.gpucheck.section import Section

    def three_rows(name, deadline, quick, found):
        section = Section(name)
        section.data["gpus"] = found.gpus
        rows = section.data["rows"] = []
        for i in range(3):
            section.progress(running=f"row {i}")
            if i == 2 and name == os.environ["FAKE_ENDS_IN"]:
                if os.environ["FAKE_HOW"] == "hangs":
                    time.sleep(300)
                os.abort()
            rows.append({"row": i})
            section.line = f"{len(rows)} rows"
        return section

    machine.open_machine = lambda: machine.Machine(False, None, [{"id": 0, "name": "Fake GPU"}])
    isolated._section = three_rows
    sys.exit(isolated.child(sys.argv[1:]))
""")


@pytest.fixture
def fake_sections(monkeypatch):
    """Sections' processes run FAKE_CHILD; `ends(section, how)` picks the one that ends."""
    monkeypatch.setattr(isolated, "GRACE_S", 2.0)
    monkeypatch.setattr(isolated, "child_command", lambda name, seconds, quick, result: [
        sys.executable, "-c", FAKE_CHILD, name, f"{seconds:.1f}", "1", str(result)])

    def ends(name, how):
        monkeypatch.setenv("FAKE_ENDS_IN", name)
        monkeypatch.setenv("FAKE_HOW", how)
    return ends


@pytest.mark.parametrize("how, words", [
    ("hangs", ["still running", "ended during row 2"]),
    ("aborts", ["SIGABRT", "without a result during row 2"]),
])
def test_a_section_ended_midway_keeps_what_it_measured(how, words, fake_sections, tmp_path):
    """A section whose process hangs (ended at its deadline and grace) or dies after two
    rows keeps those two rows, cut, naming what it was running; while it runs its
    parent is handed each partial result."""
    fake_sections("store", how)
    seen = []
    section = isolated.run("store", Budget(3).share(1.0), quick=True, work=tmp_path,
                           on_progress=lambda s, running: seen.append((s.data, running)))
    assert section.data["rows"] == [{"row": 0}, {"row": 1}], section.to_dict()
    assert section.ok is False and len(section.failed) == 1
    for word in words:
        assert word in section.failed[0], section.failed
    assert section.cut == "its process ended during row 2: what it measured before is kept"
    assert section.line.endswith("before that: 2 rows") and section.seconds > 0
    if how == "hangs":
        assert seen[-1] == ({"gpus": [{"id": 0, "name": "Fake GPU"}],
                             "rows": [{"row": 0}, {"row": 1}]}, "row 2")


def test_a_section_that_ends_by_itself_gives_its_whole_result(fake_sections, tmp_path):
    """The partial result only stands in for a result the process did not write."""
    fake_sections("none", "hangs")
    section = isolated.run("store", Budget(30).share(1.0), quick=True, work=tmp_path)
    assert section.ok is True and section.cut is None and section.line == "3 rows"
    assert len(section.data["rows"]) == 3


def _restore_signals():
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    return lambda: [signal.signal(sig, handler) for sig, handler in kept.items()]


def test_a_hang_in_the_environment_step_costs_that_step_alone(fake_sections, monkeypatch,
                                                              tmp_path):
    """The record is written before the first step starts (command, host, the environment
    running); the environment step runs in a process of its own with a deadline, and
    while it hangs the record keeps what it found; the run then goes on, the record
    named after the GPU it found."""
    fake_sections("environment", "hangs")
    monkeypatch.delenv("GPUKV_CUDA_EMULATION", raising=False)
    out = tmp_path / "out"
    at_start, written = {}, []
    real_run = isolated.run

    def run(name, deadline, *, quick, work, on_progress=None):
        if name == "environment":
            at_start.update({p.name: json.loads(p.read_text()) for p in out.iterdir()})

        def progress(section, running):
            on_progress(section, running)
            (path,) = out.glob("*.json")
            written.append((path.name, json.loads(path.read_text())))
        return real_run(name, deadline, quick=quick, work=work, on_progress=progress)

    monkeypatch.setattr(isolated, "run", run)
    restore = _restore_signals()
    try:
        status = cli.main(["--out", str(out), "--sections", "kernels", "--budget", "16"])
    finally:
        restore()
    (first,) = at_start.values()
    assert list(at_start) == ["gpucheck_unknown-gpu.json"]
    assert first["gpucheck"]["command"] and first["gpucheck"]["host"]
    assert first["gpucheck"]["running"] == "environment" and not first["gpucheck"]["ok"]
    assert first["environment"]["running"] is True and first["environment"]["ok"] is False
    # while it hung: what it had found, and what it was running
    hung = [(name, r) for name, r in written if r["gpucheck"]["running"] == "environment"]
    assert {name for name, _ in hung} == {"gpucheck_unknown-gpu.json"}
    hung = hung[-1][1]
    assert hung["environment"]["running"] == "row 2"
    assert hung["environment"]["rows"] == [{"row": 0}, {"row": 1}]
    assert status == 1
    assert _files_under(out) == ["gpucheck-work.tar.gz", "gpucheck_fake-gpu.json",
                                 "gpucheck_fake-gpu.txt"]
    record = json.loads((out / "gpucheck_fake-gpu.json").read_text())
    assert record["gpucheck"]["device"] == "Fake GPU" and record["gpucheck"]["finished"]
    environment = record["environment"]
    assert environment["ok"] is False and "still running" in environment["failed"][0]
    assert environment["rows"] == [{"row": 0}, {"row": 1}] and "running" not in environment
    assert record["kernels"]["ok"] is True and len(record["kernels"]["rows"]) == 3


def test_sigterm_while_a_section_starts_still_ends_that_section(monkeypatch):
    """SIGTERM that lands inside Popen (after the fork): the run's handler holds it until
    the process is remembered, then raises, and stopping the run ends that process too."""
    from gpukv.tools.gpucheck import processes
    real_popen = subprocess.Popen

    def popen_then_signal(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        signal.raise_signal(signal.SIGTERM)  # as if it came before Popen returned
        return proc

    monkeypatch.setattr(processes.subprocess, "Popen", popen_then_signal)
    monkeypatch.setattr(processes, "_running", [])
    previous = signal.signal(signal.SIGTERM, cli._interrupt)
    try:
        with pytest.raises(cli.Interrupted, match="SIGTERM"):
            processes.start([sys.executable, "-c", "import time; time.sleep(60)"])
        (proc,) = processes._running
        assert proc.poll() is None  # remembered while it runs
        processes.stop_all()
        assert proc.poll() is not None
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_ends_the_run_and_its_children_and_keeps_the_record(tmp_path):
    """SIGTERM during a run (a harness's timeout) ends every process it started and
    writes the record of the sections done, marked interrupted."""
    out, work = tmp_path / "out", tmp_path / "tmp"
    work.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "gpukv", "gpucheck", "--quick", "--out",
                             str(out), "--sections", "trainer,tests"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(GPUKV_CUDA_EMULATION="1", TMPDIR=str(work)))
    with_torch = importlib.util.find_spec("torch") is not None
    started = "*/trainer.partial.json" if with_torch else "*/trainer.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(work.glob(started)):
        time.sleep(0.1)  # a section's process has started (and kept something)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    (path,) = out.glob("gpucheck_*.json")
    record = json.loads(path.read_text())
    head = record["gpucheck"]
    assert head["ok"] is False and head["interrupted"].startswith("Interrupted SIGTERM")
    assert "INTERRUPTED" in output
    if with_torch:  # what the section it was in had measured is kept, cut
        assert record["trainer"]["cut"].startswith("the run was interrupted while it ran (")
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == ""
    # the logs so far are packed beside the record, the temporary folder gone
    assert _files_under(out) == sorted([path.name, path.with_suffix(".txt").name,
                                        "gpucheck-work.tar.gz"])
    with tarfile.open(out / "gpucheck-work.tar.gz") as tar:
        assert "gpucheck-work/trainer.log" in tar.getnames()
    assert list(work.iterdir()) == []


# ---------------------------------------------------------------------- sections
def test_a_section_is_ok_only_when_nothing_failed_and_nothing_was_cut():
    """ok: None when skipped, False when failed or cut, True otherwise; goals apart."""
    s = Section("x")
    s.goal("speed", 0.5, 0.8)
    assert s.ok is True and s.goals[0]["met"] is False
    s.cut = "out of time"
    assert s.ok is False
    skipped = Section("y")
    skipped.skipped = "no torch"
    assert skipped.ok is None
    failed = Section("z")
    failed.fail("broken")
    assert failed.ok is False
    failed.goal("unjudged", 1.0, 2.0, judged=False)
    assert failed.goals[0]["met"] is None


def test_budget_shares_what_is_left():
    """A share is a fraction of the time left, never past the budget's end."""
    now = [100.0]
    budget = Budget(60, clock=lambda: now[0])
    first = budget.share(0.5)
    assert first.left() == 30
    now[0] += 40
    assert first.passed() and budget.left() == 20
    assert budget.share(0.25, at_least=100).left() == 20
