"""What every test shares: where the real datasets are, and what a missing one means.

A test that reads real data files is marked ``@needs_dataset("planetoid/ind.citeseer.graph")``
(paths relative to :data:`DATASETS`). When a file is missing the test is skipped, so a fresh
clone anywhere passes; with ``GNNPAR_REQUIRE_DATASETS=1`` (``.ci/run`` sets it) the test
fails instead, so a run that should have the data cannot pass without using it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# The suite's worlds are gloo worlds on the CPU, also on a machine with GPUs (where gnnpar
# would pick NCCL by itself); tests/test_cuda.py asks for the GPU explicitly.
os.environ.setdefault("GNNPAR_DEVICE", "cpu")

#: The shared datasets folder next to the checkout (``GNNPAR_TEST_DATASETS`` overrides it,
#: for a copy of the tree that lives elsewhere, such as the mutation check's).
DATASETS = Path(
    os.environ.get("GNNPAR_TEST_DATASETS")
    or Path(__file__).resolve().parents[1].parent / "shared" / "datasets"
)
PLANETOID = DATASETS / "planetoid"
CITESEER = "planetoid/ind.citeseer.graph"
REQUIRE = "GNNPAR_REQUIRE_DATASETS"


def needs_dataset(*files: str) -> pytest.MarkDecorator:
    """Mark a test (or, as ``pytestmark``, a module) that reads ``files`` under DATASETS."""
    return pytest.mark.dataset(*files)


def missing_datasets(files: tuple[str, ...]) -> list[str]:
    """Which of ``files`` are not under :data:`DATASETS`."""
    return [f for f in files if not (DATASETS / f).is_file()]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "dataset(*files): the test reads these files under the shared datasets"
    )
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # the workers share the cores: each takes its part of them
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


#: Modules whose tests are independent of each other and cheap to set up, so that under
#: ``pytest -n`` each test may go to any worker (the documentation pages run for minutes each).
SPREAD_MODULES = ("test_docs.py",)


#: Modules of a minute or more of CPU (measured with both workers busy), longest first: they
#: start right after the documentation pages so that short modules fill the end.
LONG_MODULES = (
    "test_plan_measured.py",
    "test_fullgraph_training.py",
    "test_launchers.py",
    "test_pipeline_train.py",
    "test_fullgraph.py",
    "test_compile.py",
    "test_shard.py",
    "test_offload.py",
    "test_link.py",
    "test_typed_train.py",
    "test_fullgraph_rgcn.py",
    "test_lora.py",
    "test_snapshots.py",
)


def _start_order(item: pytest.Item) -> int:
    name = item.path.name
    if name in SPREAD_MODULES:
        return 0
    return 1 + LONG_MODULES.index(name) if name in LONG_MODULES else 1 + len(LONG_MODULES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The documentation pages first, then the long modules (stable otherwise): two workers
    finish together when the long work starts early and short modules fill the end."""
    items.sort(key=_start_order)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``make test`` runs two workers): the tests of one module go to one
    worker, in order, so a module's shared world (a module-scoped fixture that starts 8
    ranks) starts once, not once per worker; only :data:`SPREAD_MODULES` spread test by
    test."""
    from xdist.scheduler import LoadScopeScheduling

    # xdist would hand out the scopes with the most tests first, which puts the documentation
    # pages (one test each, the longest) last: keep the order of the collection instead.
    config.option.loadscopereorder = False

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return nodeid if module.endswith(SPREAD_MODULES) else module

    return ModuleScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("dataset"):
        missing = missing_datasets(mark.args)
        if not missing:
            continue
        msg = f"dataset files missing under {DATASETS}: {', '.join(missing)}"
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{msg} ({REQUIRE}=1 makes this a failure)", pytrace=False)
        pytest.skip(msg)


@pytest.fixture
def one_process(monkeypatch, tmp_path) -> Path:
    """A plain process (no launcher variables), gnnpar's cache in ``tmp_path``, and a small
    text file for the gpt task (returned)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GNNPAR_DATA", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 400, encoding="utf-8")
    return text


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (tests share two cores with other jobs: more would
    oversubscribe them); modules that want it for every test set
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
