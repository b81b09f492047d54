"""The ``opsched`` command line: the parser, and each command handed to its module in
:mod:`opsched.commands` (``opsched NAME`` runs ``opsched.commands.NAME.run``, imported when it runs: the
commands that run models need PyTorch). The method choices come from the registries
(:data:`opsched.schedulers.SCHEDULERS`, :data:`opsched.mapping.solve.METHODS`).

Every subcommand prints a readable summary, or exactly one JSON object on stdout with ``--json``.
Bad input is reported as one line on stderr with exit status 2; a plan that does not reproduce the model
(:class:`~opsched.errors.VerificationError`), and any other failure while running, exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Sequence

from opsched import __version__
from opsched.errors import OpschedError, VerificationError
from opsched.graph.blocks import DEFAULT_MAX_SIZE
from opsched.interrupt import CtrlC
from opsched.mapping.solve import METHODS as MAPPING_METHODS
from opsched.progress import PERIOD, quiet
from opsched.schedulers import SCHEDULERS


def _int_at_least(minimum: int, what: str):
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive = _int_at_least(1, "a positive integer")


def _float_above(least: float, inclusive: bool, what: str):
    """An argparse type: a number >= ``least`` (``inclusive``) or > it; ``what`` names it in the refusal."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (value >= least if inclusive else value > least):  # nan fails both
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_non_negative_float = _float_above(0.0, True, "a number >= 0")
_positive_float = _float_above(0.0, False, "a number of seconds > 0")


class _OneLineParser(argparse.ArgumentParser):
    """Refuses bad arguments in one line (``opsched map: error: ...``), exit status 2, as every other refusal;
    ``--help`` still prints the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")
_non_negative = _int_at_least(0, "an integer >= 0")


def _batch_sizes(text: str) -> list[int]:
    """``1,2,4,8``: positive integers, comma-separated."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes such as 1,2,4,8, got {text!r}") from None
    if any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return sizes


RUNNABLE_MODEL_HELP = ("a zoo name (inception_v3, squeezenet, nasnet, randwire, gpt-small-decode), "
                       "torchvision:NAME, timm:NAME or path/to/file.py:factory")
MODEL_HELP = RUNNABLE_MODEL_HELP + ", a DAG JSON file (*.json), or gpt3-decode (GPT-3's units, for simulated devices)"


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=_positive, metavar="B", help="batch size (rescales the example inputs)")
    p.add_argument("--input-shape", action="append", metavar="SHAPE",
                   help="example input shape such as 1x3x224x224, for a factory that returns a model alone "
                        "(repeat for several inputs)")
    p.add_argument("--image-size", type=_positive, metavar="N",
                   help="image height and width for the zoo, torchvision and timm models (a torchvision video "
                        "model takes a clip of 16 frames of this size, by default its weights' crop)")


def _add_ios_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-r", "--max-group-size", type=_non_negative, default=3, metavar="R",
                   help="ios: at most R units in a group of a stage (0: no limit; default 3)")
    p.add_argument("-s", "--max-groups", type=_non_negative, default=8, metavar="S",
                   help="ios: at most S groups in a stage (0: no limit; default 8)")
    p.add_argument("--max-block-size", type=_non_negative, default=DEFAULT_MAX_SIZE, metavar="N",
                   help=f"ios: cut blocks larger than N units into parts (0: no limit; default {DEFAULT_MAX_SIZE})")


def _add_kernels_option(p: argparse.ArgumentParser, graph: str, whole_on_inductor: bool = False) -> None:
    inductor = (f", and where ONNX Runtime gains little over the default kernels, {graph} as one region compiled by "
                "Inductor, timed beside the plans") if whole_on_inductor else ""
    p.add_argument("--kernels", default="auto", choices=["auto", "eager", "inductor", "onnxruntime"],
                   help=f"how units run: auto (default) runs each block of units of {graph} on the default "
                        "kernels (eager ATen operators, convolutions reordered once) or on an ONNX Runtime session "
                        f"(when installed), whichever measured faster, {graph} possibly as one session{inductor}; "
                        "on a GPU "
                        "and with simulated costs, the default kernels; eager, inductor (compiled by TorchInductor) "
                        "or onnxruntime (each unit or region on a session of its own) run every unit so, and the "
                        "last two add the peers torch.compile and ONNX Runtime to the measurements")


def _add_quiet_option(p: argparse.ArgumentParser) -> None:
    """--quiet, for the commands that say on stderr what they are doing while they work."""
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print no progress on stderr (by default a bar on a terminal, otherwise a line as each "
                        f"phase or long step starts, at most every {PERIOD:g} s while it runs, and as it ends); "
                        "warnings and errors still are")


def _add_run_options(p: argparse.ArgumentParser, reference: str = "eager", cuda_graph: bool = True) -> None:
    """--threads, --repeats and --tolerance (against ``reference``), and --cuda-graph where a run can use it."""
    p.add_argument("--threads", type=_positive, metavar="T",
                   help="intra-op threads to share between streams (default: PyTorch's count)")
    p.add_argument("--repeats", type=_positive, default=15, metavar="N",
                   help="interleaved timing rounds for the final measurements (default 15)")
    p.add_argument("--tolerance", type=_non_negative_float, default=None, metavar="TOL",
                   help=f"largest difference from {reference} accepted, as a fraction of each output's largest "
                        "magnitude (default: from the output's dtype, 3*sqrt(eps): 1.04e-3 for float32)")
    if cuda_graph:
        p.add_argument("--cuda-graph", action="store_true",
                       help="on a CUDA device, replay each schedule as one CUDA graph (the plan records it; "
                            "run uses it when the plan says so or this flag is given)")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="opsched", description="Inter-operator scheduling for PyTorch inference.")
    parser.add_argument("--version", action="version", version=f"opsched {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("graph", help="capture a model and summarise its graph of schedule units",
                       description="Capture a model (or read a DAG JSON file) and summarise its schedule "
                                   "units, edges, blocks and FLOPs.")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    _add_model_options(p)
    p.add_argument("--max-block-size", type=_non_negative, default=DEFAULT_MAX_SIZE, metavar="N",
                   help=f"cut blocks larger than N units into consecutive parts (0: no limit; default "
                        f"{DEFAULT_MAX_SIZE})")
    p.add_argument("--no-split", action="store_true", help="treat the whole graph as one block")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")

    p = sub.add_parser("schedule", help="schedule a DAG JSON graph with the table cost model",
                       description="Schedule a DAG JSON graph with one method and print the stages or streams, "
                                   "the predicted latency against sequential and the lower bound.")
    p.add_argument("graph", metavar="DAG.json", help="the graph: nodes with latencies and edges")
    p.add_argument("--method", required=True, choices=list(SCHEDULERS), help="the scheduler (see docs/schedulers.md)")
    p.add_argument("--streams", type=_non_negative, metavar="K",
                   help="streams for lios and exact (default 8); a cap for greedy and nimble (default none)")
    _add_ios_options(p)
    p.add_argument("--capacity", type=float, default=0.0, metavar="C",
                   help="how many units' worth of work the device does at once (0: unlimited, the default)")
    p.add_argument("--sync-overhead", type=float, default=0.0, metavar="X",
                   help="latency added for each extra group of a stage, or each cross-stream wait (default 0)")
    p.add_argument("--no-split", action="store_true", help="ios: schedule the whole graph as one block")
    p.add_argument("--time-limit", type=_positive_float, default=30.0, metavar="SECONDS",
                   help="exact: CP-SAT time limit (default 30)")
    p.add_argument("--out", metavar="PLAN.json", help="write the schedule (opsched.schedule/1) to this file")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    _add_quiet_option(p)

    p = sub.add_parser("optimize", help="capture, profile, schedule, compile, verify and measure a model",
                       description="The main job: capture MODEL, cost its units (measured on this CPU, or on a "
                                   "simulated GPU), schedule them with sequential, greedy, LIOS and --method, run "
                                   "every schedule, verify it against eager PyTorch and measure it interleaved with "
                                   "the peers (eager; with --peers or --kernels inductor also torch.compile and ONNX "
                                   "Runtime; on --device cuda also the whole model as one CUDA graph). A schedule that does not verify is dropped with a warning. The chosen "
                                   "configuration is the simplest verified one that no other beats above "
                                   "the run's own noise (the model itself first; a smaller gain is a tie); the plan "
                                   "(JSON) is the schedule chosen so among the schedules and records the choice, "
                                   "which opsched run executes. Also draws a Gantt "
                                   "chart (PNG) of the plan's predicted timeline.")
    p.add_argument("model", metavar="MODEL", nargs="?", help=RUNNABLE_MODEL_HELP + " (default: inception_v3)")
    _add_model_options(p)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
    p.add_argument("--cost", default="measured", metavar="measured|sim:NAME",
                   help="measured on this device (default), or a simulated GPU: sim:v100, sim:a100, sim:h100, "
                        "sim:t4, sim:rtx3080, sim:k80 (figures then are simulated and nothing runs)")
    p.add_argument("--method", default="ios", choices=list(SCHEDULERS),
                   help="the scheduler whose plan is written (default ios)")
    _add_kernels_option(p, "the model", whole_on_inductor=True)
    p.add_argument("--peers", action="store_true",
                   help="also time torch.compile of the whole model (freezing on, compiled for each thread count "
                        "in isolation) and ONNX Runtime (when installed) beside eager; the choice (above the run's "
                        "noise) is recorded in the plan")
    p.add_argument("--streams", type=_non_negative, metavar="K", help="streams for lios and exact (default 8)")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[], metavar="B,B,...",
                   help="also make, verify and time a plan for each of these batch sizes (the example inputs "
                        "repeated or cut); the plan file holds every one (opsched.load serves each, opsched show "
                        "lists them)")
    _add_ios_options(p)
    _add_run_options(p)
    p.add_argument("--no-cache", action="store_true", help="measure everything afresh; read and write no cache")
    p.add_argument("--out", metavar="PLAN.json",
                   help="where to write the plan (default opsched-MODEL-bB-METHOD.json, numbered -2, -3, ... "
                        "rather than overwrite an earlier run's files)")
    p.add_argument("--gantt", metavar="PNG", help="where to draw the Gantt chart (default: the plan's name, .png)")
    p.add_argument("--force", action="store_true", help="overwrite --out and --gantt if they exist")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    _add_quiet_option(p)

    p = sub.add_parser("run", help="execute a plan on its model, verify it and measure it against eager",
                       description="Load MODEL, check that PLAN was made for its graph and batch, run the plan, "
                                   "verify its outputs against eager PyTorch and time both, interleaved. A mapped "
                                   "plan (opsched map) runs its devices as threads of this process (--engine "
                                   "local), or as one Ray actor per device, or one for them all when they are on one "
                                   "node (--engine ray, on a local Ray started "
                                   "for the run or the cluster at --address; see docs/ray.md). A plan made by "
                                   "opsched multi takes the same MODELs: the batch is rebuilt as the plan records "
                                   "it (copies, preprocessing, batch, input shapes and rewrites; options not given "
                                   "are taken from the plan, others refused), every model's outputs are verified "
                                   "against its own forward, and the plan is timed against sequential_models.")
    p.add_argument("models", metavar="MODEL", nargs="+",
                   help=RUNNABLE_MODEL_HELP + "; several for a plan made by opsched multi, as they were given to it")
    p.add_argument("--plan", required=True, metavar="PLAN.json",
                   help="a plan written by opsched optimize or opsched multi, or a mapped plan written by opsched map")
    p.add_argument("--copies", type=_positive, metavar="K",
                   help="a multi plan: each MODEL K times, as the plan was made (default: the plan's)")
    p.add_argument("--preprocess", metavar="FILE.py:FACTORY",
                   help="a multi plan: the preprocessing it was made with (default: the plan's)")
    _add_model_options(p)
    _add_run_options(p)
    p.add_argument("--engine", choices=["local", "ray"],
                   help="how a mapped plan's devices run: local, as threads of this process (the default), or "
                        "ray, one Ray actor per device on its node, or one for them all when they are on one node "
                        "(needs pip install 'opsched[ray]')")
    p.add_argument("--address", metavar="ADDR",
                   help="the Ray cluster to run on (HOST:PORT of its head, or auto; implies --engine ray); by "
                        "default --engine ray starts a local Ray for the run and shuts it down after")
    p.add_argument("--trace", metavar="TRACE.json",
                   help="write a Chrome/Perfetto trace of one measured run (local engine)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("show", help="summarise a plan; draw its timeline as a Gantt chart or a trace",
                       description="Summarise PLAN and write its predicted timeline (labelled simulated when it "
                                   "is) as a Gantt chart (PNG) or a Chrome/Perfetto trace (JSON), one row per stream.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--gantt", metavar="PNG", help="draw the Gantt chart here")
    p.add_argument("--trace", metavar="TRACE.json", help="write the Chrome/Perfetto trace here")
    p.add_argument("--force", action="store_true", help="overwrite --gantt and --trace if they exist")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("map", help="map a model or DAG JSON graph onto several devices (DiviML / MILP-SPLIT)",
                       description="Place every unit on a device of a platform and order it there, for latency or "
                                   "throughput, with a lower bound beside the answer (see docs/mapping.md). On a "
                                   "platform whose devices are all real (cpu, cuda:N), the mapped plan is verified "
                                   "against eager and timed interleaved with eager and each device alone; the "
                                   "simplest verified configuration that no other beats above the run's "
                                   "noise is chosen and recorded in the plan.")
    p.add_argument("model", metavar="MODEL|DAG.json", help=MODEL_HELP)
    p.add_argument("--platform", required=True, metavar="NAME|PLATFORM.json",
                   help="a built-in platform (diviml, gpt3-cluster, cpu2) or a PLATFORM.json file")
    p.add_argument("--method", required=True, choices=list(MAPPING_METHODS),
                   help="the mapping algorithm (see docs/mapping.md)")
    p.add_argument("--objective", default="latency", choices=["latency", "throughput"])
    _add_model_options(p)
    p.add_argument("--time-limit", type=_positive_float, default=30.0, metavar="S",
                   help="seconds for sa, ea, milp and milp-split (default 30)")
    p.add_argument("--seed", type=_non_negative, default=0, metavar="N", help="random seed of sa and ea (default 0)")
    p.add_argument("--symmetry", default="none", choices=["none", "batch", "task", "time"],
                   help="milp and milp-split: order interchangeable devices within a node, and interchangeable "
                        "nodes, by their pieces, units or busy time (default none)")
    _add_run_options(p, reference="eager (a platform whose devices are all real: the mapped plan, each device "
                                   "alone and eager are verified and timed)", cuda_graph=False)
    p.add_argument("--no-cache", action="store_true", help="measure everything afresh; read and write no cache")
    p.add_argument("--out", metavar="PLAN.json", help="write the mapped plan (opsched.schedule/1) here")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_quiet_option(p)

    p = sub.add_parser("multi", help="several models as one fused, scheduled program (HiveMind), verified per model",
                       description="Capture every MODEL (each --copies times, each copy with its own seeded random "
                                   "weights) into one graph, compute shared work once and batch the same unit of "
                                   "different models into one kernel where the cost model says it pays, schedule "
                                   "it with sequential, LIOS, HiveMind and --method, verify every model's outputs "
                                   "against its own forward, and time the plans interleaved with running the models "
                                   "one after another (sequential_models), on threads, and with vmap (identical "
                                   "architectures). The simplest verified configuration that no other beats "
                                   "above the run's noise is chosen and recorded in the plan (see docs/multi.md).")
    p.add_argument("models", metavar="MODEL", nargs="+",
                   help=RUNNABLE_MODEL_HELP + "; a model file's factory may return a list of (model, inputs) pairs")
    p.add_argument("--copies", type=_positive, default=1, metavar="K", help="each MODEL K times (default 1)")
    p.add_argument("--preprocess", metavar="FILE.py:FACTORY",
                   help="a module (say a torchvision.transforms.v2 pipeline; the factory returns it and its example "
                        "raw input) run once on the shared input, every model reading its result")
    _add_model_options(p)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
    p.add_argument("--cost", default="measured", metavar="measured|sim:NAME",
                   help="measured on this CPU (default), or a simulated GPU (figures then are simulated)")
    p.add_argument("--method", default="hivemind", choices=list(SCHEDULERS),
                   help="the scheduler whose plan is written when costs are simulated (default hivemind; measured, "
                        "the schedule chosen above the run's noise is written)")
    p.add_argument("--no-fuse", action="store_true", help="no rewrites: the models' units as captured")
    _add_kernels_option(p, "the fused graph of the models")
    p.add_argument("--peers", action="store_true",
                   help="also time torch.compile of the loop over the models (freezing on, compiled for 1 and all "
                        "threads) and, when onnxruntime is installed, every model in an ONNX Runtime session of its "
                        "own, one after another and all at once (on with --kernels inductor or onnxruntime)")
    _add_run_options(p, reference="each model's own forward")
    p.add_argument("--train", action="store_true",
                   help="also train the models (SGD, cross-entropy on seeded random labels) fused and one after "
                        "another, and compare time per step and parameters")
    p.add_argument("--steps", type=_positive, default=20, metavar="N", help="--train: about N SGD steps, each training the same number (1 + 2 x timed rounds; default 20 "
                        "gives 19)")
    p.add_argument("--lr", type=_learning_rates, default=[0.01], metavar="LR[,LR...]",
                   help="--train: a learning rate per model, or one for all (default 0.01)")
    p.add_argument("--no-cache", action="store_true", help="measure everything afresh; read and write no cache")
    p.add_argument("--out", metavar="PLAN.json", help="where to write the plan (default opsched-multi-...json, "
                                                        "numbered rather than overwrite)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    _add_quiet_option(p)

    p = sub.add_parser("serve", help="serve models over the Open Inference Protocol (KServe v2, Triton's HTTP), "
                                     "requests batched across time",
                       description="Start an HTTP server speaking the Open Inference Protocol (KServe v2, the protocol "
                                   "of Triton's HTTP endpoint, with its binary tensor extension) for every MODEL. "
                                   "Each model's requests that arrive within --max-delay-ms of the oldest one waiting "
                                   "run as one call of up to --max-batch samples; its plans for the batch sizes the batcher "
                                   "forms are prepared at startup in the background (opsched optimize, or a plan "
                                   "file given with NAME=MODEL@PLAN.json), the model answering itself until they "
                                   "are (with --engine ray, 503 until its deployment runs); requests for several "
                                   "models that meet in a batch run as one call of the "
                                   "models' fused graph where that is faster (opsched multi's fusion, verified per "
                                   "model). /v2/health/ready "
                                   "answers 200 once all are prepared. SIGTERM or Ctrl-C stops "
                                   "accepting, answers what was accepted and exits (see docs/serving.md).")
    p.add_argument("models", metavar="MODEL", nargs="+",
                   help=RUNNABLE_MODEL_HELP + "; NAME=MODEL serves it as NAME (default: the name after ':'), "
                        "MODEL@PLAN.json serves a saved plan of opsched optimize for it")
    _add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_int_at_least(0, "a port number"), default=8000,
                   help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--max-delay-ms", type=_non_negative_float, default=2.0, metavar="D",
                   help="how long a request waits for others to batch with it (default 2)")
    p.add_argument("--max-batch", type=_positive, default=8, metavar="B",
                   help="most samples in one call of a model (default 8); a request holds at most B")
    p.add_argument("--queue-size", type=_positive, default=64, metavar="Q",
                   help="requests that may wait for a model; past it the server answers 503 at once (default 64)")
    p.add_argument("--max-body-mb", type=_positive_float, default=64.0, metavar="MB",
                   help="largest request body taken (default 64; larger gets 413)")
    p.add_argument("--no-optimize", action="store_true", help="serve the models as they are, with no plans")
    p.add_argument("--no-fuse", action="store_true",
                   help="run requests for several models as one call per model, never as one call of their fused "
                        "graph (otherwise, for two models or more that batch and unless --no-optimize, the fused "
                        "graph of all the models is made at startup, and a batch runs as one call of it when its "
                        "models would take longer one by one, by the startup's timings)")
    p.add_argument("--fuse-max-batch", type=_positive, default=2, metavar="F",
                   help="the fused graph's plans are made for up to F samples of each model (1, 2, 4, ... up to F; "
                        "default 2): a batch holding more of one model runs each model apart. Each size is a search "
                        "of all the models' fused graph: with 16 small CNNs on 2 cores, four sizes did not end "
                        "within 10 minutes")
    p.add_argument("--engine", choices=["local", "process", "ray"], default=None,
                   help="where the models run: process (default) in a process of their own on this machine, "
                        "so that the models' Python work and the protocol's each take a core and neither holds up "
                        "the other (local where the models cannot be pickled, said once); local in the server's "
                        "process; ray in Ray Serve deployments, one "
                        "per group of models batched together, behind the same front end, on a local Ray started "
                        "for the server or the cluster at --address (see docs/serving.md)")
    p.add_argument("--replicas", type=_positive, default=None, metavar="N",
                   help="replicas of each deployment (--engine ray; default 1), each on its share of the CPUs")
    p.add_argument("--address", metavar="ADDR",
                   help="the Ray cluster to serve on (HOST:PORT of its head, or auto; implies --engine ray)")
    p.add_argument("--repeats", type=_positive, default=15, metavar="N",
                   help="interleaved timing rounds when each plan is prepared (default 15)")
    p.add_argument("--kernels", default="auto", choices=["auto", "eager", "inductor", "onnxruntime"],
                   help="how the plans' units run (default auto: each block of units on ONNX Runtime or on eager "
                        "kernels, whichever measured faster; see opsched optimize)")
    p.add_argument("--no-cache", action="store_true", help="measure everything afresh; read and write no cache")
    p.set_defaults(json=False)

    p = sub.add_parser("bench", help="run the papers' comparisons (presets) and write CSV, markdown and plots",
                       description="Run a benchmark preset: for each model x method x cost x batch, the predicted "
                                   "latency, the measured one where the device is real (interleaved with eager), "
                                   "speedup over sequential, search time, DP states/transitions and the lower "
                                   "bound. Writes OUT/results.csv (resumable: rows already there are skipped), "
                                   "OUT/results.md and plots.")
    p.add_argument("--preset", default="quick",
                   choices=["quick", "schedules", "pruning", "specialisation", "search-cost"],
                   help="which comparison (default quick)")
    p.add_argument("--models", nargs="+", metavar="MODEL", help="replace the preset's models")
    p.add_argument("--methods", nargs="+", metavar="M",
                   help="replace the preset's methods (sequential, greedy, ios-merge, ios-parallel, ios, lios, nimble)")
    p.add_argument("--cost", nargs="+", metavar="COST", help="replace the preset's cost models (measured, sim:NAME)")
    p.add_argument("--batch", nargs="+", type=_positive, metavar="B", help="replace the preset's batch sizes")
    p.add_argument("--repeats", type=_positive, default=9, metavar="N", help="interleaved timing rounds (default 9)")
    p.add_argument("--torch-compile", action="store_true", help="also time torch.compile of the whole model")
    p.add_argument("--out", default="opsched-bench", metavar="DIR", help="output directory (default opsched-bench)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_quiet_option(p)

    p = sub.add_parser("cache", help="the cache of measured latencies and ONNX exports: info or clear",
                       description="Show (info) or empty (clear) the sqlite cache of measured latencies and the ONNX "
                                   "exports kept beside it (onnx/, at most 2 GiB), in $OPSCHED_CACHE_DIR, else "
                                   "$XDG_CACHE_HOME/opsched, else ~/.cache/opsched.")
    p.add_argument("action", choices=["info", "clear"])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _learning_rates(text: str) -> list[float]:
    try:
        rates = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected learning rates joined by commas, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"learning rates must be positive, got {text!r}")
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit status (0, 1 failure while running, 2 bad input, 130 Ctrl-C)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with CtrlC() as ctrl_c:
            try:
                return _run(args, ctrl_c)
            except BrokenPipeError:
                # The reader (head, less) went away: stop quietly, as other command-line tools do.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
            except KeyboardInterrupt:  # a second Ctrl-C while the first was being reported
                return 130
    except KeyboardInterrupt:
        # held during an import as the command ended, and delivered on leaving CtrlC: _run saw it pressed and
        # reported it already (a second "opsched: interrupted" came from here, at the end of a map run)
        return 130


def _run(args: argparse.Namespace, ctrl_c: CtrlC) -> int:
    try:
        with quiet(getattr(args, "quiet", False)):  # only the commands that print progress take --quiet
            result = importlib.import_module(f"opsched.commands.{args.command}").run(args)
    except KeyboardInterrupt:
        return _interrupted()
    except (OpschedError, ValueError, RuntimeError) as e:
        if ctrl_c.pressed:  # the interrupt was caught by a library and surfaced as this error
            return _interrupted()
        if isinstance(e, VerificationError):
            print(f"opsched: error: {e}", file=sys.stderr)
            return 1
        if isinstance(e, OpschedError):
            print(f"opsched: error: {e}", file=sys.stderr)
            return 2
        lines = str(e).strip().splitlines() or [type(e).__name__]  # a failure while running: one line
        print(f"opsched: error: {type(e).__name__}: {lines[0]}", file=sys.stderr)
        return 1
    if ctrl_c.pressed:  # the KeyboardInterrupt was dropped on its way (a destructor, a callback)
        return _interrupted()
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    return 0


def _interrupted() -> int:
    print("opsched: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":  # python -m opsched.cli (the opsched executable is opsched.__main__)
    raise SystemExit(main())
