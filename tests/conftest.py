"""Fixtures and hooks of the test suite. The shared helpers (tiny_config, cpu_env, ...) and test-only stand-ins live
in tests/support/ (its README); tests import them from there, `from support.helpers import tiny_config`."""

import os
import shutil
from pathlib import Path

import pytest

# Before the first import from tests/support/: the checks shared there (assert_same_run, ...) then explain a failure
# as a test module's own asserts do.
pytest.register_assert_rewrite("support")

import support.helpers  # noqa: E402,F401  next: sets the test environment (hub offline, at most two torch threads)
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402
from support.xdist_groups import group_launches, group_module_fixture_users  # noqa: E402
from support.vllm_servers import servers_as_found  # noqa: E402

# Property tests draw the same examples on every run (a CI failure reproduces), with no per-example deadline (two
# cores shared by two workers make timings noisy); `HYPOTHESIS_PROFILE=explore` draws fresh ones.
settings.register_profile("repeatable", derandomize=True, deadline=None, database=None, print_blob=True)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def shared_vllm_servers_as_found():
    """After each test, every vLLM server that tests share (a module-scoped fixture's) is back as it started, so that
    no test depends on what ran on it before (tests/support/vllm_servers.py). Nothing to do when none runs."""
    yield
    servers_as_found()


@pytest.fixture(autouse=True)
def one_process_threads(request, monkeypatch):
    """A `one_process` test runs beside a launch of ranks in CI's slow leg (tests/support/xdist_groups.py): under
    pytest-xdist, the process it starts gets its worker's share of the cores as torch threads, as the worker itself
    has (tests/support/helpers.py), not every core."""
    if (request.node.get_closest_marker("one_process") is not None and "PYTEST_XDIST_WORKER_COUNT" in os.environ
            and "OMP_NUM_THREADS" not in os.environ):
        monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))


@pytest.fixture
def fake_accelerator(monkeypatch):
    """`fake_accelerator(present)` makes every "is there an accelerator?" probe of the project, and transformers'
    bf16-GPU check behind TrainingArguments, answer `present`, so both branches run on any machine."""

    def fake(present: bool) -> None:
        monkeypatch.setattr("trl_gspo.launch.checks.has_accelerator", lambda: present)
        monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda *a, **k: present)

    return fake


LEFT_OUT: dict[str, int] = {}  # marker -> tests the selection below left out: the note at a run's end
LEFT_OUT_HOW = {"slow": "end-to-end and multi-process runs: `-m slow`", "gpu": "`-m gpu`, on a GPU",
                "vllm": "`-m vllm`, with vLLM installed", "docs": "`-m docs`, after `mkdocs build`"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """pyproject.toml's `-n auto` runs the default (fast) suite on one pytest-xdist worker per core. A run whose `-m`
    names `slow` or `gpu` stays in one process unless the command line gives `-n`: a slow test keeps both cores of
    a 2-core machine busy by itself (two ranks), and the GPU tests share one device. CI's slow leg gives
    `-n 2 --dist loadgroup`: the launching tests keep to one worker (tests/support/xdist_groups.py)."""
    if any(marker in (config.option.markexpr or "") for marker in ("slow", "gpu")):
        return 0
    return None  # pytest-xdist's own count


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the `xdist_group` marks added here
def pytest_collection_modifyitems(config, items):
    """Selection by marker (markers: pyproject.toml), whatever paths or `-k` say: the GPU acceptance suite and the
    real-vLLM suite run only when the `-m` expression names `gpu` or `vllm` (each needs what a plain test environment
    lacks), the built-site checks only when it names `docs`, and the `slow` tests (end-to-end and multi-process runs, three quarters of the suite's time) only when it
    names `slow`, `gpu` or `vllm`. So `pytest` (the README's test command), `pytest tests/test_resume.py` and
    `pytest -k resume` are fast; `pytest -m slow` runs the slow tests, and CI runs both."""
    named = config.option.markexpr or ""
    for marker in ("gpu", "vllm", "docs"):
        if marker in named:
            continue
        LEFT_OUT[marker] = len(_leave_out(config, items, marker))
    if not any(marker in named for marker in ("slow", "gpu", "vllm")):
        LEFT_OUT["slow"] = len(_leave_out(config, items, "slow"))
    group_launches(items)
    group_module_fixture_users(items)


def _leave_out(config, items, marker):
    left_out = [item for item in items if item.get_closest_marker(marker) is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item.get_closest_marker(marker) is None]
    return left_out


# ---------------------------------------------------------------- the GPU acceptance suite (tests/test_gpu.py)
GPU_FIGURES: list[tuple[str, str]] = []  # (check, figure) printed at the end of a `pytest -m gpu` run
GPU_TESTS_DEVICE = os.environ.get("TRL_GSPO_GPU_TESTS_DEVICE", "cuda")  # "cpu": a developer aid, see test_gpu.py


@pytest.fixture
def device() -> str:
    """The GPU tests' device: CUDA, or a skip saying there is none."""
    if GPU_TESTS_DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device visible: the GPU acceptance suite (pytest -m gpu) runs on a GPU machine")
    return GPU_TESTS_DEVICE


@pytest.fixture
def record_figure(request):
    """`record_figure(check, figure)`: a line of the summary a `pytest -m gpu` run prints at its end. Kept in the
    test's report (user_properties), which pytest-xdist sends back from its workers: a module-level list filled in
    a worker never reached the summary of a `pytest -m gpu -n 3` run."""
    return lambda check, figure: request.node.user_properties.append(("gpu_figure", (check, figure)))


# ---------------------------------------------------------------- skips: counted, and only two kinds allowed in CI
SKIPPED: list[tuple[str, str, bool]] = []  # (test, reason, allowed) of each skipped test; summed at a run's end
STRICT_SKIPS = os.environ.get("TRL_GSPO_STRICT_SKIPS") == "1"  # .ci/run: any other skip fails the run


def _allowed_skip(report, reason: str) -> bool:
    """A skip for what the machine lacks: a GPU, or vLLM for a test marked `vllm` where vLLM is not installed."""
    import importlib.util

    if reason.startswith("no CUDA device visible"):
        return True
    return "vllm" in report.keywords and importlib.util.find_spec("vllm") is None


def pytest_runtest_logreport(report):
    if report.when == "teardown":  # each phase's report holds the test's properties; read them once
        GPU_FIGURES.extend(tuple(value) for name, value in report.user_properties if name == "gpu_figure")
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        SKIPPED.append((report.nodeid, reason, _allowed_skip(report, reason)))


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its counts go to the controlling process
        session.config.workeroutput["trl_gspo_left_out"] = dict(LEFT_OUT)
    elif STRICT_SKIPS and any(not allowed for _, _, allowed in SKIPPED) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # the summary names them


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    LEFT_OUT.update(getattr(node, "workeroutput", {}).get("trl_gspo_left_out", {}))  # each worker collects all


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left_out = [f"{count} {marker} ({LEFT_OUT_HOW[marker]})" for marker, count in sorted(LEFT_OUT.items()) if count]
    if left_out:
        terminalreporter.write_line(f"trl-gspo: tests left out by marker: {', '.join(left_out)}; CI runs them all")
    reasons: dict[str, int] = {}
    for _, reason, _ in SKIPPED:
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.write_line(f"trl-gspo: {len(SKIPPED)} skipped" + "".join(
        f"\n  {count} x {reason}" for reason, count in sorted(reasons.items())))
    unexpected = [(test, reason) for test, reason, allowed in SKIPPED if not allowed]
    if STRICT_SKIPS and unexpected:
        terminalreporter.write_line("trl-gspo: FAILED: a test skipped for a reason other than a missing GPU, or a "
                                    "missing vLLM (marked `vllm`); every test must run on this machine:", red=True)
        for test, reason in unexpected:
            terminalreporter.write_line(f"  {test}: {reason}", red=True)
    if not GPU_FIGURES:
        return
    cuda = GPU_TESTS_DEVICE == "cuda" and torch.cuda.is_available()
    where = torch.cuda.get_device_name(0) if cuda else GPU_TESTS_DEVICE
    terminalreporter.section(f"trl-gspo GPU acceptance: {where}, torch {torch.__version__}")
    for check, figure in GPU_FIGURES:
        terminalreporter.write_line(f"{check:<52} {figure}")


@pytest.fixture(scope="session")
def tokenizer():
    from trl_gspo.quickstart.tokenizer import build_tokenizer

    return build_tokenizer()


def _tool_model_inputs() -> str:
    """A short hash of what the tool model is built from: the quickstart's sources and the library versions."""
    import hashlib
    from importlib import metadata

    import trl_gspo.quickstart

    versions = []
    for package in ("torch", "transformers", "trl", "peft", "accelerate", "tokenizers"):
        try:
            versions.append(f"{package}=={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} absent")
    digest = hashlib.sha256(" ".join(versions).encode())
    for source in sorted(Path(trl_gspo.quickstart.__file__).parent.iterdir()):
        if source.suffix in (".py", ".json"):
            digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory):
    """A directory with the tiny tool-calling Qwen3-MoE (`trl_gspo.quickstart.tools.build_tool_model`: character
    tokenizer with chat and response templates, SFT cold start to call `add`), built once per test run. Load it with
    `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` (or vLLM); every test gets fresh weights that way."""
    from filelock import FileLock

    from trl_gspo.quickstart.tools import build_tool_model

    # One build per test run, pytest-xdist workers included: they share the run's base directory's parent. With
    # TRL_GSPO_TEST_CACHE set (.ci/run sets it), one build per set of inputs across runs: CI's legs share it.
    cache = os.environ.get("TRL_GSPO_TEST_CACHE")
    if cache:
        shared = Path(cache)
        shared.mkdir(parents=True, exist_ok=True)
    else:
        shared = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):
            shared = shared.parent
    path = shared / f"tool_model-{_tool_model_inputs()}"
    with FileLock(str(shared / "tool_model.lock")):
        if not path.is_dir():
            staging = shared / "tool_model.partial"  # renamed when whole: a failed build leaves no half a model
            shutil.rmtree(staging, ignore_errors=True)
            build_tool_model(output_dir=str(staging))
            staging.rename(path)
    return path


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, tokenizer):
    """A directory with the tiny Qwen3-MoE (`trl_gspo.quickstart.model.build_model`, seed 0) and its tokenizer, for
    trainers that load a model by path (TRL's asynchronous trainer)."""
    from support.helpers import save_tiny_moe

    return save_tiny_moe(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test: the tool model is so small that one is much faster than two (measured 5-40x on
    2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
