"""The ``sparsecomm`` command line: ``sparsecomm bench sparsify|codecs|collectives ...``,
``sparsecomm train``, ``sparsecomm calibrate`` and ``sparsecomm fuzz``."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sparsecomm.cli.table import format_table, write_json
from sparsecomm.errors import SparseCommError
from sparsecomm.host_memory import keep_freed_host_memory


def _densities(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"densities are numbers separated by commas, got {text!r}") from None
    if not values or any(not 0 < d <= 1 for d in values):
        raise argparse.ArgumentTypeError("each density must be in (0, 1]")
    return values


def _integers(text: str, minimum: int | None) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one value")
    if minimum is not None and min(values) < minimum:
        raise argparse.ArgumentTypeError(f"each value must be >= {minimum}")
    return values


def _int_list(text: str) -> list[int]:
    return _integers(text, minimum=1)


def _seed_list(text: str) -> list[int]:
    return _integers(text, minimum=None)


def _number(text: str) -> float:
    """A number, or the argument's clear refusal."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _positive_int(text: str) -> int:
    """A whole number >= 1 (``1e6`` too)."""
    number = _number(text)
    if not math.isfinite(number) or number != int(number):
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}")
    if number < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return int(number)


def _positive_float(text: str) -> float:
    """A finite number > 0."""
    number = _number(text)
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, not {text!r}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsecomm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks: a table on stdout, --json for machines")
    benches = bench.add_subparsers(dest="bench", required=True)

    def common(sub: argparse.ArgumentParser, numel: int, density: str) -> None:
        sub.add_argument("--numel", type=_positive_int, default=numel, help="gradient size (default %(default)s)")
        sub.add_argument("--density", type=_densities, default=_densities(density),
                         help="fraction kept; comma-separated for several (default %(default)s)")
        sub.add_argument("--source", default="mlp",
                         help="normal, laplace, mlp (a real MLP gradient; default) or a .npy dense gradient")
        sub.add_argument("--repeat", type=_positive_int, default=5, help="timed repeats, median kept")
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--device", default="cpu", help="where the gradient lives: cpu (default) or cuda")
        sub.add_argument("--json", metavar="PATH", help="write the results as JSON")

    sparsify = benches.add_parser("sparsify", help="each sparsifier next to torch.topk and one memory pass")
    common(sparsify, 25_557_032, "0.001")
    sparsify.add_argument("--sparsifier", action="append", metavar="SPEC",
                          help="a sparsifier spec to run (repeatable; default: all)")

    codecs = benches.add_parser("codecs", help="bits, speed and error of every index and value codec")
    common(codecs, 1_000_000, "0.0001,0.001,0.01,0.1")
    codecs.add_argument("--pair", action="append", metavar="INDEX/VALUE",
                        help="an index/value codec pair such as 'rice/qsgd(bits=4)' (repeatable; default: the suite)")
    codecs.add_argument("--plot", metavar="PATH", help="PNG: bits split into indices and values, and run times")
    codecs.add_argument("--suite", choices=["all", "deepreduce", "skcompress"], default="all",
                        help="pairs to run without --pair: all codecs, DeepReduce's combinations, or SKCompress "
                             "next to QSGD (default all)")

    ddp_step = benches.add_parser("ddp-step", help="one DDP step with each preset's hook next to DDP's allreduce")
    ddp_step.add_argument("--device", default="cpu", help="cpu (gloo; default) or cuda (NCCL, one rank per GPU)")
    ddp_step.add_argument("--numel", type=_positive_int, default=25_600_000,
                          help="model parameters (default %(default)s)")
    ddp_step.add_argument("--presets", default=None,
                          help="comma-separated presets or specs (default: every available preset)")
    ddp_step.add_argument("--workers", type=_positive_int, default=1, help="ranks (default 1)")
    ddp_step.add_argument("--repeat", type=_positive_int, default=10, help="timed steps, median kept")
    ddp_step.add_argument("--width", type=_positive_int, default=2048,
                          help="the layers' width (default %(default)s; smaller: more tensors for the same numel)")
    ddp_step.add_argument("--baselines", default="",
                          help="PyTorch's hooks to run as rows too, comma-separated: fp16, powersgd-r1, powersgd-r2")
    ddp_step.add_argument("--count", action="store_true",
                          help="also count each row's aten ops, host syncs and (on a GPU) bytes copied between "
                               "host and device per step (torch's profiler)")
    ddp_step.add_argument("--json", metavar="PATH", help="write the results as JSON")

    collectives = benches.add_parser("collectives", help="every transport next to dense all_reduce and allgather")
    collectives.add_argument("--workers", type=_int_list, default=[2, 4], help="worker counts (default 2,4)")
    collectives.add_argument("--numel", type=_positive_int, default=4_000_000,
                             help="gradient size (default %(default)s)")
    collectives.add_argument("--density", type=_densities, default=_densities("0.0001,0.001,0.01,0.1"),
                             help="fractions kept per rank, comma-separated (default %(default)s)")
    collectives.add_argument("--shaped", metavar="RATE",
                             help="also run on a link shaped to RATE (e.g. 1gbit): needs root and network namespaces")
    collectives.add_argument("--no-loopback", action="store_true", help="with --shaped: skip the loopback run")
    collectives.add_argument("--transport", action="append", metavar="SPEC", help="a transport spec (repeatable)")
    collectives.add_argument("--codecs", default="rice/fp32",
                             help="index/value codecs for allgather (default %(default)s)")
    collectives.add_argument("--repeat", type=_positive_int, default=3,
                             help="rounds of every transport; those within 2x of the fastest, and auto, get up to "
                                  "20x as many (default %(default)s)")
    collectives.add_argument("--seed", type=int, default=0)
    collectives.add_argument("--profile", action="store_true",
                             help="also time each phase of every call (agreement, encode, transfer, decode, sum, "
                                  "output) and print a table of them")
    collectives.add_argument("--json", metavar="PATH", help="write the results as JSON")

    train = commands.add_parser("train", help="train a real workload with each preset next to dense")
    train.add_argument("--workload", default="digits",
                       help="digits (default; scikit-learn's digits, MLP, SGD), cnn (a ResNet with batch normalisation "
                            "on the digits images, SGD), lm (word-level language model with a "
                            "sparse embedding, on the Python standard library's docstrings, SGD), gpt (a "
                            "2M-parameter GPT over the standard library's source bytes, AdamW) or gpt-large (57M "
                            "parameters, for GPUs)")
    train.add_argument("--presets", default=None,
                       help="comma-separated presets or specs (default: every available preset; gpt: adaptive, dgc); "
                            "a row named fsdp-flat:SPEC trains under FSDP2 over every rank, each module's "
                            "reduce-scatter compressed by SPEC (topk(ratio=R)+residual with fp32, fp16 or bf16 values)")
    train.add_argument("--baselines", default="all",
                       help="PyTorch's own DDP communication to run next to the presets, comma-separated: "
                            "allreduce, fp16, powersgd-r1, powersgd-r2, and FSDP2's fsdp and hsdp; 'all' (default: "
                            "its DDP hooks, and FSDP2's rows with --nodes) or 'none'")
    train.add_argument("--workers", type=_positive_int, default=None,
                       help="local workers (default: min(4, CPU cores))")
    train.add_argument("--nodes", type=_positive_int, default=None,
                       help="lay the workers out on this many nodes (default 1; in a torchrun job, the job's "
                            "nodes): with --shaped, each node a network "
                            "namespace whose ranks share its loopback, the nodes joined by the shaped link; every "
                            "preset also runs hierarchically under DDP (row hier:PRESET: dense inside each node, the "
                            "preset between nodes) and FSDP2 (fsdp:PRESET), next to FSDP2's own rows, and each row "
                            "reports the bytes that crossed the link"),
    train.add_argument("--steps", type=_positive_int, default=None,
                       help="steps per row (default: the workload's: 300, gpt 120)")
    train.add_argument("--batch", type=_positive_int, default=None,
                       help="per-worker batch size (default: the workload's: 32, gpt 8)")
    train.add_argument("--optimizer", choices=("sgd", "adamw"), default=None,
                       help="every row's optimizer (default: the workload's): sgd (Nesterov momentum 0.9) or adamw")
    train.add_argument("--lr", type=_positive_float, default=None, help="learning rate (default: the workload's)")
    train.add_argument("--seed", type=_seed_list, default=[0],
                       help="seed, or comma-separated seeds: the metric is then reported as mean ± std over them")
    train.add_argument("--bandwidth", default="1gbit", help="link rate for the modeled communication time")
    train.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="where each worker trains: cpu (default) or cuda (worker r on GPU r modulo the GPUs "
                            "present; collectives on gloo, which carries CUDA tensors through the host)")
    train.add_argument("--shaped", metavar="RATE", default="auto",
                       help="run the workers on a link shaped to RATE (needs root and network namespaces); 'auto' "
                            "(default): the rate that gives the workload the communication-to-compute ratio of "
                            "ResNet-50 on 1 Gbit/s Ethernet; 'none': loopback")
    train.add_argument("--target-loss", type=float, default=None,
                       help="training loss for the time-to-target table (default: the smoothed loss at which "
                            "dense has made 95%% of its improvement)")
    train.add_argument("--json", metavar="PATH", help="write the results as JSON")
    train.add_argument("--plot", metavar="PATH", default="sparsecomm-train.png", help="PNG of the loss curves")

    scaling = commands.add_parser("scaling", help="project a training run to 1-256 workers on 1/10/100 Gbit/s "
                                                  "links (DGC's Figure 6), checked against the run itself")
    scaling.add_argument("--from", dest="source", required=True, metavar="TRAIN_JSON",
                         help="a `sparsecomm train --json` result")
    scaling.add_argument("--check", nargs="*", default=[], metavar="TRAIN_JSON",
                         help="other runs of the same workload (another link or worker count) to hold the "
                              "projection against")
    scaling.add_argument("--per-node", type=_positive_int, metavar="G",
                         help="also project over nodes of G ranks each (a run on several nodes is projected so only, "
                              "G=8 unless told): NVLink- or PCIe-class inside a node, the 1/10/100 Gbit/s network "
                              "between nodes; each row flat, and the sparse presets also hierarchical")
    scaling.add_argument("--json", metavar="PATH", help="write every projected point as JSON")
    scaling.add_argument("--plot", metavar="PATH", default="sparsecomm-scaling.png",
                         help="PNG of speed-up against workers (a run on several nodes: against nodes, NVLink inside), "
                              "one panel per link")

    calibrate = commands.add_parser("calibrate", help="measure the cost model (alpha, beta, codec speed) and save it")
    calibrate.add_argument("--workers", type=_positive_int, default=2)
    calibrate.add_argument("--shaped", metavar="RATE", help="measure on a link shaped to RATE")
    calibrate.add_argument("--output", metavar="PATH", help="where to save (default: $SPARSECOMM_COST_MODEL or "
                                                            "~/.cache/sparsecomm/cost_model.json)")

    fuzz = commands.add_parser("fuzz", help="mutate valid payloads of every codec pair and decode them")
    fuzz.add_argument("--seconds", type=float, default=None, help="run this long (default: 60 unless --inputs)")
    fuzz.add_argument("--inputs", type=_positive_int, default=None, help="stop after this many inputs")
    fuzz.add_argument("--workers", type=_positive_int, default=1, help="processes, each with its own stream")
    fuzz.add_argument("--seed", type=int, default=0)
    fuzz.add_argument("--slow", type=float, default=1.0, metavar="SECONDS",
                      help="a decode slower than this is a finding")
    fuzz.add_argument("--memory-mb", type=float, default=32.0,
                      help="a decode that raises peak memory by more than this is a finding")
    fuzz.add_argument("--json", metavar="PATH", help="write the report, reproducers included, as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_host_memory()  # this process's codec calls, as in the workers `run_local` starts
    try:
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "train":
            return _train(args)
        if args.command == "fuzz":
            return _fuzz(args)
        if args.command == "scaling":
            return _scaling(args)
        from sparsecomm.train.runner import check_device

        check_device(getattr(args, "device", "cpu"))
        if args.bench == "sparsify":
            return _bench_sparsify(args)
        if args.bench == "collectives":
            return _bench_collectives(args)
        if args.bench == "ddp-step":
            return _bench_ddp_step(args)
        return _bench_codecs(args)
    except SparseCommError as err:
        print(f"sparsecomm: error: {err}", file=sys.stderr)
        return 2


def _fuzz(args: argparse.Namespace) -> int:
    from sparsecomm import fuzz

    seconds = args.seconds if args.seconds is not None or args.inputs is not None else 60.0
    report = fuzz.fuzz_parallel(args.workers, seconds, args.inputs, args.seed, args.slow, args.memory_mb)
    summary = report.to_json()
    print(f"\nfuzz: {report.inputs:,} inputs in {report.seconds:.1f} s ({summary['inputs_per_s']:,.0f}/s), "
          f"{args.workers} worker(s), seed {args.seed}; slowest decode {report.slowest_s * 1000:.1f} ms\n")
    outcomes = sorted(report.outcomes)
    rows = [{"mutation": kind, **{outcome: counts.get(outcome, 0) for outcome in outcomes}}
            for kind, counts in sorted(report.by_mutation.items())]
    rows.append({"mutation": "all", **{outcome: report.outcomes[outcome] for outcome in outcomes}})
    print(format_table(rows, ["mutation", *outcomes]))
    for finding in report.findings[:10]:
        print(f"\nfinding: {finding['outcome']} after a {finding['mutation']} mutation "
              f"(expect={finding['expect']}):\n{finding['problem']}\npayload: {finding['payload_hex'][:400]}")
    print(f"\n{len(report.findings)} finding(s)" + (f"; reproducers in {args.json}" if args.json else ""))
    if args.json:
        write_json(args.json, summary)
    return 1 if report.findings else 0


def _bench_sparsify(args: argparse.Namespace) -> int:
    from sparsecomm.bench import sparsify_bench

    results = []
    for density in args.density:
        result = sparsify_bench.run(args.numel, density, args.source, args.repeat, args.seed, args.sparsifier,
                                    args.device)
        results.append(result)
        print(f"\nsparsify: numel={result['numel']:,} density={density} k={result['k']:,} "
              f"source={args.source} device={result['device']} threads={result['threads']}")
        print(f"torch.topk: {result['topk_ms']:.2f} ms   one pass (sum): {result['pass_ms']:.2f} ms\n")
        print(format_table(result["rows"], ["sparsifier", "ms", "speedup_vs_topk", "selected", "target",
                                            "selected_over_target"]))
    if args.json:
        write_json(args.json, results[0] if len(results) == 1 else {"benchmark": "sparsify", "runs": results})
    return 0


def _bench_codecs(args: argparse.Namespace) -> int:
    from sparsecomm.bench import codecs_bench

    pairs = codecs_bench.SUITES[args.suite]()
    if args.pair:
        pairs = []
        for text in args.pair:
            index_text, sep, value_text = text.partition("/")
            if not sep:
                raise SparseCommError(f"--pair takes INDEX/VALUE, got {text!r}")
            pairs.append((index_text.strip(), value_text.strip()))
    result = codecs_bench.run(args.numel, args.density, args.source, args.repeat, args.seed, pairs, args.device)
    print(f"\ncodecs: numel={result['numel']:,} source={args.source} repeat={args.repeat} device={result['device']} "
          f"threads={result['threads']}  (bits per nonzero; bound = log2 C(N,k)/k)\n")
    print(format_table(result["rows"], [
        "density", "index_codec", "value_codec", "index_bits_per_nnz", "bound_bits_per_nnz",
        "index_over_bound_pct", "value_bits_per_nnz", "total_bits_per_nnz", "decoded_nnz", "volume_vs_dense",
        "encode_ms", "decode_ms", "rel_l2_error", "grad_rel_l2_error", "lossless",
    ]))
    for row in result["refused"]:
        print(f"refused at density {row['density']}: {row['index_codec']}/{row['value_codec']}: {row['error']}")
    return _save(args, result, codecs_bench.plot)


def _save(args: argparse.Namespace, result: dict[str, Any], plot: Callable[[dict[str, Any], str], None]) -> int:
    """The ``--json`` file and the ``--plot`` PNG a command was asked for, the results first: a plot
    that cannot be drawn is reported, and loses nothing."""
    if args.json:
        write_json(args.json, result)
    if args.plot:
        try:
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            plot(result, args.plot)
        except (OSError, ValueError) as err:
            print(f"sparsecomm: no plot written to {args.plot}: {err}", file=sys.stderr)
        else:
            print(f"\nplot: {args.plot}")
    return 0


def _specs(text: str) -> list[str]:
    """Comma-separated presets or specs (a comma inside parentheses belongs to its spec)."""
    return [part.strip() for part in re.split(r",(?![^()]*\))", text)]


def _bench_ddp_step(args: argparse.Namespace) -> int:
    from sparsecomm.bench import ddp_step_bench
    from sparsecomm.presets import available_presets, resolve
    from sparsecomm.train.baselines import SHORT_NAMES

    presets = _specs(args.presets) if args.presets else available_presets()
    names = [name.strip() for name in args.baselines.split(",") if name.strip()]
    unknown = [name for name in names if name not in SHORT_NAMES or name == "allreduce"]
    if unknown:
        raise SparseCommError(f"--baselines takes fp16, powersgd-r1, powersgd-r2, not {', '.join(unknown)}")
    for preset in presets:
        resolve(preset)  # refused here, before any worker starts
    layers = ddp_step_bench.layers_for(args.numel, args.width)
    if layers * (args.width * args.width + args.width) < args.numel / 2:
        raise SparseCommError(f"--numel {args.numel:,} at --width {args.width} needs more than the "
                              f"{ddp_step_bench.MAX_LAYERS} layers the model has: widen the layers")
    result = ddp_step_bench.run(presets, args.numel, args.device, args.repeat, args.workers, args.width,
                                tuple(SHORT_NAMES[name] for name in names), args.count)
    print(f"\nddp-step: {result['parameters']:,} parameters in {result['tensors']} tensors, batch {result['batch']}, "
          f"{args.workers} rank(s) on {result['device']} ({result['backend']}); ms: median of {args.repeat} steps, "
          "slowest rank" + ("; ops, syncs and host↔device bytes per step, rank 0, all its threads"
                            if args.count else "") + "\n")
    counted = ["ops_per_step", "syncs_per_step", "host_device_bytes_per_step"]
    columns = ["preset", "ms", "vs_allreduce"] + (counted if args.count else [])
    print(format_table(result["rows"], columns))
    if args.json:
        write_json(args.json, result)
    return 0


def _bench_collectives(args: argparse.Namespace) -> int:
    from sparsecomm.bench import collectives_bench
    from sparsecomm.encode.base import INDEX_CODECS, VALUE_CODECS
    from sparsecomm.netns import ShapedNetwork
    from sparsecomm.spec import parse_spec

    index_codec, sep, value_codec = args.codecs.partition("/")
    if not sep:
        raise SparseCommError(f"--codecs takes INDEX/VALUE, got {args.codecs!r}")
    INDEX_CODECS.parse(index_codec), VALUE_CODECS.parse(value_codec)  # refused here, before any worker starts
    for transport in args.transport or ():
        parse_spec(transport)
    runs: list[str | None] = [None]
    if args.shaped:
        ok, why = ShapedNetwork.available()
        if ok:
            runs = [args.shaped] if args.no_loopback else [None, args.shaped]
        else:
            print(f"sparsecomm: shaped-link run skipped ({why}); measuring on loopback only", file=sys.stderr)
    results = []
    for shaped in runs:
        result = collectives_bench.run(args.workers, args.numel, args.density, args.transport, args.repeat, shaped,
                                       index_codec, value_codec, args.seed, profile=args.profile)
        results.append(result)
        print(f"\ncollectives on {result['shaped']}: numel={args.numel:,} workers={args.workers} "
              f"codecs={args.codecs} repeat={args.repeat} (ms: slowest rank, median of its samples)")
        for world, model in result["cost_models"].items():
            print(f"  P={world}: alpha={model['alpha'] * 1e6:.0f} us, beta={1 / model['beta'] / 1e6:.0f} MB/s")
        print()
        print("  floor = latency + information-bound wire bytes + one output pass over N (timed in every round, "
              "beside the calls);\n  split bound = Ok-Topk's 2k(P-1)/P pairs per rank + output pass\n")
        print(format_table(result["rows"], [
            "workers", "density", "transport", "algorithm", "ms", "samples", "dense_ms", "speedup_vs_dense",
            "predicted_ms", "bound_latency_ms", "bound_wire_ms", "bound_output_ms", "bound_ms", "ratio_to_bound",
            "split_bound_ms", "ratio_to_split_bound", "bytes_sent_per_rank", "exact",
        ]))
        if args.profile:
            from sparsecomm.transport.request import PHASES

            print("\nper phase (ms, median of the slowest rank's time in each phase):\n")
            print(format_table([{"workers": row["workers"], "density": row["density"], "transport": row["transport"],
                                 "ms": row["ms"], **row["phases_ms"]} for row in result["rows"]],
                               ["workers", "density", "transport", "ms", *PHASES]))
    if args.json:
        write_json(args.json, results[0] if len(results) == 1 else {"benchmark": "collectives", "runs": results})
    return 0


def _baselines(text: str, nodes: int = 1) -> list[str]:
    """PyTorch's rows by their short names; ``all``: its DDP hooks, and its FSDP2 rows over several nodes."""
    from sparsecomm.train.baselines import SHORT_NAMES
    from sparsecomm.train.row_names import SHARDED_BASELINES

    known = SHORT_NAMES | {name.removeprefix("torch-"): name for name in SHARDED_BASELINES}
    if text == "none":
        return []
    if text == "all":
        return [*SHORT_NAMES.values(), *(SHARDED_BASELINES if nodes > 1 else ())]
    names = [part.strip().removeprefix("torch-") for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SparseCommError(f"unknown baseline {unknown[0]!r}; available: {', '.join(known)}, all, none")
    return [known[name] for name in names]


def _train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from sparsecomm.presets import available_presets
    from sparsecomm.train import runner, summary
    from sparsecomm.train.row_names import FLAT_FSDP, FSDP, HIERARCHICAL, preset_of
    from sparsecomm.train.update_rule import UpdateRule
    from sparsecomm.train.workloads import workload

    task = workload(args.workload)
    presets = _specs(args.presets) if args.presets else list(task.default_presets or available_presets())
    if "dense" not in presets:
        presets = ["dense", *presets]
    in_job = runner.launched_by_torchrun()
    if in_job:
        args.workers, args.nodes = runner.job_layout(args.workers, args.nodes)
    args.nodes = args.nodes or 1
    if args.nodes > 1:  # each preset flat, hierarchical and under FSDP2; a row named with its layout stays
        presets = [row for preset in presets for row in
                   ((preset, HIERARCHICAL + preset, FSDP + preset) if preset_of(preset) == preset else (preset,))]
    presets = [*(name for name in _baselines(args.baselines, args.nodes) if name not in presets), *presets]
    args.workers = args.workers or runner.default_workers()
    if args.workers % args.nodes:
        raise SparseCommError(f"--workers {args.workers} do not fill --nodes {args.nodes} of equal size")
    runner.check_device(args.device)
    shaped = None if args.shaped == "none" else args.shaped
    if in_job and shaped and args.shaped != "auto":
        raise SparseCommError("--shaped starts its own local workers; inside a torchrun job the job's network is used")
    why = ""
    args.batch, args.steps = args.batch or task.default_batch, args.steps or task.default_steps
    rule = UpdateRule.of(task, args.optimizer, args.lr)  # refused here, before any worker starts
    with contextlib.ExitStack() as stack:
        namespaces = None
        if shaped and not in_job:
            from sparsecomm.netns import ShapedNetwork

            ok, unavailable = ShapedNetwork.available()
            if ok and shaped == "auto":
                shaped, why = runner.default_link(task, args.workers, args.batch, args.seed[0], args.device)
            if ok:
                network = stack.enter_context(ShapedNetwork(args.nodes, shaped) if args.nodes > 1 else
                                              ShapedNetwork(args.workers, shaped))
                namespaces = network.ranks_on_nodes(args.workers)
            else:
                print(f"sparsecomm: cannot shape a link here ({unavailable}): training on loopback, where no "
                      f"compression can pay; the modeled columns (at --bandwidth {args.bandwidth}) are the guide",
                      file=sys.stderr)
        bandwidth = shaped if namespaces and shaped else args.bandwidth  # modeled at the shaped rate
        link = str(shaped) if namespaces else ("the torchrun job's network" if in_job else "loopback")
        reporting = runner.is_reporting_rank()
        if reporting:
            print(_intro(args, task, rule, presets, link, namespaces is not None and shaped is not None))
        with tqdm(total=len(presets) * len(args.seed), unit="row", disable=None if reporting else True) as bar:
            def done(row: str) -> None:
                bar.set_postfix_str(row[:40])
                bar.update()

            runs = [runner.run(task, presets, args.workers, args.steps, args.batch, args.lr, seed,
                               bandwidth, namespaces, args.target_loss, args.device, done, args.optimizer,
                               args.nodes)
                    for seed in args.seed]
    result = runner.over_seeds(runs, args.seed)
    result["link"] = link
    result["link_reason"] = why
    if not reporting:
        return 0  # in a torchrun job, rank 0 reports
    nodes = f" on {args.nodes} nodes" if args.nodes > 1 else ""
    print(f"\ntrain {args.workload}: {result['workers']} workers ({args.device}){nodes} on {result['link']}, "
          f"{args.steps} steps of {args.batch} per worker, {rule.describe()}, same seed for every "
          f"row; modeled communication at {result['bandwidth']}")
    if why:
        print(f"link {why}")
    print()
    print(format_table(result["rows"], [
        "preset", "metric_name", "final_metric", "test_loss", "bytes_per_step", "compression_ratio", "wall_s",
        "compute_s", "encode_s", "communicate_s", "decode_s", "modeled_s", "ranks_identical",
        *(["link_bytes_per_step"] if any("link_bytes_per_step" in row for row in result["rows"]) else []),
    ]))
    if args.nodes > 1:
        print(f"  {HIERARCHICAL}PRESET: DDP, dense inside each node, PRESET between nodes; {FSDP}PRESET: "
              "FSDP2 sharded inside each node, PRESET between nodes: their bytes_per_step are what one rank sends "
              f"between nodes; {FLAT_FSDP}SPEC: FSDP2 over every rank, its reduce-scatter compressed (all a rank "
              "sends); torch-fsdp and torch-hsdp count their gradients' reduction only (FSDP all-gathers "
              "parameters too)" + ("; link_bytes_per_step: all that crossed the shaped link between nodes, by its "
                                   "own counters, from the second step" if namespaces else ""))
    for row in result["rows"]:
        if row.get("note"):
            print(f"  {row['note']}")
    if len(args.seed) > 1:
        print(f"\n{result['rows'][0]['metric_name']} over seeds {', '.join(map(str, args.seed))} (the table above: "
              f"seed {args.seed[0]})\n")
        print(format_table(result["rows"], [
            "preset", "final_metric_mean", "final_metric_std", "metric_vs_reference", "final_metric_by_seed",
        ]))
    if result["target_loss"] is None and args.target_loss is None:
        print(f"\nno time to target: {result['reference']} did not improve its training loss (give one with "
              "--target-loss)")
    if result["target_loss"] is not None:
        print(f"\ntime to a smoothed training loss of {result['target_loss']:.4g} (never reached: -); speed-up over "
              f"{result['reference']}\n")
        print(format_table(result["rows"], [
            "preset", "steps_to_target", "time_to_target_s", "speedup_to_target", "modeled_time_to_target_s",
        ]))
        if len(args.seed) > 1:  # single runs of a few seconds vary by tens of percent here: every seed's
            print(f"\ntime to target over seeds {', '.join(map(str, args.seed))}; speed-up over {result['reference']} "
                  "as mean ± std of each seed's side-by-side ratio\n")
            print(format_table(result["rows"], [
                "preset", "time_to_target_by_seed", "time_to_target_median_s", "speedup_mean", "speedup_std",
            ]))
    if args.nodes == 1 and any(row["preset"] in ("torch-allreduce", "dense") for row in result["rows"]):
        from sparsecomm.train import scaling

        projection = scaling.project(result)
        _print_projection(projection)
        result["scaling"] = projection
        print("\n(`sparsecomm scaling --from RESULT.json` plots it, for every P from 1 to 256)")
    elif args.nodes > 1 and any(row["preset"] in ("torch-allreduce", "dense") for row in result["rows"]):
        from sparsecomm.train.node_scaling import PER_NODE

        result["node_scaling"] = _print_node_projection(result, PER_NODE)
    saved = _save(args, result, runner.plot)
    if result["target_loss"] is not None:
        print(f"\n{summary.verdict(result)}")
    print(summary.usage(result))
    return saved


def _intro(args: argparse.Namespace, task: Any, rule: Any, rows: list[str], link: str, shaped: bool) -> str:
    """`summary.intro` with this run's estimate: the workload's compute per step, measured here."""
    import torch

    from sparsecomm.netns import bits_per_second
    from sparsecomm.train import runner, summary

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.workers))  # as each worker will have
    try:
        compute_s = runner.compute_seconds_per_step(task, args.batch, args.seed[0], rule=rule)
    finally:
        torch.set_num_threads(threads)
    dense_bytes = 4 * sum(p.numel() for p in task.model(args.seed[0]).parameters())
    seconds = summary.estimate_seconds(rows, len(args.seed), args.steps, compute_s, dense_bytes,
                                       bits_per_second(link) if shaped else None)
    where = f"a link shaped to {link}" if shaped else link
    return summary.intro(task.name, rows, len(args.seed), args.steps, args.workers, where, seconds)


def _print_projection(projection: dict[str, Any]) -> None:
    from sparsecomm.train import scaling

    links = ", ".join(f"{name} (alpha {alpha * 1e6:.0f} us)" for name, (_, alpha) in projection["links"].items())
    anchor = projection["anchor"]
    anchored = f"anchored at this run's measured steps on {anchor}" if anchor and anchor[0].isdigit() else \
        "not anchored (no shaped link in this run)"
    print(f"\nprojected speed-up over one worker (compute and codecs as measured here; network: alpha-beta "
          f"model of each row's collectives, {anchored}; {links})\n")
    rows = scaling.table(projection)
    print(format_table(rows, list(rows[0])))
    if projection["check"]:
        print("\nthe projection against other runs' measured steps (median):\n")
        print(format_table(projection["check"], ["preset", "workers", "link", "measured_ms", "projected_ms",
                                                 "error_pct"]))


def _scaling(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from sparsecomm.train import scaling

    def load(path: str) -> dict[str, Any]:
        try:
            result = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise SparseCommError(f"cannot read a train result from {path}: {err}") from None
        if not isinstance(result, dict) or result.get("benchmark") != "train" or not any(
                row.get("preset") in ("dense", "torch-allreduce") for row in result.get("rows", [])):
            raise SparseCommError(f"{path} is not a `sparsecomm train --json` result with a dense row to project from")
        return result

    from sparsecomm.train import node_scaling

    result = load(args.source)
    if result.get("nodes", 1) > 1:  # its flat rows did not each have a link of their own: project over nodes
        print(f"\n(a run on {result['nodes']} nodes: projected over nodes of ranks)")
        projection = _print_node_projection(result, args.per_node or node_scaling.PER_NODE)
        return _save(args, projection, node_scaling.plot)
    projection = scaling.project(result, others=[load(path) for path in args.check])
    _print_projection(projection)
    if args.per_node:
        projection["node_scaling"] = _print_node_projection(result, args.per_node)
    return _save(args, projection, scaling.plot)


def _print_node_projection(result: dict[str, Any], per_node: int) -> dict[str, Any]:
    """The projection over nodes of ``per_node`` ranks (`sparsecomm.train.node_scaling`), one table per
    fabric; returns it."""
    from sparsecomm.train import node_scaling

    projection = node_scaling.project(result, per_node)
    nodes, ranks = projection["anchor_layout"]
    anchor = projection["anchor"]
    anchored = (f"anchored at this run's {nodes} node(s) × {ranks} rank(s) on {anchor}"
                if anchor and anchor[0].isdigit() else "not anchored (no shaped link in this run)")
    hier = "hier: dense inside each node, the preset between nodes" + (
        ", sparse gradients by their rows" if projection.get("sparse_rows") else "")
    for fabric, (rate, alpha) in projection["fabrics"].items():
        print(f"\nprojected speed-up over one rank on nodes of {per_node} ranks joined inside by {fabric} "
              f"({rate / 8e9:.0f} GB/s, alpha {alpha * 1e6:.0f} us); columns: the network between nodes (one link "
              f"per node), nodes × ranks; {hier}; {anchored}\n")
        rows = node_scaling.table(projection, fabric)
        print(format_table(rows, list(rows[0])))
    if projection["check"]:
        print("\nthe model's bytes between nodes per step against what crossed this run's link (headers included):\n")
        print(format_table(projection["check"], ["preset", "measured_bytes", "modeled_bytes", "error_pct"]))
    return projection


def _calibrate(args: argparse.Namespace) -> int:
    from sparsecomm.bench.calibration import calibrate_group
    from sparsecomm.launch import run_local
    from sparsecomm.transport.cost_model import DEFAULT_PATH

    if args.workers < 2:
        raise SparseCommError("calibrate times the link between workers: --workers must be at least 2")
    if args.shaped:
        from sparsecomm.netns import ShapedNetwork

        with ShapedNetwork(args.workers, args.shaped) as network:
            model = run_local(args.workers, calibrate_group, namespaces=network.namespaces)[0]
    else:
        model = run_local(args.workers, calibrate_group)[0]
    path = args.output or os.environ.get("SPARSECOMM_COST_MODEL") or str(DEFAULT_PATH)
    model.save(path)
    print(f"alpha = {model.alpha * 1e6:.1f} us, beta = {1 / model.beta / 1e6:.0f} MB/s, "
          f"codec = {model.codec_per_nnz * 1e9:.0f} ns/nnz, memory pass = {1 / model.pass_per_byte / 1e9:.2f} GB/s, "
          f"sort-merge = {model.sort_per_entry * 1e9:.0f} ns/entry, hash = {model.hash_per_entry * 1e9:.0f} ns/entry")
    print(f"saved to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
