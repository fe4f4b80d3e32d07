"""What `ligertune bench` measures: kernels against torch and peers, and whole training steps.

    from ligertune.bench import KernelBenchConfig, run_kernel_bench
    report = run_kernel_bench(KernelBenchConfig(kernels=("flce",)))
"""

from ligertune.bench.kernels import KernelBenchConfig, run_kernel_bench
from ligertune.bench.results import KernelReport, KernelRow, StepReport, StepRow
from ligertune.bench.step import StepBenchConfig, run_step_bench
from ligertune.bench.timing import Timing, measure

__all__ = [
    "KernelBenchConfig",
    "KernelReport",
    "KernelRow",
    "StepBenchConfig",
    "StepReport",
    "StepRow",
    "Timing",
    "measure",
    "run_kernel_bench",
    "run_step_bench",
]
