import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # tests/distributed.py
sys.path.insert(0, os.path.dirname(HERE))  # the repository, also without `pip install -e .`

from distributed import BenchRuns, SharedLaunches  # noqa: E402


@pytest.fixture(scope="session")
def shared(request, tmp_path_factory):
    """`shared.run(WORKER)`: the module's worker's launch, shared with the session's other
    workers of its world size (distributed.SharedLaunches)."""
    return SharedLaunches(request.session, tmp_path_factory)


@pytest.fixture(scope="session")
def bench(tmp_path_factory):
    """`bench.run(*FLAGS)`: the session's one run of tools/bench_rollout.py FLAGS
    (distributed.BenchRuns), shared by the modules that ask for the same flags."""
    return BenchRuns(tmp_path_factory)

