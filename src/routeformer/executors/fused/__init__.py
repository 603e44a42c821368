"""The fused CPU executor: C++ kernels against ATen (``csrc/``), compiled at first use (``build.py``), registered as
``torch.ops.routeformer_fused`` with fake implementations and autograd (``op.py``), and the executor's Python front
end (``executor.py``)."""

from .build import ENV_SWITCH, KERNELS, BuildStatus, FusedKernelRequired, FusedKernelUnavailable, KernelBuild
from .executor import available, fused_ranges, fused_tiled

__all__ = ["ENV_SWITCH", "KERNELS", "BuildStatus", "FusedKernelRequired", "FusedKernelUnavailable", "KernelBuild",
           "available", "fused_ranges", "fused_tiled"]
