import os

import pytest
import torch
from hypothesis import HealthCheck, settings

if os.environ.get("ROUTEFORMER_TEST_SANITIZE") == "1":  # helpers.SANITIZE
    # The sanitizer target (tests/test_sanitizer.py) runs the fused-kernel tests in a process of their own with this
    # switch and the sanitizers' runtimes preloaded: the kernels are built with AddressSanitizer and UBSan, under a
    # name of their own, and loaded instead of the normal build (whose operators have the same names).
    from helpers import sanitized
    from routeformer.executors import fused
    from routeformer.executors.fused import build, executor

    build.KERNELS = executor.KERNELS = fused.KERNELS = sanitized(build.KERNELS)

# Small, many examples locally; CI and the default run use the same profile so timings stay predictable.
settings.register_profile(
    "default",
    max_examples=int(os.environ.get("ROUTEFORMER_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("default")
# Under pytest-xdist each worker takes its share of the cores; alone, the suite takes up to two.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


@pytest.fixture
def on_device():
    """The device the ``cuda`` tests run on (``helpers.device_under_test``: ROUTEFORMER_TEST_DEVICE, default cuda,
    skipped without a GPU; cpu runs them through FlexAttention's CPU path)."""
    from helpers import device_under_test

    return device_under_test()
