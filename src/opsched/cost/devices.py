"""The catalogue of simulated devices: GPUs, with the published figures the analytical model (``simulate.py``)
starts from, and host CPUs (:class:`HostCPU`).

Figures are the vendors' datasheet numbers (peak, boost clock, dense). The K80 entry is one of the board's
two GK210 GPUs, since a framework sees each as its own device (the datasheet's 8.73 TFLOPS and 480 GB/s are
for the pair). ``launch_us`` is the gap between two kernels issued back to back on one stream and
``sync_us`` what joining an extra stream costs (event record + wait); ``blocks_per_sm`` how many GEMM tiles an
SM holds at once (Kepler's SMX is three Volta SMs wide); ``efficiency`` the fraction of the datasheet FP32 peak
that convolution kernels reach relative to Volta (Kepler and GA102 count peaks that need dual issue). None of
these is on a datasheet: they are typical figures for each generation; the calibration against IOS's published
V100 latencies (``benchmarks/cost_accuracy.py``) fixes the V100's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

SIMULATED_PREFIX = "sim:"  # sim:v100, sim:platform:NAME: a device (or a platform) whose figures are simulated


def is_simulated(name: str | None) -> bool:
    """Whether ``name`` (a ``--cost``, a plan's device or cost, a platform device's kind) names something
    simulated: ``sim:v100``, ``sim:xeon``, ``sim:platform:NAME``.

    >>> is_simulated("sim:v100"), is_simulated("measured"), is_simulated(None)
    (True, False, False)
    """
    return isinstance(name, str) and name.startswith(SIMULATED_PREFIX)


@dataclass(frozen=True)
class Device:
    name: str
    full_name: str
    sms: int
    fp32_tflops: float
    fp16_tflops: float
    memory_gbs: float
    launch_us: float
    sync_us: float
    blocks_per_sm: int
    efficiency: float
    source: str

    def describe(self) -> dict:
        return asdict(self)


DEVICES: dict[str, Device] = {d.name: d for d in [
    Device("v100", "NVIDIA Tesla V100 SXM2 16 GB (Volta)", sms=80, fp32_tflops=15.7, fp16_tflops=125.0,
           memory_gbs=900.0, launch_us=8.0, sync_us=10.0, blocks_per_sm=2, efficiency=1.0,
           source="NVIDIA Tesla V100 datasheet and Volta architecture whitepaper (2017)"),
    Device("a100", "NVIDIA A100 SXM4 40 GB (Ampere)", sms=108, fp32_tflops=19.5, fp16_tflops=312.0,
           memory_gbs=1555.0, launch_us=6.0, sync_us=8.0, blocks_per_sm=2, efficiency=1.0,
           source="NVIDIA A100 datasheet and Ampere architecture whitepaper (2020)"),
    Device("h100", "NVIDIA H100 SXM5 80 GB (Hopper)", sms=132, fp32_tflops=67.0, fp16_tflops=989.0,
           memory_gbs=3350.0, launch_us=5.0, sync_us=7.0, blocks_per_sm=2, efficiency=0.8,
           source="NVIDIA H100 datasheet and Hopper architecture whitepaper (2022)"),
    Device("t4", "NVIDIA T4 16 GB (Turing)", sms=40, fp32_tflops=8.1, fp16_tflops=65.0,
           memory_gbs=320.0, launch_us=8.0, sync_us=10.0, blocks_per_sm=2, efficiency=0.9,
           source="NVIDIA T4 datasheet (2018)"),
    Device("rtx3080", "NVIDIA GeForce RTX 3080 10 GB (Ampere)", sms=68, fp32_tflops=29.8, fp16_tflops=119.0,
           memory_gbs=760.0, launch_us=6.0, sync_us=12.0, blocks_per_sm=2, efficiency=0.55,
           source="NVIDIA GA102 (Ampere GA10x) architecture whitepaper (2020); FP32 counts dual issue"),
    Device("k80", "NVIDIA Tesla K80, one GK210 GPU of the board (Kepler)", sms=13, fp32_tflops=4.37,
           fp16_tflops=4.37, memory_gbs=240.0, launch_us=12.0, sync_us=15.0, blocks_per_sm=6, efficiency=0.55,
           source="NVIDIA Tesla K80 datasheet (2014), per GPU (half of the board's figures); no FP16 units"),
]}


@dataclass(frozen=True)
class HostCPU:
    """A simulated host CPU: a unit costs its FLOPs at ``ms_per_gflop`` (a CPU at batch 1 is compute-bound on
    convolutions and, unlike a GPU, has no launch to hide; what it pays per operator is the platform device's
    ``op_overhead``)."""

    name: str
    full_name: str
    ms_per_gflop: float
    source: str

    def latency(self, flops: float) -> float:
        return flops / 1e9 * self.ms_per_gflop


# The Xeon of DiviML's platform. Its speed, with the platform's per-operator overheads, is fitted so that the
# paper's Table II holds on the models it averages (benchmarks/fit_diviml.py prints the fit and the check).
CPUS: dict[str, HostCPU] = {c.name: c for c in [
    HostCPU("xeon", "Intel Xeon (Skylake) 2.0 GHz, DiviML's host CPU", ms_per_gflop=13.74,
            source="fitted to DiviML's Table II (benchmarks/fit_diviml.py)"),
]}


def kind_problem(kind: object) -> str | None:
    """Why ``kind`` is not a device kind (``cpu``, ``cuda:N`` or a known ``sim:NAME``), or None when it is.

    >>> kind_problem("cuda:1"), kind_problem("sim:a100"), kind_problem("tpu")[:25]
    (None, None, "unknown device kind 'tpu'")
    """
    if not isinstance(kind, str):
        return "kind must be a string"
    if kind == "cpu" or (kind.startswith("cuda:") and kind[5:].isdigit()):
        return None
    if is_simulated(kind) and kind.removeprefix(SIMULATED_PREFIX) in (*DEVICES, *CPUS):
        return None
    known = ["cpu", "cuda:N"] + [f"sim:{d}" for d in [*DEVICES, *CPUS]]
    return f"unknown device kind {kind!r}; choose from {', '.join(known)}"
